"""examples/imagenet/main_amp.py: the Summary commands of apex's ImageNet example on a tiny ImageFolder.

Every run trains ``resnet_tiny`` on 32x32 images (3 classes x 8 training images, 3 x 4 validation images)
for one epoch of 3 iterations and checks what the script prints and the checkpoint it writes.
"""
import re
from pathlib import Path

import pytest
import torch

from tests.examples.support import EXAMPLES, clean_environment, free_port, run

pytest.importorskip("PIL", reason="the ImageNet example reads images with pillow (pip install pillow)")

SCRIPT = EXAMPLES / "imagenet" / "main_amp.py"
TINY = ["-a", "resnet_tiny", "--b", "8", "--workers", "0", "--image-size", "32", "--epochs", "1"]
VALIDATION = re.compile(r"^ \* Prec@1 ([0-9.]+) Prec@5 ([0-9.]+) Loss ([0-9.]+) \((\d+) images\)$", re.MULTILINE)


@pytest.fixture(scope="module")
def tiny_imagefolder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny_imagenet")
    completed = run([EXAMPLES / "imagenet" / "make_tiny_imagefolder.py", root])
    assert "wrote 36 images" in completed.stdout
    for split, count in (("train", 24), ("val", 12)):
        assert len(list((root / split).glob("*/*.png"))) == count
    return root


def train(data: Path, checkpoint_dir: Path, *options: str, env=None) -> str:
    completed = run([SCRIPT, *TINY, *options, "--checkpoint-dir", checkpoint_dir, data], env=env)
    return completed.stdout


def validation_results(output: str):
    """(top-1, top-5, loss, images) of each validation the script printed."""
    return [(float(a), float(b), float(c), int(d)) for a, b, c, d in VALIDATION.findall(output)]


def load_checkpoint(folder: Path) -> dict:
    return torch.load(folder / "checkpoint.pth.tar", map_location="cpu", weights_only=True)


def assert_trained_one_epoch(output: str, folder: Path) -> dict:
    assert re.search(r"^Epoch: \[0\]\[2/3\]\tTime .*\tLoss [0-9.]+ .*\tPrec@1 .*\tPrec@5", output, re.MULTILINE), output
    [(top1, top5, loss, images)] = validation_results(output)
    assert images == 12 and 0.0 <= top1 <= 100.0
    assert top5 == 100.0  # 3 classes: the true class is always among the top 5
    assert loss == loss  # not NaN
    checkpoint = load_checkpoint(folder)
    assert set(checkpoint) == {"epoch", "arch", "state_dict", "best_prec1", "optimizer", "amp"}
    assert checkpoint["epoch"] == 1 and checkpoint["arch"] == "resnet_tiny"
    assert (folder / "model_best.pth.tar").exists()
    # Whatever the opt level, the saved weights are float32 and load into a float32 model (apex's behaviour).
    assert all(t.dtype == torch.float32 for t in checkpoint["state_dict"].values() if t.is_floating_point())
    assert not any(key.startswith("module.") for key in checkpoint["state_dict"])
    assert "loss_scaler0" in checkpoint["amp"]
    return checkpoint


# resnet_tiny has 38 parameter tensors, 24 of them BatchNorm weights and biases. On a CPU the low-precision
# type is bfloat16.
@pytest.mark.parametrize("opt_level, options, loss_scale, dtypes", [
    pytest.param("O0", [], 1.0, "38 float32", marks=pytest.mark.extended),
    ("O1", ["--loss-scale", "128.0"], 128.0, "38 float32"),
    # dynamic scale (bfloat16 is not scaled unless asked): starts at 2**16 and may have moved
    ("O2", ["--loss-scale", "dynamic"], None, "14 bfloat16, 24 float32"),
    pytest.param("O3", [], 1.0, "38 bfloat16", marks=pytest.mark.extended),
    pytest.param("O3", ["--keep-batchnorm-fp32", "True"], 1.0, "14 bfloat16, 24 float32", marks=pytest.mark.extended),
])
def test_summary_commands(tiny_imagefolder, tmp_path, opt_level, options, loss_scale, dtypes):
    output = train(tiny_imagefolder, tmp_path, "--opt-level", opt_level, *options)
    assert output.startswith(f"opt_level = {opt_level}, ")
    assert f"parameter dtypes after amp.initialize: {dtypes}\n" in output
    checkpoint = assert_trained_one_epoch(output, tmp_path)
    saved_scale = checkpoint["amp"]["loss_scaler0"]["loss_scale"]
    assert saved_scale == loss_scale if loss_scale is not None else saved_scale > 1.0
    if opt_level == "O2":
        assert "master_weights" in checkpoint["amp"]  # saved, so that resuming O2 is exact


