"""use_amp=True on a CPU without native bfloat16 trains in float32 (emulated bfloat16 is ~10x slower), and says so
once; explicit opt levels are honoured as given. Both kinds of CPU are simulated by forcing the answer of the
capability check (AITOOLBOX_CPU_NATIVE_BF16), never by changing torch's arithmetic: the weights are compared with
real float32 and real bfloat16 runs."""
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from aitoolbox.torchtrain.precision.factory import (
    NATIVE_BFLOAT16_ENV, cpu_capability, cpu_has_native_bfloat16, default_mixed_precision_helps)
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import MLP, classification_data, seeded_loader

REPO_ROOT = Path(__file__).resolve().parents[3]
FALLBACK = "trains in float32 on this CPU"


@pytest.fixture
def avx2_only(monkeypatch):
    monkeypatch.setenv(NATIVE_BFLOAT16_ENV, "0")


@pytest.fixture
def native_bf16(monkeypatch):
    monkeypatch.setenv(NATIVE_BFLOAT16_ENV, "1")


def fit(use_amp, gpu_mode="single"):
    torch.manual_seed(0)
    model = MLP()
    tl = TrainLoop(model, seeded_loader(classification_data()), None, None,
                   torch.optim.Adam(model.parameters(), lr=0.01), nn.CrossEntropyLoss(), end_auto_eval=False,
                   show_progress=False, use_amp=use_amp, gpu_mode=gpu_mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tl.fit(num_epochs=1)
    return tl, [str(w.message) for w in caught if FALLBACK in str(w.message)]


def weights(tl):
    return [p.detach().clone() for p in tl.model.parameters()]


def test_the_check_reads_the_cpu_unless_overridden(monkeypatch):
    monkeypatch.delenv(NATIVE_BFLOAT16_ENV)
    assert cpu_has_native_bfloat16() == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert cpu_capability() == torch.backends.cpu.get_cpu_capability()
    for value, expected in (("0", False), ("1", True)):
        monkeypatch.setenv(NATIVE_BFLOAT16_ENV, value)
        assert cpu_has_native_bfloat16() is expected
        assert default_mixed_precision_helps("cpu") is expected
        assert default_mixed_precision_helps("cuda")  # GPUs always have fast float16


@pytest.mark.parametrize("error", [AttributeError, RuntimeError])
def test_a_torch_without_onednn_counts_as_without_native_bfloat16(monkeypatch, error):
    """A build without oneDNN (the check's op missing or failing) has nothing fast to offer: the default trains in
    float32 there."""
    def missing():
        raise error("no oneDNN")

    monkeypatch.delenv(NATIVE_BFLOAT16_ENV, raising=False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", missing)
    assert cpu_has_native_bfloat16() is False and not default_mixed_precision_helps("cpu")


@pytest.mark.parametrize("use_amp", [True, {"init_scale": 2.0 ** 10}], ids=["true", "grad_scaler_dict"])
def test_the_default_trains_in_float32_without_native_bfloat16_and_says_why(avx2_only, use_amp):
    tl, fallback_warnings = fit(use_amp)
    assert tl.precision.autocast_dtype is None and tl.precision.loss_scaler is None
    [message] = fallback_warnings
    assert f"capability {cpu_capability()}" in message and "'opt_level': 'O1'" in message
    float32_tl, none = fit(False)
    assert not none
    assert all(torch.equal(a, b) for a, b in zip(weights(tl), weights(float32_tl)))  # bitwise the float32 run


def test_the_default_uses_bfloat16_with_native_bfloat16(native_bf16):
    tl, fallback_warnings = fit(True)
    assert tl.precision.autocast_dtype == torch.bfloat16 and not fallback_warnings
    float32_tl, _ = fit(False)
    assert not all(torch.equal(a, b) for a, b in zip(weights(tl), weights(float32_tl)))  # really bfloat16


@pytest.mark.parametrize("use_amp, dtype", [({"opt_level": "O1"}, torch.bfloat16),
                                             ({"opt_level": "O2"}, torch.bfloat16),
                                             ({"opt_level": "O2", "cast_model_type": torch.float16}, torch.float16)],
                         ids=["O1", "O2", "O2_float16"])
def test_an_explicit_opt_level_is_honoured_on_any_cpu(avx2_only, use_amp, dtype):
    tl, fallback_warnings = fit(use_amp)
    assert not fallback_warnings
    if use_amp["opt_level"] == "O1":
        assert tl.precision.autocast_dtype == dtype
    else:
        assert {p.dtype for p in tl.model.parameters()} == {dtype}


def test_the_warning_comes_once_per_process(avx2_only):
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own filter: one warning per text and place
        for _ in range(3):
            model = MLP()
            TrainLoop(model, seeded_loader(classification_data()), None, None,
                      torch.optim.Adam(model.parameters()), nn.CrossEntropyLoss(), end_auto_eval=False,
                      show_progress=False, use_amp=True).fit(num_iterations=1)
    assert sum(FALLBACK in str(w.message) for w in caught) == 1


def test_sharded_training_falls_back_the_same_way(avx2_only):
    from aitoolbox.torchtrain.train_loop.use_amp import create_sharded_precision
    model = MLP()
    optimizers = [torch.optim.Adam(model.parameters())]
    with pytest.warns(UserWarning, match=FALLBACK):
        precision, policy = create_sharded_precision(True, model, optimizers, torch.device("cpu"))
    assert policy is None and precision.autocast_dtype is None and precision.loss_scaler is None
    precision, policy = create_sharded_precision({"opt_level": "O1"}, model, optimizers, torch.device("cpu"))
    assert precision.autocast_dtype == torch.bfloat16 and policy.param_dtype == torch.bfloat16


AVX2_SCRIPT = """
import warnings
import torch
from torch import nn
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import MLP, classification_data, seeded_loader
warnings.simplefilter("always")
model = MLP()
tl = TrainLoop(model, seeded_loader(classification_data()), None, None, torch.optim.Adam(model.parameters()),
               nn.CrossEntropyLoss(), end_auto_eval=False, show_progress=False, use_amp=True)
tl.fit(num_iterations=2)
print("capability", torch.backends.cpu.get_cpu_capability(), "autocast", tl.precision.autocast_dtype)
"""


def test_a_cpu_limited_to_avx2_is_detected_without_any_override():
    """torch and oneDNN limited to AVX2 (their own environment variables) behave as on an AVX2-only CPU: the
    capability check itself answers, with the override unset."""
    env = {key: value for key, value in os.environ.items() if key != NATIVE_BFLOAT16_ENV}
    env.update(ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", AVX2_SCRIPT], cwd=REPO_ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "capability AVX2 autocast None" in result.stdout
    assert "trains in float32 on this CPU (capability AVX2, no native bfloat16)" in result.stderr
