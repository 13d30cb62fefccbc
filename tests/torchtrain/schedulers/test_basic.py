"""Epoch-based scheduler callbacks against hand-written loops driving the same torch schedulers."""
import io

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.basic import FunctionOnTrainLoop
from aitoolbox.torchtrain.model import TTModel
from aitoolbox.torchtrain.multi_loss_optim import MultiLoss
from aitoolbox.torchtrain.schedulers.basic import (AbstractScheduler, GeneralLRSchedulerCallback, LambdaLRScheduler,
                                                   MultiStepLRScheduler, ReduceLROnPlateauMetricScheduler,
                                                   ReduceLROnPlateauScheduler, StepLRScheduler)
from aitoolbox.torchtrain.train_loop import TrainLoop

LR = 0.1
NUM_EPOCHS = 4
GRAD_ACCUMULATION = 3


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


class LrRecorder:
    """Learning rates seen by the optimizer steps and after each epoch end (after the schedulers ran)."""

    def __init__(self):
        self.at_steps, self.at_epoch_ends = [], []

    def callbacks(self):
        def at_step(tl):
            if tl.optimizer_step_due:
                self.at_steps.append(tl.optimizer.param_groups[0]["lr"])
        return [FunctionOnTrainLoop(at_step, after_gradient_update=True),
                FunctionOnTrainLoop(lambda tl: self.at_epoch_ends.append(tl.optimizer.param_groups[0]["lr"]),
                                    epoch_end=True, execution_order=1000)]


def fit_trainloop(model, loader, callback, val_loader=None, end_auto_eval=False, num_epochs=NUM_EPOCHS):
    recorder = LrRecorder()
    tl = TrainLoop(model, loader, val_loader, None, sgd(model), nn.MSELoss(), end_auto_eval=end_auto_eval,
                   show_progress=False)
    tl.fit(num_epochs=num_epochs, grad_accumulation=GRAD_ACCUMULATION, callbacks=[callback] + recorder.callbacks())
    return tl, recorder


def fit_by_hand(hand_train, model, loader, make_scheduler, per_step=False, per_epoch=True, epoch_metric=None,
                num_epochs=NUM_EPOCHS):
    optimizer = sgd(model)
    scheduler = make_scheduler(optimizer)  # created before training, like the callback at registration
    recorder = LrRecorder()

    def before_step():
        recorder.at_steps.append(optimizer.param_groups[0]["lr"])

    def after_step():
        if per_step:
            scheduler.step()

    def epoch_end(epoch):
        if per_epoch:
            scheduler.step() if epoch_metric is None else scheduler.step(epoch_metric(model))
        recorder.at_epoch_ends.append(optimizer.param_groups[0]["lr"])

    hand_train(model, loader, [optimizer], num_epochs, GRAD_ACCUMULATION, before_step, after_step, epoch_end)
    return recorder


EPOCH_CASES = {
    "step": (lambda: StepLRScheduler(step_size=2, gamma=0.5), lambda opt: lr_scheduler.StepLR(opt, 2, gamma=0.5)),
    "multistep": (lambda: MultiStepLRScheduler([1, 3], gamma=0.5),
                  lambda opt: lr_scheduler.MultiStepLR(opt, [1, 3], gamma=0.5)),
    "multistep_aitoolbox_name": (lambda: MultiStepLRScheduler(milestones_list=[2]),
                                 lambda opt: lr_scheduler.MultiStepLR(opt, [2])),
    "multistep_torch_name": (lambda: MultiStepLRScheduler(milestones=[2]),
                             lambda opt: lr_scheduler.MultiStepLR(opt, [2])),
    "lambda": (lambda: LambdaLRScheduler(lambda epoch: 0.1 * (epoch + 1)),
               lambda opt: lr_scheduler.LambdaLR(opt, lambda epoch: 0.1 * (epoch + 1))),
    "general_exponential": (lambda: GeneralLRSchedulerCallback(lr_scheduler.ExponentialLR, gamma=0.7),
                            lambda opt: lr_scheduler.ExponentialLR(opt, gamma=0.7)),
    "general_cosine": (lambda: GeneralLRSchedulerCallback(lr_scheduler.CosineAnnealingLR, T_max=3),
                       lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=3)),
}


