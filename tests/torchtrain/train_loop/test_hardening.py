"""The loop's failure path, its set-up, its state object, its evaluation loaders and what a fit shows."""
import ast
import logging
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import aitoolbox
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.train_loop import TrainLoop
from aitoolbox.torchtrain.train_loop.loop_state import LoopState
from tests.helpers import (
    MLP, assert_params_equal, classification_data, distinct_records, model_pair, seeded_loader,
)

PACKAGE_ROOT = pathlib.Path(aitoolbox.__file__).parent


class RaiseOnce(AbstractCallback):
    """Raises ``exception`` once, in hook ``hook`` at the given epoch and iteration; records on_exception."""

    def __init__(self, exception: BaseException, hook: str = "on_batch_end", epoch: int = 1, iteration: int = 2):
        super().__init__("raise once")
        self.exception, self.hook, self.epoch, self.iteration = exception, hook, epoch, iteration
        self.raised = False
        self.seen = []

    def _maybe_raise(self, hook: str) -> None:
        tl = self.train_loop_obj
        at_place = tl.epoch == self.epoch and (hook == "on_epoch_end" or tl.iteration == self.iteration)
        if hook == self.hook and at_place and not self.raised:
            self.raised = True
            raise self.exception

    def on_batch_end(self):
        self._maybe_raise("on_batch_end")

    def on_after_gradient_update(self, optimizer_idx):
        self._maybe_raise("on_after_gradient_update")

    def on_epoch_end(self):
        self._maybe_raise("on_epoch_end")

    def on_exception(self, exception):
        self.seen.append(exception)


def make_loop(model, grad_accumulation_data=40, **kwargs):
    data = classification_data(grad_accumulation_data)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return TrainLoop(model, seeded_loader(data, 8), seeded_loader(classification_data(16, seed=3), 8), None,
                     optimizer, nn.CrossEntropyLoss(), end_auto_eval=kwargs.pop("end_auto_eval", True),
                     show_progress=kwargs.pop("show_progress", False), **kwargs)


# --- 3. an exception in fit, and fit again -------------------------------------------------------------
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("hook, exception, grad_accumulation", [
    ("on_batch_end", RuntimeError("boom"), 1),
    ("on_batch_end", KeyboardInterrupt(), 1),
    ("on_after_gradient_update", RuntimeError("in the middle of a window"), 2),
    ("on_after_gradient_update", RuntimeError("in the middle of a longer window"), 3),
    ("on_epoch_end", KeyboardInterrupt(), 2),
])
def test_fit_after_an_exception_continues_where_it_stopped(hook, exception, grad_accumulation, dropout):
    # The batches after the last optimizer step are trained again with the data order, the arithmetic and the
    # torch random state (dropout masks) they had: the continued run equals an uninterrupted one bitwise.
    model, reference_model = model_pair(MLP, dropout=dropout)
    torch.manual_seed(0)
    reference = make_loop(reference_model)
    reference.fit(num_epochs=3, grad_accumulation=grad_accumulation)

    torch.manual_seed(0)
    raiser = RaiseOnce(exception, hook=hook, epoch=1, iteration=2)
    tl = make_loop(model)
    with pytest.raises(type(exception)):
        tl.fit(num_epochs=3, callbacks=[raiser], grad_accumulation=grad_accumulation)
    assert raiser.seen == [exception]  # on_exception ran once, with the exception itself
    assert tl.epochs_completed == 1
    tl.fit(num_epochs=3, grad_accumulation=grad_accumulation)

    assert_params_equal(tl.model, reference.model)
    assert tl.iterations_done == reference.iterations_done == 15
    assert dict(tl.train_history) == dict(reference.train_history)  # nothing recorded twice


def test_exception_closes_the_progress_bar_and_propagates_unchanged():
    import tqdm as tqdm_module
    model, _ = model_pair(MLP)
    tl = make_loop(model, show_progress=True)
    error = ValueError("a batch failed")
    with pytest.raises(ValueError) as raised:
        tl.fit(num_epochs=2, callbacks=[RaiseOnce(error, epoch=0, iteration=1)])
    assert raised.value is error
    open_bars = [bar for bar in list(tqdm_module.tqdm._instances) if not bar.disable]
    assert open_bars == []