@pytest.mark.slow
@pytest.mark.extended
def test_deterministic_runs_save_bitwise_identical_weights(tiny_imagefolder, tmp_path):
    # Two DataLoader workers: their random crops and flips are seeded from the run's seed as well.
    first, second = tmp_path / "first", tmp_path / "second"
    outputs = [train(tiny_imagefolder, folder, "--deterministic", "--opt-level", "O2", "--workers", "2")
               for folder in (first, second)]
    assert validation_results(outputs[0]) == validation_results(outputs[1])
    a, b = load_checkpoint(first), load_checkpoint(second)
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key in a["state_dict"]:
        assert torch.equal(a["state_dict"][key], b["state_dict"][key]), key
    masters = [(s, t) for per_a, per_b in zip(a["amp"]["master_weights"], b["amp"]["master_weights"])
               for s, t in zip(per_a, per_b) if s is not None]
    assert masters and all(s.dtype == torch.float32 and torch.equal(s, t) for s, t in masters)
    momenta = [(s["momentum_buffer"], t["momentum_buffer"])
               for s, t in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values())]
    assert momenta and all(torch.equal(s, t) for s, t in momenta)


@pytest.mark.slow
@pytest.mark.extended
def test_prof_profiles_the_given_number_of_iterations_and_stops(tiny_imagefolder, tmp_path):
    output = train(tiny_imagefolder, tmp_path, "--prof", "2")
    assert "Self CPU" in output and "aten::" in output  # torch.profiler's table
    assert "Profiling ended after 2 iterations" in output
    assert "forward" in output and "backward" in output  # the named ranges of the training step
    assert validation_results(output) == []  # stops before validation and checkpointing
    assert not (tmp_path / "checkpoint.pth.tar").exists()


@pytest.mark.slow
@pytest.mark.extended
def test_resume_continues_from_the_checkpoint_and_evaluate_only_validates(tiny_imagefolder, tmp_path):
    train(tiny_imagefolder, tmp_path, "--opt-level", "O1")
    first = load_checkpoint(tmp_path)
    resumed = run([SCRIPT, *TINY[:-1], "2", "--opt-level", "O1", "--resume", tmp_path / "checkpoint.pth.tar",
                   "--checkpoint-dir", tmp_path, tiny_imagefolder]).stdout
    assert f"=> loaded checkpoint '{tmp_path / 'checkpoint.pth.tar'}' (epoch 1)" in resumed
    assert "Epoch: [0]" not in resumed and "Epoch: [1][0/3]" in resumed
    second = load_checkpoint(tmp_path)
    assert second["epoch"] == 2
    assert not torch.equal(first["state_dict"]["fc.weight"], second["state_dict"]["fc.weight"])

    evaluated = run([SCRIPT, *TINY, "-e", "--resume", tmp_path / "checkpoint.pth.tar", tiny_imagefolder]).stdout
    assert "Epoch: [" not in evaluated
    assert len(validation_results(evaluated)) == 1


@pytest.mark.slow
@pytest.mark.extended
def test_fake_data_needs_no_folder_and_a_folder_or_fake_data_is_required(tmp_path):
    output = run([SCRIPT, *TINY, "--fake-data", "--fake-classes", "4", "--fake-samples", "16",
                  "--checkpoint-dir", tmp_path]).stdout
    [(_, _, _, images)] = validation_results(output)
    assert images == 4  # a quarter of the training images

    failed = run([SCRIPT, *TINY], expect_success=False)
    assert failed.returncode != 0 and "give the dataset folder DIR, or --fake-data" in failed.stderr


@pytest.mark.slow
@pytest.mark.extended
def test_sync_bn_under_torchrun_with_two_processes(tiny_imagefolder, tmp_path):
    command = ["-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), SCRIPT, *TINY, "--b", "4", "--opt-level", "O1", "--sync_bn",
               "--checkpoint-dir", tmp_path, tiny_imagefolder]
    output = run(command, env=clean_environment(threads=1)).stdout
    assert "world_size = 2" in output and "using synchronized batch normalization" in output
    # Rank 0 alone prints: one validation line, covering both processes' shares of the 12 images.
    [(_, _, _, images)] = validation_results(output)
    assert images == 12
    # 24 training images over 2 processes with 4 per batch: 3 iterations each.
    assert re.search(r"^Epoch: \[0\]\[2/3\]", output, re.MULTILINE)
    assert_trained_one_epoch(output, tmp_path)


@pytest.mark.slow
def test_torch_distributed_launch_passes_local_rank_argument(tiny_imagefolder, tmp_path):
    # The legacy launcher hands each process --local-rank=N (the seed's command line); O2 as in the Summary.
    command = ["-m", "torch.distributed.launch", "--nproc_per_node=2", "--master_port", str(free_port()), SCRIPT,
               *TINY, "--b", "4", "--opt-level", "O2", "--checkpoint-dir", tmp_path, tiny_imagefolder]
    output = run(command, env=clean_environment(threads=1)).stdout
    assert "world_size = 2" in output
    assert_trained_one_epoch(output, tmp_path)