@pytest.mark.parametrize("case", list(EPOCH_CASES))
def test_epoch_schedulers_match_a_hand_loop(make_model, make_loader, hand_train, assert_params_equal, case):
    make_callback, make_scheduler = EPOCH_CASES[case]
    tl_model, hand_model = make_model(), make_model()
    _, tl_lrs = fit_trainloop(tl_model, make_loader(shuffle=True), make_callback())
    hand_lrs = fit_by_hand(hand_train, hand_model, make_loader(shuffle=True), make_scheduler)
    assert tl_lrs.at_steps == hand_lrs.at_steps and len(tl_lrs.at_steps) == 4 * NUM_EPOCHS
    assert tl_lrs.at_epoch_ends == hand_lrs.at_epoch_ends
    assert len(set(tl_lrs.at_epoch_ends)) > 1  # the schedule did change the learning rate
    assert_params_equal(tl_model, hand_model)


STEP_CASES = {
    "general_per_step": (lambda: GeneralLRSchedulerCallback(lr_scheduler.StepLR, step_per_optimizer_step=True,
                                                            step_size=3, gamma=0.5),
                         lambda opt: lr_scheduler.StepLR(opt, 3, gamma=0.5), True, False),
    "lambda_per_step": (lambda: LambdaLRScheduler(lambda s: 1 / (1 + s), execute_epoch_end=False,
                                                  execute_batch_end=True),
                        lambda opt: lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)), True, False),
    "lambda_both": (lambda: LambdaLRScheduler(lambda s: 0.9 ** s, execute_batch_end=True),
                    lambda opt: lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s), True, True),
}


@pytest.mark.parametrize("case", list(STEP_CASES))
def test_per_optimizer_step_schedulers_match_a_hand_loop(make_model, make_loader, hand_train, assert_params_equal,
                                                         case):
    make_callback, make_scheduler, per_step, per_epoch = STEP_CASES[case]
    tl_model, hand_model = make_model(), make_model()
    _, tl_lrs = fit_trainloop(tl_model, make_loader(shuffle=True), make_callback())
    hand_lrs = fit_by_hand(hand_train, hand_model, make_loader(shuffle=True), make_scheduler, per_step, per_epoch)
    assert tl_lrs.at_steps == hand_lrs.at_steps and len(set(tl_lrs.at_steps)) > 4
    assert tl_lrs.at_epoch_ends == hand_lrs.at_epoch_ends
    assert_params_equal(tl_model, hand_model)


def test_scheduler_is_created_at_registration(make_model, make_loader):
    callback = LambdaLRScheduler(lambda epoch: 0.1 * (epoch + 1))
    assert callback.scheduler is None
    first_lr = []
    model = make_model()
    tl = TrainLoop(model, make_loader(), None, None, sgd(model), nn.MSELoss(), end_auto_eval=False,
                   show_progress=False)
    record = FunctionOnTrainLoop(lambda t: first_lr.append(t.optimizer.param_groups[0]["lr"]), train_begin=True)
    tl.fit(num_epochs=1, callbacks=[callback, record])
    assert isinstance(callback.scheduler, lr_scheduler.LambdaLR)
    assert first_lr == [pytest.approx(LR * 0.1)]  # lambda(0) applies before the first batch


# --- ReduceLROnPlateau ----------------------------------------------------------------------------------------
def hand_val_loss(loader):
    def evaluate(model):
        total, count = torch.zeros((), dtype=torch.float64), 0
        with torch.no_grad():
            for x, y in loader:
                total += nn.functional.mse_loss(model(x), y).double() * len(x)
                count += len(x)
        return (total / count).item()
    return evaluate


PLATEAU_KWARGS = dict(factor=0.5, patience=0, threshold=0.3)


def test_reduce_on_plateau_uses_val_loss_like_a_hand_loop(make_model, make_loader, hand_train, assert_params_equal):
    tl_model, hand_model = make_model(), make_model()
    tl, tl_lrs = fit_trainloop(tl_model, make_loader(shuffle=True), ReduceLROnPlateauScheduler(**PLATEAU_KWARGS),
                               val_loader=make_loader(num_samples=20, seed=5), end_auto_eval=True, num_epochs=6)
    hand_lrs = fit_by_hand(hand_train, hand_model, make_loader(shuffle=True),
                           lambda opt: lr_scheduler.ReduceLROnPlateau(opt, **PLATEAU_KWARGS),
                           epoch_metric=hand_val_loss(make_loader(num_samples=20, seed=5)), num_epochs=6)
    assert tl_lrs.at_epoch_ends == hand_lrs.at_epoch_ends and len(set(tl_lrs.at_epoch_ends)) > 1
    assert tl_lrs.at_steps == hand_lrs.at_steps
    assert_params_equal(tl_model, hand_model)


