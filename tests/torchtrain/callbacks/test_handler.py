"""CallbacksHandler: registration, execution order, and the order TrainLoop calls the hooks in."""
import logging

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.handler import HOOK_NAMES, overrides_hook
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import MLP, HookRecorder, classification_data, distinct_records


def make_loop(num_optimizers=1, validation=None, test=None, end_auto_eval=False, num_samples=10):
    torch.manual_seed(0)
    model = MLP()
    if num_optimizers == 1:
        optimizers = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        optimizers = [torch.optim.SGD(model.fc1.parameters(), lr=0.1), torch.optim.SGD(model.fc2.parameters(), lr=0.1)]
    return TrainLoop(model, DataLoader(classification_data(num_samples), batch_size=4), validation, test, optimizers,
                     nn.CrossEntropyLoss(), end_auto_eval=end_auto_eval, show_progress=False)


def hooks_of(log, name=None):
    return [hook for callback_name, hook, _ in log if name is None or callback_name == name]


def test_hooks_are_called_in_the_documented_order():
    # 10 samples in batches of 4: 3 batches per epoch; grad_accumulation=2 steps after batches 1 and 2.
    log = []
    tl = make_loop(num_optimizers=2)
    tl.fit(num_epochs=2, grad_accumulation=2, callbacks=[HookRecorder(log)])
    expected = [("on_train_loop_registration", None), ("on_train_begin", None)]
    total = 0
    for epoch in range(2):
        expected.append(("on_epoch_begin", epoch))
        for i in range(3):
            step_due = i in (1, 2)
            expected += [("on_batch_begin", (i, total)),
                         ("on_after_gradient_update", (0, step_due)), ("on_after_gradient_update", (1, step_due))]
            if step_due:
                expected.append(("on_after_optimizer_step", i))
            expected.append(("on_batch_end", (i, total)))
            total += 1
        expected.append(("on_epoch_end", epoch))
    expected.append(("on_train_end", None))
    assert [(hook, details) for _, hook, details in log] == expected


def test_num_iterations_limit_forces_the_step_due_flag():
    log = []
    make_loop().fit(num_iterations=2, grad_accumulation=3, callbacks=[HookRecorder(log)])
    updates = [details for _, hook, details in log if hook == "on_after_gradient_update"]
    assert updates == [(0, False), (0, True)]
    assert hooks_of(log).count("on_after_optimizer_step") == 1


def test_execution_order_sorts_and_ties_keep_registration_order():
    log = []
    names_and_orders = [("e", 5), ("b", -1), ("z", 0), ("y", 0), ("a", 5)]
    tl = make_loop()
    tl.fit(num_iterations=1, callbacks=[HookRecorder(log, name, order) for name, order in names_and_orders])
    begin_order = [name for name, hook, _ in log if hook == "on_train_begin"]
    assert begin_order == ["b", "z", "y", "e", "a"]
    assert [cb.callback_name for cb in tl.callbacks] == begin_order
    # A callback added by a later fit joins its ties after the ones already registered.
    log.clear()
    tl.fit(num_iterations=2, callbacks=[HookRecorder(log, "f", 0)])
    assert [name for name, hook, _ in log if hook == "on_train_begin"] == ["b", "z", "y", "f", "e", "a"]
    # Every hook of a batch follows the same order.
    assert [name for name, hook, _ in log if hook == "on_batch_end"] == ["b", "z", "y", "f", "e", "a"]


def test_the_same_callback_object_is_registered_once():
    log = []
    recorder = HookRecorder(log)
    tl = make_loop()
    tl.fit(num_epochs=1, callbacks=[recorder, recorder])
    tl.fit(num_epochs=2, callbacks=[recorder])
    assert tl.callbacks == [recorder]
    assert hooks_of(log).count("on_train_loop_registration") == 1
    assert hooks_of(log).count("on_epoch_begin") == 2


def test_equal_but_distinct_callbacks_are_both_registered():
    log = []
    tl = make_loop()
    tl.fit(num_iterations=1, callbacks=[HookRecorder(log, "x"), HookRecorder(log, "x")])
    assert len(tl.callbacks) == 2
    assert hooks_of(log).count("on_train_begin") == 2


def test_train_begin_and_end_once_per_fit():
    log = []
    recorder = HookRecorder(log)
    tl = make_loop()
    tl.fit(num_epochs=1, callbacks=[recorder])
    tl.fit(num_epochs=3)  # registered callbacks stay registered
    assert hooks_of(log).count("on_train_begin") == 2
    assert hooks_of(log).count("on_train_end") == 2
    assert hooks_of(log).count("on_epoch_end") == 3


def test_callbacks_for_another_rank_are_not_registered():
    log = []
    mine, other = HookRecorder(log, "mine", device_idx_execution=0), HookRecorder(log, "other", device_idx_execution=1)
    tl = make_loop()
    tl.fit(num_iterations=1, callbacks=[mine, other])
    assert tl.callbacks == [mine]
    assert other.train_loop_obj is None
    assert {name for name, _, _ in log} == {"mine"}