# --- 4. getters without side effects --------------------------------------------------------------------
def test_reading_precision_or_model_runner_before_set_up_changes_nothing():
    model, _ = model_pair(MLP)
    tl = make_loop(model, use_amp={"opt_level": "O2"})
    with pytest.raises(RuntimeError, match="when fit"):
        tl.precision
    with pytest.raises(RuntimeError, match="when fit"):
        tl.model_runner
    assert all(param.dtype == torch.float32 for param in model.parameters())  # amp.initialize did not run
    tl.set_up()
    assert tl.precision is tl.precision and tl.model_runner is model
    assert model.fc1.weight.dtype == torch.bfloat16  # O2 casts the model, once set up


@pytest.mark.parametrize("use_amp, enabled, scale", [
    ({"opt_level": "O2", "loss_scale": "dynamic"}, True, 2.0 ** 16),
    ({"opt_level": "O1"}, False, 1.0),  # bfloat16 on the CPU: no loss scaling unless asked for
    ({"init_scale": 2.0 ** 10}, True, 2.0 ** 10),  # a 1.8 GradScaler dict
    (False, False, 1.0),
])
def test_amp_scaler_before_fit_answers_without_setting_up_the_model(use_amp, enabled, scale):
    # 1.x built its GradScaler in the constructor: 1.x code reads tl.amp_scaler (or loads a state into it)
    # before fit. That must not set the model up (amp.initialize casting an O2 model) as a side effect.
    model, _ = model_pair(MLP)
    tl = make_loop(model, use_amp=use_amp)
    assert tl.amp_scaler.is_enabled() is enabled and tl.amp_scaler.get_scale() == scale
    assert tl.amp_scaler.state_dict() == ({} if not enabled else tl.amp_scaler.state_dict())
    assert all(param.dtype == torch.float32 for param in model.parameters())  # amp.initialize did not run
    with pytest.raises(RuntimeError, match="training step"):
        tl.amp_scaler.unscale_(tl.optimizers[0])
    with pytest.raises(RuntimeError, match="when fit"):
        tl.precision


def test_a_grad_scaler_state_loaded_before_fit_is_the_one_training_starts_with():
    saved = {"scale": 2.0 ** 5, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 1000,
             "_growth_tracker": 7}
    model, _ = model_pair(MLP)
    tl = make_loop(model, use_amp={"init_scale": 2.0 ** 10})
    tl.amp_scaler.load_state_dict(saved)  # as 1.x's ModelLoadContinueTraining did, before fit
    assert tl.amp_scaler.get_scale() == 2.0 ** 5
    tl.set_up()
    assert tl.amp_scaler.state_dict() == saved and tl.precision.loss_scaler.loss_scale == 2.0 ** 5


def test_evaluation_sets_up_the_model():
    model, _ = model_pair(MLP)
    tl = make_loop(model)
    assert float(tl.evaluate_loss_on_validation_set()) > 0
    assert tl.model_runner is model


# --- 6. evaluation loaders replaced -------------------------------------------------------------------
def test_a_replaced_evaluation_loader_is_used():
    model, _ = model_pair(MLP)
    tl = make_loop(model)
    first = float(tl.evaluate_loss_on_validation_set())
    other = seeded_loader(classification_data(24, seed=99), 8)
    tl.validation_loader = other  # same iteration: a cached result must not be returned for the new loader
    second = float(tl.evaluate_loss_on_validation_set())
    assert second != first
    assert second == float(tl.evaluate_model_loss(other))


