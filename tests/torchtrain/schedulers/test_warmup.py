"""Warmup schedulers: stepped once per optimizer step, never on a skipped (overflow) step."""
import io
import math
import pickle

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler

from aitoolbox.torchtrain.callbacks.basic import FunctionOnTrainLoop
from aitoolbox.torchtrain.precision import LossScaler, Precision
from aitoolbox.torchtrain.schedulers.warmup import (ConstantWithWarmupScheduler, CosineWithWarmupScheduler,
                                                    HardRestartsCosineWithWarmupScheduler,
                                                    LinearWithWarmupScheduler)
from aitoolbox.torchtrain.train_loop import TrainLoop

LR = 0.1
WARMUP = 4
TOTAL = 12  # 3 epochs x 4 optimizer steps (10 batches, grad_accumulation=3)


# The reference schedules, written out as in the BERT / HuggingFace definitions.
def constant_factor(step):
    return float(step) / float(max(1, WARMUP)) if step < WARMUP else 1.0


def linear_factor(step):
    if step < WARMUP:
        return float(step) / float(max(1, WARMUP))
    return max(0.0, float(TOTAL - step) / float(max(1, TOTAL - WARMUP)))


def cosine_factor(num_cycles):
    def factor(step):
        if step < WARMUP:
            return float(step) / float(max(1, WARMUP))
        progress = float(step - WARMUP) / float(max(1, TOTAL - WARMUP))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress)))
    return factor


def hard_restarts_factor(num_cycles):
    def factor(step):
        if step < WARMUP:
            return float(step) / float(max(1, WARMUP))
        progress = float(step - WARMUP) / float(max(1, TOTAL - WARMUP))
        if progress >= 1.0:
            return 0.0
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(num_cycles) * progress) % 1.0))))
    return factor


CASES = {
    "constant": (lambda: ConstantWithWarmupScheduler(WARMUP), constant_factor),
    "linear": (lambda: LinearWithWarmupScheduler(WARMUP, TOTAL), linear_factor),
    "cosine": (lambda: CosineWithWarmupScheduler(WARMUP, TOTAL), cosine_factor(0.5)),
    "cosine_1.5_cycles": (lambda: CosineWithWarmupScheduler(WARMUP, TOTAL, num_cycles=1.5), cosine_factor(1.5)),
    "hard_restarts": (lambda: HardRestartsCosineWithWarmupScheduler(WARMUP, TOTAL), hard_restarts_factor(0.5)),
    "hard_restarts_2_cycles": (lambda: HardRestartsCosineWithWarmupScheduler(WARMUP, TOTAL, num_cycles=2),
                               hard_restarts_factor(2)),
}


def step_lr_recorder(lrs):
    def record(tl):
        if tl.optimizer_step_due:
            lrs.append(tl.optimizer.param_groups[0]["lr"])
    return FunctionOnTrainLoop(record, after_gradient_update=True)


@pytest.mark.parametrize("case", list(CASES))
def test_warmup_schedule_per_optimizer_step_matches_a_hand_loop(make_model, make_loader, hand_train,
                                                                assert_params_equal, case):
    make_callback, factor = CASES[case]
    tl_model, hand_model = make_model(), make_model()
    tl_lrs, hand_lrs = [], []
    optimizer = torch.optim.AdamW(tl_model.parameters(), lr=LR)
    tl = TrainLoop(tl_model, make_loader(shuffle=True), None, None, optimizer, nn.MSELoss(), end_auto_eval=False,
                   show_progress=False)
    callback = make_callback()
    tl.fit(num_epochs=3, grad_accumulation=3, callbacks=[callback, step_lr_recorder(tl_lrs)])

    optimizer = torch.optim.AdamW(hand_model.parameters(), lr=LR)
    scheduler = lr_scheduler.LambdaLR(optimizer, factor)
    hand_train(hand_model, make_loader(shuffle=True), [optimizer], num_epochs=3, grad_accumulation=3,
               before_step=lambda: hand_lrs.append(optimizer.param_groups[0]["lr"]), after_step=scheduler.step)

    assert tl_lrs == hand_lrs and len(tl_lrs) == TOTAL
    assert tl_lrs[0] == 0.0 and max(tl_lrs) == LR  # starts at 0 before the first step, peaks after warmup
    assert callback.scheduler.last_epoch == TOTAL
    assert_params_equal(tl_model, hand_model)


