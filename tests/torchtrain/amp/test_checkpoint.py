"""amp.state_dict / amp.load_state_dict: apex's bitwise checkpoint workflow, resumed in a fresh process.

For every opt level O0..O3 and num_losses 1 and 2: train CHECKPOINT_STEP steps, save
``{'model', 'optimizer', 'amp'}`` with torch.save, then in a new Python process initialize, load all three
with ``torch.load(weights_only=True)`` and train to NUM_STEPS; the result must equal NUM_STEPS uninterrupted
steps bitwise. All cases share one child process to keep the test fast.
"""
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from aitoolbox.torchtrain import amp
from tests.torchtrain.amp import checkpoint_workflow as workflow

REPO_ROOT = Path(__file__).resolve().parents[3]

CHILD_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import torch
    from tests.torchtrain.amp import checkpoint_workflow as workflow

    checkpoint_dir, results_path = sys.argv[2], sys.argv[3]
    results = {}
    for opt_level, num_losses in workflow.CASES:
        name = f"{opt_level}_{num_losses}"
        model, optimizer = workflow.resume(f"{checkpoint_dir}/{name}.pt", opt_level, num_losses)
        results[name] = workflow.outcome(model, optimizer)
    torch.save(results, results_path)
""")


@pytest.fixture(scope="module")
def resumed_in_fresh_process(tmp_path_factory):
    """``{case: (uninterrupted outcome, outcome resumed in a child process)}`` for all CASES."""
    directory = tmp_path_factory.mktemp("amp_checkpoints")
    uninterrupted = {}
    for opt_level, num_losses in workflow.CASES:
        name = f"{opt_level}_{num_losses}"
        model, optimizer = workflow.build(opt_level, num_losses)
        workflow.train(model, optimizer, num_losses, 0, workflow.NUM_STEPS)
        uninterrupted[name] = workflow.outcome(model, optimizer)
        model, optimizer = workflow.build(opt_level, num_losses)
        workflow.train(model, optimizer, num_losses, 0, workflow.CHECKPOINT_STEP)
        torch.save(workflow.checkpoint(model, optimizer), directory / f"{name}.pt")
    script = directory / "resume.py"
    script.write_text(CHILD_SCRIPT)
    results_path = directory / "results.pt"
    completed = subprocess.run([sys.executable, str(script), str(REPO_ROOT), str(directory), str(results_path)],
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    resumed = torch.load(results_path, weights_only=True)
    return {name: (uninterrupted[name], resumed[name]) for name in uninterrupted}


def assert_outcomes_equal(expected, got):
    for key in ("params", "raw_params", "masters"):
        assert len(expected[key]) == len(got[key])
        for index, (a, b) in enumerate(zip(expected[key], got[key])):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{key}[{index}] differs"
    assert expected["scalers"] == got["scalers"]


@pytest.mark.parametrize("opt_level, num_losses", workflow.CASES, ids=[f"{l}-{n}loss" for l, n in workflow.CASES])
def test_resume_in_a_fresh_process_is_bitwise_exact(resumed_in_fresh_process, opt_level, num_losses):
    expected, got = resumed_in_fresh_process[f"{opt_level}_{num_losses}"]
    assert_outcomes_equal(expected, got)
    if opt_level in ("O1", "O2"):  # the injected overflow halved the last scaler before the checkpoint
        assert got["scalers"][f"loss_scaler{num_losses - 1}"]["loss_scale"] == 2.0 ** 15
    if opt_level == "O2":
        assert all(m.dtype == torch.float32 for m in got["masters"])
        assert any(p.dtype == torch.bfloat16 for p in got["raw_params"])


def test_o2_resume_needs_the_amp_state_in_either_load_order(tmp_path):
    """The apex bug the amp state fixes (apex #180, #388, #480): masters rebuilt from rounded weights."""
    model, optimizer = workflow.build("O2", 1)
    workflow.train(model, optimizer, 1, 0, workflow.NUM_STEPS)
    expected = workflow.outcome(model, optimizer)
    model, optimizer = workflow.build("O2", 1)
    workflow.train(model, optimizer, 1, 0, workflow.CHECKPOINT_STEP)
    path = tmp_path / "o2.pt"
    torch.save(workflow.checkpoint(model, optimizer), path)
    with_amp = workflow.outcome(*workflow.resume(str(path), "O2", 1, load_amp=True))
    amp_loaded_first = workflow.outcome(*workflow.resume(str(path), "O2", 1, load_amp=True, amp_first=True))
    without_amp = workflow.outcome(*workflow.resume(str(path), "O2", 1, load_amp=False))
    assert_outcomes_equal(expected, with_amp)
    # Reloading the model's (rounded) weights after the amp state keeps the saved masters.
    assert_outcomes_equal(expected, amp_loaded_first)
    assert not all(torch.equal(a, b) for a, b in zip(expected["masters"], without_amp["masters"]))


# --- the state dict itself ---------------------------------------------------------------------------------
def initialized(opt_level="O1", num_losses=1, **kwargs):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(model, optimizer, opt_level=opt_level, num_losses=num_losses, verbosity=0, **kwargs)


def test_state_dict_has_apex_keys_and_loads_with_weights_only(tmp_path):
    model, optimizer = initialized("O1", num_losses=2, loss_scale="dynamic")
    state = amp.state_dict()
    assert state == {"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 0},
                     "loss_scaler1": {"loss_scale": 65536.0, "unskipped": 0}}
    assert isinstance(state["loss_scaler0"]["loss_scale"], float)
    assert isinstance(state["loss_scaler0"]["unskipped"], int)
    destination = {"extra": 1}
    assert amp.state_dict(destination) is destination and "loss_scaler1" in destination
    model, optimizer = initialized("O2")
    state = amp.state_dict()
    assert set(state) == {"loss_scaler0", "master_weights"}
    assert [[t.dtype for t in masters] for masters in state["master_weights"]] == [[torch.float32] * 2]
    torch.save(state, tmp_path / "amp.pt")
    loaded = torch.load(tmp_path / "amp.pt", weights_only=True)
    assert loaded["loss_scaler0"] == state["loss_scaler0"]


def test_load_state_dict_restores_an_apex_checkpoint_entry():
    model, optimizer = initialized("O1", num_losses=2, loss_scale="dynamic")
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 512.0, "unskipped": 17},
                         "loss_scaler1": {"loss_scale": 8.0, "unskipped": 3}})
    assert [s.state_dict() for s in amp.state_of(optimizer).loss_scalers] == [
        {"loss_scale": 512.0, "unskipped": 17}, {"loss_scale": 8.0, "unskipped": 3}]