# --- 7. the loop state ---------------------------------------------------------------------------------
def test_loop_state_round_trip_and_attribute_views():
    model, _ = model_pair(MLP)
    tl = make_loop(model)
    tl.fit(num_epochs=2)
    assert tl.state.state_dict() == {"epoch": 1, "epochs_completed": 2, "iteration": 4, "total_iteration_idx": 9,
                                     "early_stop": False}
    tl.iteration = 3
    assert tl.state.iteration == 3
    fresh = LoopState()
    fresh.load_state_dict(tl.state.state_dict())
    assert fresh.state_dict() == tl.state.state_dict() and fresh.iterations_done == 10
    with pytest.raises(ValueError, match="unknown loop counter"):
        fresh.load_state_dict({"epoch": 1, "batch": 2})
    # A state saved before the stop flag existed loads, and means a run that was not stopped.
    fresh.early_stop = True
    fresh.load_state_dict({"epoch": 1, "epochs_completed": 2, "iteration": 4, "total_iteration_idx": 9})
    assert fresh.early_stop is False and fresh.epochs_completed == 2


# --- 8. no import cycles -------------------------------------------------------------------------------
def imported_modules(folder: pathlib.Path):
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                yield path.name, node.module
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    yield path.name, alias.name


@pytest.mark.parametrize("folder, forbidden", [
    ("torchtrain/distributed", "aitoolbox.torchtrain.train_loop"),
    ("torchtrain/precision", "aitoolbox.torchtrain.amp"),
    ("torchtrain/precision", "aitoolbox.torchtrain.train_loop"),
])
def test_lower_layers_do_not_import_higher_ones(folder, forbidden):
    offending = [(name, module) for name, module in imported_modules(PACKAGE_ROOT / folder)
                 if module == forbidden or module.startswith(forbidden + ".")]
    assert offending == []


# --- 11. the bar's last loss ---------------------------------------------------------------------------
def test_progress_bar_ends_each_epoch_with_its_accumulated_loss(capsys):
    model, _ = model_pair(MLP)
    tl = make_loop(model, show_progress=True, end_auto_eval=False)
    tl.fit(num_epochs=2)
    output = capsys.readouterr().err
    for epoch, accumulated in enumerate(tl.train_history["accumulated_loss"]):
        segment = output.split(f"Epoch {epoch + 1}/2")[-1].split("Epoch ")[0]  # the bars count epochs from 1
        shown = re.findall(r"loss=([0-9.]+)", segment)
        assert shown and shown[-1] == f"{accumulated:.4f}"


# --- 12. one line per epoch --------------------------------------------------------------------------------
class RecordAccuracy(AbstractCallback):
    def __init__(self):
        super().__init__("accuracy")

    def on_epoch_end(self):
        self.train_loop_obj.insert_metric_result_into_history("val_Accuracy", 0.972222)


def test_epoch_line_in_keras_style(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)  # the package logger keeps to itself
    model, _ = model_pair(MLP)
    tl = make_loop(model)
    with caplog.at_level(logging.INFO):
        tl.fit(num_epochs=2, callbacks=[RecordAccuracy()])
    lines = [record.getMessage() for record in distinct_records(caplog) if record.name == "aitoolbox.epochs"]
    assert len(lines) == 2
    history = tl.train_history
    pattern = (r"Epoch 2/2 - \d+\.\ds - accumulated_loss {acc} - loss {loss} - val_loss {val} - val_Accuracy 0\.9722$"
               .format(acc=re.escape(f"{history['accumulated_loss'][1]:.4g}"),
                       loss=re.escape(f"{history['loss'][1]:.4g}"), val=re.escape(f"{history['val_loss'][1]:.4g}")))
    assert re.match(pattern, lines[1]), lines[1]
    assert lines[0].startswith("Epoch 1/2 - ")


