"""examples/vit_amp: the four precision configurations under every launcher, and the benchmark table.

All runs use a tiny ViT (width 32, one block, 16x16 images) on 128 synthetic training images.
"""
import json
import re

import pytest

from tests.examples.support import EXAMPLES, clean_environment, finish_all, free_port, run, start

FOLDER = EXAMPLES / "vit_amp"
TINY = ["--set", "HIDDEN_SIZE=32", "--set", "DEPTH=1", "--set", "NUM_HEADS=2", "--set", "IMAGE_SIZE=16",
        "--set", "NUM_TRAIN_SAMPLES=128", "--set", "NUM_TEST_SAMPLES=64", "--batch-size", "32", "--epochs", "2",
        "--no-progress"]
NAMES = {"config_fp32.py": "FP32 training", "config_AMP_torch.py": "AMP torch",
         "config_AMP_naive.py": "AMP naive", "config_AMP_apex.py": "AMP apex O1"}
PRECISION = {  # what each configuration's TrainLoop runs with on a CPU
    "config_fp32.py": "autocast_dtype=None, loss_scaler=None",
    "config_AMP_torch.py": "autocast_dtype=torch.bfloat16, loss_scaler=None",
    "config_AMP_naive.py": "autocast_dtype=None, loss_scaler=LossScaler(dynamic",
    # O1 in bfloat16 (the CPU's type) scales no loss unless loss_scale is given.
    "config_AMP_apex.py": "autocast_dtype=torch.bfloat16, loss_scaler=None",
}


def train_command(config: str):
    return ["train.py", "--config", f"config/{config}", *TINY]


def check_report(output: str, config: str, launcher: str) -> float:
    name = re.escape(NAMES[config])
    assert re.search(rf"^\[{name}\] launcher: {launcher}; precision: .*{re.escape(PRECISION[config])}", output,
                     re.MULTILINE), output
    match = re.search(rf"^\[{name}\] Test accuracy: ([0-9.]+) \(64 images\)$", output, re.MULTILINE)
    assert match, output
    assert re.search(rf"^\[{name}\] final training loss: [0-9.]+$", output, re.MULTILINE), output
    return float(match.group(1))


@pytest.mark.parametrize("config", [pytest.param("config_fp32.py", marks=pytest.mark.extended), "config_AMP_apex.py"])
def test_plain_python_single_process(config):
    output = run(train_command(config), cwd=FOLDER).stdout
    # 10 classes: chance is 0.1; the prototypes are easy to tell apart even for a tiny ViT.
    assert check_report(output, config, "plain python") > 0.2


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("config", ["config_AMP_torch.py", "config_AMP_naive.py"])
def test_plain_python_other_precisions(config):
    output = run(train_command(config), cwd=FOLDER).stdout
    assert check_report(output, config, "plain python") > 0.2


@pytest.mark.slow
@pytest.mark.extended
def test_own_launcher_starts_two_cpu_processes():
    output = run([*train_command("config_AMP_apex.py"), "--nproc", "2"], cwd=FOLDER,
                 env=clean_environment(threads=1)).stdout
    check_report(output, "config_AMP_apex.py", "fit_distributed, 2 processes")


@pytest.mark.slow
def test_torchrun_processes_join_through_fit_distributed():
    command = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), *train_command("config_AMP_naive.py")]
    output = run(command, cwd=FOLDER, env=clean_environment(threads=1)).stdout
    check_report(output, "config_AMP_naive.py", "torchrun, 2 processes")
    assert output.count("Test accuracy") == 1  # only rank 0 reports


def _run_two_ranks(config: str, rank_variables) -> str:
    port = str(free_port())
    processes = [start(train_command(config), FOLDER,
                       clean_environment({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, **rank_variables(rank)}))
                 for rank in range(2)]
    rank0, rank1 = finish_all(processes)
    assert "Test accuracy" not in rank1
    return rank0


@pytest.mark.slow
@pytest.mark.extended
def test_slurm_environment_two_tasks():
    # What `srun --ntasks=2 python train.py ...` sets in each task.
    def slurm(rank):
        return {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": "2",
                "SLURM_NODELIST": "localhost", "SLURM_JOB_NAME": "vit_amp", "SLURM_JOB_ID": "1"}
    check_report(_run_two_ranks("config_fp32.py", slurm), "config_fp32.py", "slurm, 2 processes")


@pytest.mark.slow
@pytest.mark.extended
def test_openmpi_environment_two_ranks():
    # What `mpirun -np 2 -x MASTER_ADDR -x MASTER_PORT python train.py ...` sets in each rank.
    def openmpi(rank):
        return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
                "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    check_report(_run_two_ranks("config_AMP_torch.py", openmpi), "config_AMP_torch.py", "openmpi, 2 processes")


def test_bad_configuration_override_is_reported():
    failed = run(["train.py", "--config", "config/config_fp32.py", "--set", "depth=2"], cwd=FOLDER,
                 expect_success=False)
    assert failed.returncode != 0 and "must look like KEY=VALUE" in failed.stderr


@pytest.mark.slow
@pytest.mark.extended
def test_benchmark_prints_the_table_of_four_modes_and_draws_the_chart(tmp_path):
    chart, raw = tmp_path / "amp_modes.png", tmp_path / "results.json"
    options = [item for item in TINY if item not in ("--epochs", "2", "--no-progress")]
    output = run(["benchmark.py", *options, "--warmup", "1", "--iters", "2", "--plot", chart, "--json", raw],
                 cwd=FOLDER).stdout
    lines = [line for line in output.splitlines() if line.startswith("| ")]
    header, rows = lines[0], lines[2:]
    assert "RAM/GB (peak RSS rise)" in header and "Iteration/s" in header and "throughput (samples/s)" in header
    assert [row.split("|")[1].strip() for row in rows] == list(NAMES.values())
    for row in rows:
        numbers = [float(cell) for cell in row.strip("| ").split("|")[1:]]
        assert len(numbers) == 4 and all(number > 0 for number in numbers), row
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads(raw.read_text())
    # The naive mode (everything bfloat16) holds half the parameter/gradient/optimizer bytes of FP32 (up to
    # AdamW's scalar step counters, which stay float32).
    tensor_bytes = {result["name"]: result["tensor_gb"] for result in results}
    assert tensor_bytes["AMP naive"] == pytest.approx(tensor_bytes["FP32 training"] / 2, rel=1e-3)
    assert tensor_bytes["AMP torch"] == tensor_bytes["AMP apex O1"] == tensor_bytes["FP32 training"]