def test_registration_gives_the_callback_the_loop():
    recorder = HookRecorder([])
    tl = make_loop()
    tl.callbacks_handler.register_callbacks([recorder])
    assert recorder.train_loop_obj is tl
    assert recorder.log == [("recorder", "on_train_loop_registration", None)]


class EpochEndOnly(AbstractCallback):
    def __init__(self):
        super().__init__("epoch end only")
        self.calls = 0

    def on_epoch_end(self):
        self.calls += 1


class InheritsEpochEnd(EpochEndOnly):
    pass


def test_only_overridden_hooks_are_detected():
    callback = EpochEndOnly()
    assert [name for name in HOOK_NAMES if overrides_hook(callback, name)] == ["on_epoch_end"]
    assert overrides_hook(InheritsEpochEnd(), "on_epoch_end")
    assert not any(overrides_hook(AbstractCallback("plain"), name) for name in HOOK_NAMES)


def test_callbacks_overriding_some_hooks_run_with_others():
    log = []
    epoch_end = InheritsEpochEnd()
    tl = make_loop()
    tl.fit(num_epochs=2, callbacks=[epoch_end, HookRecorder(log), AbstractCallback("does nothing")])
    assert epoch_end.calls == 2
    assert hooks_of(log).count("on_epoch_end") == 2


def test_after_batch_prediction_sees_every_batch():
    log = []
    tl = make_loop(validation=DataLoader(classification_data(9), batch_size=4))
    tl.callbacks_handler.register_callbacks([HookRecorder(log)])
    tl.predict_on_validation_set()  # as in aitoolbox 1.x, callbacks run only when asked to
    assert [details for _, hook, details in log if hook == "on_after_batch_prediction"] == []
    tl.predict_on_validation_set(force_prediction=True, execute_callbacks=True)
    assert [details for _, hook, details in log if hook == "on_after_batch_prediction"] == [
        (4, "validation"), (4, "validation"), (1, "validation")]


class StateProbe(AbstractCallback):
    """Looks at the loop's state at the points the hook documentation promises."""

    def __init__(self):
        super().__init__("probe")
        self.grads_at_step = []
        self.grads_at_batch_begin = []
        self.val_loss_lengths = []
        self.test_loss_at_end = None

    def _has_grads(self):
        return all(p.grad is not None for p in self.train_loop_obj.model.parameters())

    def on_batch_begin(self):
        self.grads_at_batch_begin.append(self._has_grads())

    def on_after_optimizer_step(self):
        self.grads_at_step.append(self._has_grads())  # zero_grad comes after this hook

    def on_epoch_end(self):
        self.val_loss_lengths.append(len(self.train_loop_obj.train_history["val_loss"]))

    def on_train_end(self):
        self.test_loss_at_end = self.train_loop_obj.train_history["train_end_test_loss"]


def test_hooks_see_the_documented_state():
    probe = StateProbe()
    tl = make_loop(validation=DataLoader(classification_data(9), batch_size=4),
                   test=DataLoader(classification_data(5), batch_size=4), end_auto_eval=True)
    tl.fit(num_epochs=2, grad_accumulation=2, callbacks=[probe])
    assert probe.grads_at_step == [True] * 4
    # Gradients are cleared at fit start and after each step; batch 1 of each epoch accumulates onto batch 0.
    assert probe.grads_at_batch_begin == [False, True, False] * 2
    assert probe.val_loss_lengths == [1, 2]  # on_epoch_end runs after the automatic evaluation
    assert probe.test_loss_at_end is not None and len(probe.test_loss_at_end) == 1


def test_1x_execute_names_call_the_hooks():
    log = []
    tl = make_loop()
    tl.callbacks_handler.register_callbacks([HookRecorder(log)])
    handler = tl.callbacks_handler
    handler.execute_train_begin()
    handler.execute_epoch_begin()
    handler.execute_batch_begin()
    handler.execute_gradient_update()
    handler.execute_optimizer_step()
    handler.execute_batch_end()
    handler.execute_epoch_end()
    handler.execute_train_end()
    assert [hook for _, hook, _ in log] == [
        "on_train_loop_registration", "on_train_begin", "on_epoch_begin", "on_batch_begin", "on_after_gradient_update", "on_after_optimizer_step",
        "on_batch_end", "on_epoch_end", "on_train_end"]


# --- on_exception ---------------------------------------------------------------------------------------------
class CleanUp(AbstractCallback):
    """Records the exceptions it is told about; optionally raises ``failure`` from its own on_exception."""

    def __init__(self, name, calls, failure=None, execution_order=0):
        super().__init__(name, execution_order=execution_order)
        self.calls, self.failure = calls, failure

    def on_exception(self, exception):
        self.calls.append((self.callback_name, exception))
        if self.failure is not None:
            raise self.failure