def test_epoch_line_is_shown_without_any_logging_set_up():
    script = textwrap.dedent("""
        import torch
        from torch import nn
        from aitoolbox.torchtrain.train_loop import TrainLoop
        from tests.helpers import MLP, classification_data, seeded_loader
        torch.manual_seed(0)
        model = MLP()
        tl = TrainLoop(model, seeded_loader(classification_data(16), 8), None, None,
                       torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), show_progress=False)
        tl.fit(num_epochs=2)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            cwd=str(PACKAGE_ROOT.parent))
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("Epoch ")]
    assert [line.split(" - ")[0] for line in lines] == ["Epoch 1/2", "Epoch 2/2"]
    assert all(" - accumulated_loss " in line and " - loss " in line for line in lines)


# --- 3. Ctrl-C inside a batch waits for its end -------------------------------------------------------------
class SigintAt(AbstractCallback):
    """Sends this process SIGINT ``times`` times from ``hook`` at (epoch, iteration), as a Ctrl-C would; records
    which hooks ran afterwards."""

    def __init__(self, hook, times=1, epoch=1, iteration=2):
        super().__init__("sigint")
        self.hook, self.times, self.epoch, self.iteration = hook, times, epoch, iteration
        self.sent = False
        self.after = []

    def _maybe_send(self, hook):
        tl = self.train_loop_obj
        if self.sent:
            self.after.append(hook)
        elif hook == self.hook and tl.epoch == self.epoch and (hook == "on_epoch_end" or tl.iteration == self.iteration):
            self.sent = True
            for _ in range(self.times):
                os.kill(os.getpid(), signal.SIGINT)

    def on_after_gradient_update(self, optimizer_idx):
        self._maybe_send("on_after_gradient_update")

    def on_after_optimizer_step(self):
        self._maybe_send("on_after_optimizer_step")

    def on_batch_end(self):
        self._maybe_send("on_batch_end")

    def on_epoch_end(self):
        self._maybe_send("on_epoch_end")


@pytest.mark.skipif(not hasattr(signal, "SIGINT") or sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_inside_a_batch_stops_after_it_and_fit_continues_exactly():
    model, reference_model = model_pair(MLP, dropout=0.0)
    reference = make_loop(reference_model)
    reference.fit(num_epochs=3)
    tl = make_loop(model)
    sender = SigintAt("on_after_gradient_update")
    with pytest.raises(KeyboardInterrupt):
        tl.fit(num_epochs=3, callbacks=[sender])
    assert sender.after == ["on_after_optimizer_step", "on_batch_end"]  # the batch was completed first
    assert tl.iterations_done == 5 + 3  # epoch 0, then batches 0..2 of epoch 1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the guard is gone after fit
    tl.fit(num_epochs=3)
    assert_params_equal(tl.model, reference.model)
    assert dict(tl.train_history) == dict(reference.train_history)


@pytest.mark.skipif(not hasattr(signal, "SIGINT") or sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("hook, times, expected_after", [
    ("on_after_gradient_update", 2, []),  # a second Ctrl-C in the same batch stops at once
    ("on_epoch_end", 1, []),  # outside a batch Ctrl-C acts at once
])
def test_ctrl_c_acts_at_once_when_repeated_or_outside_a_batch(hook, times, expected_after):
    model, _ = model_pair(MLP)
    sender = SigintAt(hook, times=times)
    with pytest.raises(KeyboardInterrupt):
        make_loop(model).fit(num_epochs=3, callbacks=[sender])
    assert sender.after == expected_after


# --- the epoch's loss sum ----------------------------------------------------------------------------------
def test_epoch_loss_sum_commits_at_the_step_with_float32_at_least():
    """The sum is float32 at least (a bfloat16 loss does not round it), the committed part is the last step's, and a
    sum from an older checkpoint (a plain number or list) goes on from there."""
    from aitoolbox.torchtrain.train_loop.losses import EpochLossSum
    values = [torch.tensor(0.1, dtype=torch.bfloat16), torch.tensor(0.7), torch.tensor(1e-3)]
    epoch_loss = EpochLossSum()
    epoch_loss.add(values[0])
    epoch_loss.add(values[1])
    epoch_loss.commit()
    epoch_loss.add(values[2])
    assert epoch_loss.total().dtype == torch.float32
    torch.testing.assert_close(epoch_loss.total(include_pending=False), values[0].float() + values[1])
    torch.testing.assert_close(epoch_loss.total(), values[0].float() + values[1] + values[2])
    assert torch.equal(epoch_loss.state()["values"], torch.stack([values[0].float(), values[1]]))  # not the pending
    epoch_loss.commit()
    assert epoch_loss.pending == () and torch.equal(epoch_loss.total(include_pending=False), epoch_loss.total())
    resumed = EpochLossSum([1.0, 2.0])
    resumed.add(torch.tensor([0.5, 0.25]))
    resumed.commit()
    assert resumed.total().tolist() == [1.5, 2.25]