@pytest.mark.parametrize("end_auto_eval", [False, 2])
def test_reduce_on_plateau_evaluates_when_the_loop_did_not(make_model, make_loader, assert_params_equal,
                                                           end_auto_eval):
    reference_model, model = make_model(), make_model()
    _, reference_lrs = fit_trainloop(reference_model, make_loader(), ReduceLROnPlateauScheduler(**PLATEAU_KWARGS),
                                     val_loader=make_loader(num_samples=20, seed=5), end_auto_eval=True, num_epochs=6)
    _, lrs = fit_trainloop(model, make_loader(), ReduceLROnPlateauScheduler(**PLATEAU_KWARGS),
                           val_loader=make_loader(num_samples=20, seed=5), end_auto_eval=end_auto_eval, num_epochs=6)
    assert lrs.at_epoch_ends == reference_lrs.at_epoch_ends and len(set(lrs.at_epoch_ends)) > 1
    assert_params_equal(model, reference_model)


class CountingLoader:
    """A loader that counts the passes over it."""

    def __init__(self, loader):
        self.loader, self.passes = loader, 0

    def __iter__(self):
        self.passes += 1
        return iter(self.loader)

    def __len__(self):
        return len(self.loader)


def test_reduce_on_plateau_shares_the_loops_val_loss_evaluation(make_model, make_loader):
    val_loader = CountingLoader(make_loader(num_samples=20, seed=5))
    fit_trainloop(make_model(), make_loader(), ReduceLROnPlateauScheduler(**PLATEAU_KWARGS), val_loader=val_loader,
                  end_auto_eval=True, num_epochs=3)
    assert val_loader.passes == 3  # one evaluation per epoch, used by the history and the scheduler


class TwoLossModel(TTModel):
    """Regression with a MultiLoss: the MSE and (scaled by ``weight``) the L1 loss."""

    def __init__(self, weight):
        super().__init__()
        self.linear = nn.Linear(4, 1)
        self.weight = weight

    def forward(self, x):
        return self.linear(x)

    def get_loss(self, batch_data, criterion, device):
        x, y = batch_data
        prediction = self(x)
        return MultiLoss({"mse": nn.functional.mse_loss(prediction, y),
                          "l1": self.weight * nn.functional.l1_loss(prediction, y)})

    def get_predictions(self, batch_data, device):
        x, y = batch_data
        return self(x), y, None


@pytest.mark.parametrize("main_multi_loss", [None, "mse", "l1"])
def test_reduce_on_plateau_with_a_multi_loss(make_loader, main_multi_loss):
    torch.manual_seed(0)
    model = TwoLossModel(weight=3.0)
    val_loader = make_loader(num_samples=20, seed=5)
    steps = []

    class Spy(lr_scheduler.ReduceLROnPlateau):
        def step(self, metrics, *args, **kwargs):
            steps.append(metrics)
            return super().step(metrics, *args, **kwargs)

    callback = ReduceLROnPlateauScheduler(main_multi_loss=main_multi_loss)
    callback.scheduler_class = Spy
    tl = TrainLoop(model, make_loader(), val_loader, None, sgd(model), None, show_progress=False)
    expected = []
    record = FunctionOnTrainLoop(lambda t: expected.append(t.evaluate_loss_on_validation_set(float_dict_format=True)), epoch_end=True)
    tl.fit(num_epochs=2, callbacks=[callback, record])
    for value, losses in zip(steps, expected):
        wanted = (losses["mse"] + losses["l1"]) / 2 if main_multi_loss is None else losses[main_multi_loss]
        assert value == pytest.approx(float(wanted))
    with pytest.raises(KeyError, match="main_multi_loss='huber' is not a loss of the MultiLoss"):
        TrainLoop(model, make_loader(), val_loader, None, sgd(model), None, show_progress=False).fit(
            num_epochs=1, callbacks=[ReduceLROnPlateauScheduler(main_multi_loss="huber")])