def test_on_exception_is_a_documented_no_op_hook():
    assert "on_exception" in HOOK_NAMES
    assert AbstractCallback("plain").on_exception(RuntimeError("stop")) is None
    assert overrides_hook(CleanUp("c", []), "on_exception")
    assert [name for name in HOOK_NAMES if overrides_hook(CleanUp("c", []), name)] == ["on_exception"]


def test_on_exception_reaches_every_callback_in_order_even_when_one_fails(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)  # the package logger stops at itself
    calls = []
    stop = KeyboardInterrupt()
    tl = make_loop()
    tl.callbacks_handler.register_callbacks([
        CleanUp("late", calls, execution_order=5), CleanUp("breaks", calls, ValueError("flush failed")),
        CleanUp("interrupted", calls, KeyboardInterrupt(), execution_order=1), EpochEndOnly(),
        CleanUp("first", calls, execution_order=-1)])
    with caplog.at_level("ERROR", logger="aitoolbox.torchtrain.callbacks.handler"):
        tl.callbacks_handler.on_exception(stop)  # returns: what the callbacks raised is logged, not raised
    assert calls == [("first", stop), ("breaks", stop), ("interrupted", stop), ("late", stop)]
    failures = [record for record in distinct_records(caplog) if "on_exception" in record.getMessage()]
    assert len(failures) == 2
    assert "CleanUp (breaks) raised in on_exception" in failures[0].getMessage()
    assert "KeyboardInterrupt" in failures[0].getMessage()  # the exception being cleaned up after
    assert failures[0].exc_info[0] is ValueError and failures[1].exc_info[0] is KeyboardInterrupt
    assert "(interrupted)" in failures[1].getMessage()


class RefusesTheLoop(EpochEndOnly):
    def on_train_loop_registration(self):
        raise ValueError("this loop lacks what the callback needs")


def test_a_callback_whose_registration_fails_is_not_registered():
    tl = make_loop()
    first, refusing = EpochEndOnly(), RefusesTheLoop()
    with pytest.raises(ValueError, match="lacks what the callback needs"):
        tl.fit(num_epochs=1, callbacks=[first, refusing])
    assert tl.callbacks == [first]
    tl.fit(num_epochs=1)
    assert first.calls == 1 and refusing.calls == 0


class EpochOnly(AbstractCallback):
    def __init__(self):
        super().__init__("epoch only")
        self.epochs = 0

    def on_epoch_end(self):
        self.epochs += 1


class StepCounting(AbstractCallback):
    def __init__(self):
        super().__init__("step counting")
        self.steps = 0

    def on_after_optimizer_step(self):
        self.steps += 1


def test_batch_hooks_are_skipped_only_while_no_callback_has_one():
    tl = make_loop()
    epoch_only = EpochOnly()
    tl.fit(num_epochs=1, callbacks=[epoch_only])
    assert not tl.callbacks_handler.has_batch_hooks and epoch_only.epochs == 1
    counting = StepCounting()
    tl.fit(num_epochs=2, callbacks=[counting])  # a later fit registering a batch-level hook turns the calls on
    assert tl.callbacks_handler.has_batch_hooks
    assert counting.steps == tl.iterations_done // 2  # every step of the second epoch


class BatchesUntil(AbstractCallback):
    """Counts batches and unsubscribes from the batch hooks, inside its own hook, after ``limit`` of them."""

    def __init__(self, limit: int):
        super().__init__("batches until")
        self.limit = limit
        self.batches = 0
        self.epochs = 0

    def on_batch_end(self):
        self.batches += 1
        if self.batches == self.limit:
            self.train_loop_obj.callbacks_handler.unsubscribe(self)

    def on_epoch_end(self):
        self.epochs += 1


def test_a_callback_unsubscribed_from_the_batch_hooks_is_not_called_for_them_until_it_subscribes_again():
    tl = make_loop()  # 3 batches an epoch
    callback, other = BatchesUntil(limit=4), BatchesUntil(limit=100)
    tl.fit(num_epochs=2, callbacks=[callback, other])  # unsubscribing during on_batch_end: `other` still runs
    assert (callback.batches, other.batches, callback.epochs) == (4, 6, 2)
    assert tl.callbacks_handler.has_batch_hooks  # `other`'s
    tl.callbacks_handler.unsubscribe(other, ["on_batch_end"])
    assert not tl.callbacks_handler.has_batch_hooks  # the loop skips the batch hooks now
    tl.fit(num_epochs=3, callbacks=[BatchesUntil(limit=100)])  # another registration keeps them unsubscribed
    assert (callback.batches, other.batches, callback.epochs) == (4, 6, 3)
    tl.callbacks_handler.subscribe(callback)
    tl.fit(num_epochs=4)
    assert (callback.batches, other.batches) == (7, 6)
    with pytest.raises(ValueError, match="on_batch_ends"):
        tl.callbacks_handler.unsubscribe(callback, ["on_batch_ends"])