def test_load_state_dict_rejects_a_key_that_is_not_a_loss_scaler():
    model, optimizer = initialized()
    with pytest.raises(ValueError, match="optimizer_state"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0}, "optimizer_state": {}})


def test_load_state_dict_warns_on_a_loss_scaler_count_mismatch(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)  # the package logger may not propagate
    model, optimizer = initialized("O1", num_losses=1, loss_scale="dynamic")
    with caplog.at_level(logging.WARNING, logger="aitoolbox.torchtrain.amp"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 1},
                             "loss_scaler1": {"loss_scale": 8.0, "unskipped": 2}})
    assert "num_losses=1" in caplog.text
    assert amp.state_of(optimizer).loss_scalers[0].state_dict() == {"loss_scale": 4.0, "unskipped": 1}


def test_state_dict_before_initialize_says_what_to_call(monkeypatch):
    monkeypatch.setattr(amp._registry, "_latest", None)
    with pytest.raises(RuntimeError, match="amp.initialize"):
        amp.state_dict()
    with pytest.raises(RuntimeError, match="amp.initialize"):
        amp.load_state_dict({})


# --- seed 001: the README's checkpoint snippet, as written (import line changed) ---------------------------
def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def make_optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def compute_loss(model, step):
    generator = torch.Generator().manual_seed(step)
    x, y = torch.randn(6, 4, generator=generator), torch.randn(6, 1, generator=generator)
    return F.mse_loss(model(x), y)


def test_seed_001_checkpoint_snippet_runs_on_cpu(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = make_model()
    optimizer = make_optimizer(model)

    # ---- from the apex README; the "..." lines are filled in, everything else is verbatim ----
    # Initialization
    opt_level = 'O1'
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level)

    # Train your model
    loss = compute_loss(model, 0)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step(); optimizer.zero_grad()

    # Save checkpoint
    checkpoint = {
        'model': model.state_dict(),
        'optimizer': optimizer.state_dict(),
        'amp': amp.state_dict()
    }
    torch.save(checkpoint, 'amp_checkpoint.pt')
    trained_one_step = [p.detach().clone() for p in model.parameters()]

    # Restore
    model = make_model()
    optimizer = make_optimizer(model)
    checkpoint = torch.load('amp_checkpoint.pt')

    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level)
    model.load_state_dict(checkpoint['model'])
    optimizer.load_state_dict(checkpoint['optimizer'])
    amp.load_state_dict(checkpoint['amp'])

    # Continue training
    loss = compute_loss(model, 1)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step(); optimizer.zero_grad()
    # ---- end of the snippet ----

    assert (tmp_path / "amp_checkpoint.pt").exists()
    assert not all(torch.equal(a, b) for a, b in zip(trained_one_step, model.parameters()))
    # bfloat16 on the CPU: no loss scaling, reported in apex's format as a static scale of 1.0.
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}}
    model_ref = make_model()
    optimizer_ref = make_optimizer(model_ref)
    model_ref, optimizer_ref = amp.initialize(model_ref, optimizer_ref, opt_level="O1", verbosity=0)
    for step in range(2):
        with amp.scale_loss(compute_loss(model_ref, step), optimizer_ref) as scaled_loss:
            scaled_loss.backward()
        optimizer_ref.step()
        optimizer_ref.zero_grad()
    for a, b in zip(model.parameters(), model_ref.parameters()):
        assert torch.equal(a, b)