def test_reduce_on_plateau_without_validation_data(make_model, make_loader):
    with pytest.raises(ValueError, match="steps on the validation loss, but the TrainLoop has no validation_loader"):
        fit_trainloop(make_model(), make_loader(), ReduceLROnPlateauScheduler())


def test_reduce_on_plateau_metric_scheduler(make_model, make_loader):
    values = [0.5, 0.6, 0.6, 0.7, 0.65, 0.65]
    scripted = FunctionOnTrainLoop(lambda t: t.insert_metric_result_into_history("val_acc", values[t.epoch]),
                                   epoch_end=True)
    callback = ReduceLROnPlateauMetricScheduler("val_acc", mode="max", factor=0.5, patience=0)
    recorder = LrRecorder()
    model = make_model()
    tl = TrainLoop(model, make_loader(), None, None, sgd(model), nn.MSELoss(), end_auto_eval=False,
                   show_progress=False)
    # registered before the callback recording the metric: execution_order 90 still runs it after
    tl.fit(num_epochs=len(values), callbacks=[callback, scripted] + recorder.callbacks())
    assert recorder.at_epoch_ends == [LR, LR, LR * 0.5, LR * 0.5, LR * 0.25, LR * 0.125]


def test_reduce_on_plateau_metric_missing(make_model, make_loader):
    with pytest.raises(ValueError, match=r"follows 'val_acc', which is not in train_history \(recorded metrics: "
                                         r"'loss', 'accumulated_loss'\)"):
        fit_trainloop(make_model(), make_loader(), ReduceLROnPlateauMetricScheduler("val_acc"))


# --- several optimizers --------------------------------------------------------------------------------------
def two_optimizer_loop(model, loader):
    optimizers = [torch.optim.SGD(model.hidden.parameters(), lr=0.1), torch.optim.SGD(model.out.parameters(), lr=0.2)]
    return TrainLoop(model, loader, None, None, optimizers, nn.MSELoss(), end_auto_eval=False, show_progress=False)


def test_one_scheduler_per_optimizer(make_model, make_loader):
    tl = two_optimizer_loop(make_model(), make_loader())
    callback = StepLRScheduler(step_size=1, gamma=0.5)
    tl.fit(num_epochs=2, callbacks=[callback])
    assert len(callback.schedulers) == 2
    assert [opt.param_groups[0]["lr"] for opt in tl.optimizers] == [0.025, 0.05]
    with pytest.raises(RuntimeError, match="drives 2 schedulers, one per optimizer: use .schedulers"):
        callback.scheduler


def test_optimizer_idx_selects_one_optimizer(make_model, make_loader):
    tl = two_optimizer_loop(make_model(), make_loader())
    by_index = StepLRScheduler(step_size=1, gamma=0.5, optimizer_idx=1)
    tl.fit(num_epochs=2, callbacks=[by_index])
    assert [opt.param_groups[0]["lr"] for opt in tl.optimizers] == [0.1, 0.05]
    assert by_index.scheduler.optimizer is tl.optimizers[1]

    tl = two_optimizer_loop(make_model(), make_loader())
    by_object = GeneralLRSchedulerCallback(lr_scheduler.StepLR, optimizer_idx=tl.optimizers[0], step_size=1)
    tl.fit(num_epochs=1, callbacks=[by_object])
    assert by_object.scheduler.optimizer is tl.optimizers[0]

    tl = two_optimizer_loop(make_model(), make_loader())
    with pytest.raises(ValueError, match=r"optimizer_idx=2 is out of range: the TrainLoop has 2 optimizer\(s\), "
                                         r"valid indices are 0..1"):
        tl.fit(num_epochs=1, callbacks=[StepLRScheduler(1, optimizer_idx=2)])