def test_skipped_overflow_step_does_not_advance_the_schedule(make_model, make_loader, inf_loss_on_batches):
    model = inf_loss_on_batches(make_model(), {3, 12})
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    tl = TrainLoop(model, make_loader(), None, None, optimizer, nn.MSELoss(), end_auto_eval=False,
                   show_progress=False, use_amp=True)
    tl.precision = Precision("cpu", torch.bfloat16, LossScaler("dynamic"))
    callback = LinearWithWarmupScheduler(WARMUP, 20)
    lrs, skipped = [], []
    record = FunctionOnTrainLoop(lambda t: (lrs.append(t.optimizer.param_groups[0]["lr"]),
                                            skipped.append(t.optimizer_step_skipped)),
                                 after_optimizer_step=True, execution_order=-1)
    tl.fit(num_epochs=2, callbacks=[callback, record])  # 20 batches, one optimizer step each

    assert skipped.count(True) == 2 and skipped[3] and skipped[12]
    assert tl.precision.loss_scaler.loss_scale == 2.0 ** 14  # halved twice: the two steps really overflowed
    assert callback.scheduler.last_epoch == 18  # the 18 steps that happened
    # the learning rate used by step k follows the schedule at the count of steps taken before it
    factor = callback.scheduler.lr_lambdas[0]
    taken, expected = 0, []
    for was_skipped in skipped:
        expected.append(LR * factor(taken))
        taken += not was_skipped
    assert lrs == expected


def test_warmup_steps_every_optimizer(make_model, make_loader):
    model = make_model()
    optimizers = [torch.optim.SGD(model.hidden.parameters(), lr=0.1), torch.optim.SGD(model.out.parameters(), lr=0.2)]
    tl = TrainLoop(model, make_loader(), None, None, optimizers, nn.MSELoss(), end_auto_eval=False,
                   show_progress=False)
    callback = ConstantWithWarmupScheduler(num_warmup_steps=20)
    tl.fit(num_epochs=1, callbacks=[callback])  # 10 steps: half way through the warmup
    assert [s.last_epoch for s in callback.schedulers] == [10, 10]
    assert [opt.param_groups[0]["lr"] for opt in optimizers] == [0.1 * 0.5, 0.2 * 0.5]


def test_warmup_state_dict_and_pickling(make_model, make_loader):
    callback = CosineWithWarmupScheduler(2, 10, num_cycles=1.0)
    assert pickle.loads(pickle.dumps(callback)).scheduler_args["lr_lambda"].num_cycles == 1.0  # for spawned processes
    model = make_model()
    tl = TrainLoop(model, make_loader(), None, None, torch.optim.SGD(model.parameters(), lr=LR), nn.MSELoss(),
                   end_auto_eval=False, show_progress=False)
    tl.fit(num_epochs=1, callbacks=[callback])
    buffer = io.BytesIO()
    torch.save(callback.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["lr_lambdas"] == [{"num_warmup_steps": 2, "num_training_steps": 10, "num_cycles": 1.0}]
    assert state["last_epoch"] == 10


@pytest.mark.parametrize("factory, message", [
    (lambda: ConstantWithWarmupScheduler(-1), "num_warmup_steps must be an int >= 0, got -1"),
    (lambda: ConstantWithWarmupScheduler(2.0), "num_warmup_steps must be an int >= 0, got 2.0"),
    (lambda: LinearWithWarmupScheduler(2, 0), r"num_training_steps must be an int >= 1 .*got 0"),
    (lambda: LinearWithWarmupScheduler(2, "10"), r"num_training_steps must be an int >= 1 .*got '10'"),
    (lambda: LinearWithWarmupScheduler(5, 4), r"num_training_steps \(4\) must be >= num_warmup_steps \(5\)"),
    (lambda: CosineWithWarmupScheduler(1, 4, num_cycles=0), "num_cycles must be a number > 0, got 0"),
    (lambda: CosineWithWarmupScheduler(1, 4, num_cycles=None), "num_cycles must be a number > 0, got None"),
    (lambda: HardRestartsCosineWithWarmupScheduler(1, 4, num_cycles=-1), "num_cycles must be a number > 0, got -1"),
    (lambda: HardRestartsCosineWithWarmupScheduler(5, 4), r"num_training_steps \(4\) must be >= num_warmup_steps"),
])
def test_warmup_rejects_bad_arguments(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()


def test_warmup_rejects_unknown_keywords():
    with pytest.raises(TypeError, match=r"LambdaLR does not accept keyword argument\(s\) \['warmup'\]"):
        LinearWithWarmupScheduler(1, 4, warmup=3)
