"""Running the example scripts in fresh processes, as a user would, and reading what they print."""
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = REPO_ROOT / "examples"
# Generous: each run is designed to take seconds, but other processes may be competing for the 2 cores.
TIMEOUT_S = 300
# A test process started under torchrun / SLURM / OpenMPI must not hand those variables to the examples,
# which would then try to join that job.
LAUNCHER_VARIABLES = re.compile(r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|MASTER_ADDR|MASTER_PORT|"
                                r"TORCHELASTIC_.*|SLURM_.*|OMPI_.*|PMI_.*)$")


def clean_environment(extra: Optional[Dict[str, str]] = None, threads: int = 1) -> Dict[str, str]:
    """This process's environment without launcher variables, with ``threads`` OpenMP threads and ``extra``."""
    env = {key: value for key, value in os.environ.items() if not LAUNCHER_VARIABLES.match(key)}
    env["OMP_NUM_THREADS"] = str(threads)
    env.update(extra or {})
    return env


def run(args: Sequence[str], cwd: Path = REPO_ROOT, env: Optional[Dict[str, str]] = None,
        expect_success: bool = True) -> subprocess.CompletedProcess:
    """Run ``python args...``; with ``expect_success`` fail the test (showing the output) unless it exits 0."""
    completed = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=env or clean_environment(),
                               capture_output=True, text=True, timeout=TIMEOUT_S)
    if expect_success:
        assert completed.returncode == 0, (f"{' '.join(map(str, args))} exited with {completed.returncode}\n"
                                           f"--- stdout ---\n{completed.stdout[-5000:]}\n"
                                           f"--- stderr ---\n{completed.stderr[-5000:]}")
    return completed


def start(args: Sequence[str], cwd: Path, env: Dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *map(str, args)], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish_all(processes: List[subprocess.Popen]) -> List[str]:
    """Wait for every process; all must exit 0. Returns their stdouts. Kills the rest on a failure."""
    outputs = []
    try:
        for rank, process in enumerate(processes):
            stdout, stderr = process.communicate(timeout=TIMEOUT_S)
            assert process.returncode == 0, (f"process {rank} exited with {process.returncode}\n"
                                             f"--- stdout ---\n{stdout[-5000:]}\n--- stderr ---\n{stderr[-5000:]}")
            outputs.append(stdout)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    return outputs


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