class TwoHeadModel(TTModel):
    """Two heads, each trained by its own optimizer through its own loss of a MultiLoss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head_a, self.head_b = nn.Linear(4, 1), nn.Linear(4, 1)

    def forward(self, x):
        return self.head_a(x)

    def get_loss(self, batch_data, criterion, device):
        x, y = batch_data
        return MultiLoss({"a": nn.functional.mse_loss(self.head_a(x), y),
                          "b": nn.functional.mse_loss(self.head_b(x), y)})

    def get_predictions(self, batch_data, device):
        x, y = batch_data
        return self(x), y, None


def head_optimizers(model):
    return [torch.optim.SGD(model.head_a.parameters(), lr=0.1), torch.optim.SGD(model.head_b.parameters(), lr=0.2)]


def test_per_step_schedulers_of_optimizers_stepped_one_after_another_match_a_hand_loop(make_loader):
    """A MultiLoss steps its optimizers one after another, so ``on_after_optimizer_step`` runs once per optimizer:
    each scheduler steps once per step of its own optimizer (not once per optimizer of the batch)."""
    loader, grad_accumulation = make_loader(num_samples=22), 2  # 6 batches, 3 update iterations
    model = TwoHeadModel()
    tl = TrainLoop(model, loader, None, None, head_optimizers(model), None, end_auto_eval=False,
                   show_progress=False)
    callback = GeneralLRSchedulerCallback(lr_scheduler.StepLR, step_per_optimizer_step=True, step_size=1, gamma=0.5)
    tl.fit(num_epochs=2, grad_accumulation=grad_accumulation, callbacks=[callback])

    hand = TwoHeadModel()
    optimizers = head_optimizers(hand)
    schedulers = [lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5) for optimizer in optimizers]
    for _ in range(2):
        for idx, batch in enumerate(loader):
            losses = hand.get_loss(batch, None, None)
            update = (idx + 1) % grad_accumulation == 0 or idx == len(loader) - 1
            for name, optimizer, scheduler in zip("ab", optimizers, schedulers):
                (losses[name] / grad_accumulation).backward()
                if update:
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()

    assert [scheduler.last_epoch for scheduler in callback.schedulers] == [6, 6]
    assert [opt.param_groups[0]["lr"] for opt in tl.optimizers] == [opt.param_groups[0]["lr"] for opt in optimizers]
    for (name, trained), expected in zip(model.state_dict().items(), hand.state_dict().values()):
        assert torch.equal(trained, expected), name


# --- AbstractScheduler ---------------------------------------------------------------------------------------
def test_scheduler_callbacks_are_listed_by_the_train_loop(make_model, make_loader):
    tl, _ = fit_trainloop(make_model(), make_loader(), StepLRScheduler(1), num_epochs=1)
    step = tl.callbacks[0]
    assert isinstance(step, AbstractScheduler) and tl.get_schedulers() == [step]


class Warmup1x(AbstractScheduler, AbstractCallback):
    """A scheduler callback written as aitoolbox 1.x documents: assign ``self.scheduler``, step it yourself."""

    def __init__(self):
        AbstractScheduler.__init__(self)
        AbstractCallback.__init__(self, "1.x scheduler")

    def on_train_loop_registration(self):
        self.scheduler = lr_scheduler.StepLR(self.train_loop_obj.optimizer, 1, gamma=0.5)

    def on_epoch_end(self):
        self.scheduler.step()


def test_a_1x_style_scheduler_callback(make_model, make_loader):
    callback = Warmup1x()
    tl, recorder = fit_trainloop(make_model(), make_loader(), callback, num_epochs=2)
    assert recorder.at_epoch_ends == [LR * 0.5, LR * 0.25]
    assert tl.get_schedulers() == [callback] and callback.state_dict()["last_epoch"] == 2
    callback.load_state_dict({**callback.state_dict(), "last_epoch": 5})
    assert callback.scheduler.last_epoch == 5


def test_schedulers_exist_before_on_train_loop_registration_and_can_be_assigned(make_model, make_loader):
    seen = []

    class Subclass(StepLRScheduler):
        def on_train_loop_registration(self):  # no super() call, as 1.x subclasses may do
            seen.append(self.scheduler)
            self.scheduler = lr_scheduler.ExponentialLR(self.train_loop_obj.optimizer, gamma=0.5)

    tl, recorder = fit_trainloop(make_model(), make_loader(), Subclass(step_size=10), num_epochs=2)
    assert isinstance(seen[0], lr_scheduler.StepLR)
    assert recorder.at_epoch_ends == [LR * 0.5, LR * 0.25]  # the assigned scheduler is the one stepped


def test_old_import_path_of_the_schedulers():
    from aitoolbox.torchtrain.callbacks import train_schedule
    from aitoolbox.torchtrain.schedulers import warmup
    assert train_schedule.StepLRScheduler is StepLRScheduler
    assert train_schedule.HardRestartsCosineWithWarmupScheduler is warmup.HardRestartsCosineWithWarmupScheduler
    assert train_schedule.AbstractScheduler is AbstractScheduler


# --- state_dict ----------------------------------------------------------------------------------------------
def test_state_dict_round_trip_through_a_weights_only_checkpoint(make_model, make_loader):
    tl, _ = fit_trainloop(make_model(), make_loader(), MultiStepLRScheduler([1, 2], gamma=0.5), num_epochs=3)
    callback = tl.callbacks[0]
    buffer = io.BytesIO()
    torch.save(callback.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)

    model = make_model()
    restored = MultiStepLRScheduler([1, 2], gamma=0.5)
    restored.register_train_loop_object(TrainLoop(model, make_loader(), None, None, sgd(model), nn.MSELoss(),
                                                  show_progress=False))
    assert state == callback.scheduler.state_dict()  # the torch scheduler's own state, as in aitoolbox 1.x
    restored.load_state_dict(state)
    assert restored.scheduler.last_epoch == callback.scheduler.last_epoch == 3
    assert restored.scheduler.get_last_lr() == callback.scheduler.get_last_lr()
    restored.load_state_dict({"schedulers": [state]})  # the list form of several schedulers works too


def test_state_dict_errors(make_model, make_loader):
    with pytest.raises(RuntimeError, match=r"StepLRScheduler.state_dict\(\) needs the schedulers, which are created "
                                           r"when the callback is registered"):
        StepLRScheduler(1).state_dict()
    tl = two_optimizer_loop(make_model(), make_loader())
    callback = StepLRScheduler(1)
    callback.register_train_loop_object(tl)
    with pytest.raises(ValueError, match=r"the state holds 1 scheduler state\(s\) but this callback drives 2"):
        callback.load_state_dict({"schedulers": [callback.schedulers[0].state_dict()]})


# --- bad arguments -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("factory, error, message", [
    (lambda: StepLRScheduler(0), ValueError, r"step_size must be an int >= 1 .*got 0"),
    (lambda: StepLRScheduler(2.5), ValueError, r"step_size must be an int >= 1 .*got 2.5"),
    (lambda: MultiStepLRScheduler([3, 1]), ValueError, r"strictly increasing list of ints >= 1, got \[3, 1\]"),
    (lambda: MultiStepLRScheduler([]), ValueError, r"non-empty, strictly increasing list of ints >= 1, got \[\]"),
    (lambda: MultiStepLRScheduler([0, 2]), ValueError, r"ints >= 1, got \[0, 2\]"),
    (lambda: MultiStepLRScheduler([1], milestones=[2]), TypeError, "pass milestones_list or milestones"),
    (lambda: StepLRScheduler(2, gama=0.1), TypeError, r"StepLR does not accept keyword argument\(s\) \['gama'\]; "
                                                      r"it accepts: \['gamma', 'last_epoch', 'step_size'\]"),
    (lambda: GeneralLRSchedulerCallback(lr_scheduler.StepLR), TypeError,
     r"StepLR needs the keyword argument\(s\) \['step_size'\]"),
    (lambda: GeneralLRSchedulerCallback("StepLR"), TypeError, "scheduler_class must be a scheduler class"),
    (lambda: GeneralLRSchedulerCallback(lr_scheduler.StepLR, optimizer_idx="0", step_size=1), TypeError,
     "optimizer_idx must be None, an int index or a torch.optim.Optimizer, got '0'"),
    (lambda: GeneralLRSchedulerCallback(lr_scheduler.StepLR, optimizer_idx=-1, step_size=1), ValueError,
     "optimizer_idx must be >= 0, got -1"),
    (lambda: LambdaLRScheduler(0.5), TypeError, "lr_lambda must be a function of the step count"),
    (lambda: LambdaLRScheduler([abs, 0.5]), TypeError, "lr_lambda must be a function of the step count"),
    (lambda: LambdaLRScheduler(abs, execute_epoch_end=False), ValueError, "the scheduler would never step"),
    (lambda: ReduceLROnPlateauScheduler(patiance=3), TypeError,
     r"ReduceLROnPlateau does not accept keyword argument\(s\) \['patiance'\]"),
    (lambda: ReduceLROnPlateauMetricScheduler(""), ValueError, "metric_name must be the name of a train_history"),
])
def test_bad_arguments(factory, error, message):
    with pytest.raises(error, match=message):
        factory()
