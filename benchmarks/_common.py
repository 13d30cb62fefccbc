"""Helpers shared by the benchmark scripts: machine description, statistics, tables, RESULTS.md sections.

The benchmarks are scripts (``python benchmarks/overhead.py``); each puts this folder on ``sys.path`` and
imports this module, so nothing here is part of the installed package.
"""
import contextlib
import datetime
import os
import platform
import re
import shlex
import statistics
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

import torch

from aitoolbox.torchtrain.precision.factory import cpu_capability, cpu_has_native_bfloat16

BENCHMARKS_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCHMARKS_DIR.parent
RESULTS_PATH = BENCHMARKS_DIR / "RESULTS.md"


def set_threads(num_threads: int) -> int:
    """Fix torch's intra-op thread count (the machine is shared: never let torch pick) and return it."""
    if num_threads < 1:
        raise ValueError(f"--threads must be >= 1, got {num_threads}")
    torch.set_num_threads(num_threads)
    return torch.get_num_threads()


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(device: torch.device) -> Dict[str, str]:
    """What a reader needs to judge a number: date, CPU, cores, threads, versions, accelerator."""
    try:
        usable_cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable_cores = os.cpu_count() or 0
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": f"{cpu_model()} ({usable_cores} usable cores of {os.cpu_count()})",
        # use_amp=True trains in bfloat16 only where the CPU computes it natively (else float32): numbers of
        # mixed-precision runs on the CPU mean little without this line.
        "cpu capability": f"{cpu_capability()}, native bfloat16: {'yes' if cpu_has_native_bfloat16() else 'no'}",
        "torch threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def load_average() -> str:
    """The 1-minute load average: above the core count, other processes competed for the CPUs."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "unknown"


def command_line() -> str:
    """The command that produced the output, as a user would type it from the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(REPO_ROOT)
    except ValueError:
        pass
    return shlex.join(["python", str(script), *sys.argv[1:]])


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured markdown table (cells already formatted)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def info_lines(info: Dict[str, str]) -> str:
    return "\n".join(f"- {key}: {value}" for key, value in info.items())


@contextlib.contextmanager
def fds_to_devnull(fds: Sequence[int]) -> Iterator[None]:
    """Send everything written to the given file descriptors to /dev/null for the duration of the block.

    Redirecting ``sys.stderr`` is not enough: the aitoolbox log handler and tqdm may hold the original
    stream objects, so the descriptors themselves are swapped. The swap happens outside any timed region.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in fds}
    devnull_fd = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in saved:
            os.dup2(devnull_fd, fd)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved_fd in saved.items():
            os.dup2(saved_fd, fd)
            os.close(saved_fd)
        os.close(devnull_fd)


def stderr_to_devnull():
    """Silence file descriptor 2 (TrainLoop's progress bars and log lines) for the block."""
    return fds_to_devnull((2,))


def output_to_devnull():
    """Silence file descriptors 1 and 2 (Lightning's progress bars write to stdout) for the block."""
    return fds_to_devnull((1, 2))


def update_results_section(section: str, body: str, path: Optional[Path] = None) -> Path:
    """Replace the text between ``<!-- BEGIN section -->`` and ``<!-- END section -->`` in RESULTS.md.

    The section is appended when the markers are missing; text outside the markers is left alone.
    """
    path = path or RESULTS_PATH
    begin, end = f"<!-- BEGIN {section} -->", f"<!-- END {section} -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), flags=re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)
    return path


def fmt_ratio(value: float) -> str:
    return f"{value:.3f}"


def fmt_list(values: List[float], digits: int = 3) -> str:
    return ", ".join(f"{v:.{digits}f}" for v in values)


class RankShare(torch.utils.data.Sampler):
    """A hand-written worker's share of another sampler's order, as ``fit_distributed`` shards a training loader's
    sampler: every rank draws the whole order (the sampler's own generator, alike in every rank) and rank r takes
    positions r, r + W, ... of it, padded with its first positions to a multiple of W (as DistributedSampler pads).
    """

    def __init__(self, sampler: torch.utils.data.Sampler, rank: int, world_size: int):
        self.sampler, self.rank, self.world_size = sampler, rank, world_size

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.world_size)

    def __iter__(self) -> Iterator[int]:
        order = list(self.sampler)
        order += order[:len(self) * self.world_size - len(order)]
        return iter(order[self.rank::self.world_size])
