"""WeightAveraging (EMA / SWA) against hand-written loops with torch.optim.swa_utils.AveragedModel, bitwise.

Covered: the averages (EMA every step, SWA per epoch from a start epoch, SWA every N steps from a start iteration,
BatchNorm statistics recomputed with update_bn), evaluation with the average (the loop's losses and the
predictions of on_epoch_end callbacks), training untouched by it, the final model ModelTrainEndSave saves, bitwise
resume from epoch-end and mid-epoch checkpoint files, a loader without len, and two DDP processes (gloo).
"""
import copy
import logging
import os
import pickle

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn, update_bn
from torch.utils.data import DataLoader

from aitoolbox.experiment.local_save.checkpoints import list_checkpoints
from aitoolbox.torchtrain.callbacks import WeightAveraging
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.model_save import ModelCheckpoint, ModelIterationCheckpoint, ModelTrainEndSave
from aitoolbox.torchtrain.model import TTModel
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import (
    IN_FEATURES, MLP, NUM_CLASSES, TRAIN_SEED, ClassifierMixin, IterableTensorData, classification_data,
    distinct_records, model_pair, seeded_loader, single_torch_thread)
from tests.torchtrain.distributed.support import BatchNormRegressor, make_model, make_train_loop, regression_data

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")

EPOCHS = 3
TRAIN = classification_data(30)  # batches of 8: 4 per epoch, the last one of 6
VALIDATION = classification_data(12, seed=3)
# TrainLoop's device: the references compute there too, so that bitwise holds on a GPU (is_available, unlike
# tests.helpers.default_device, leaves CUDA uninitialised: the DDP tests fork their CPU processes).
DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


class BatchNormMLP(ClassifierMixin, TTModel):
    """A linear layer, BatchNorm1d and a classifier (no dropout: update_bn's pass draws no random numbers)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, 16)
        self.norm = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, NUM_CLASSES)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def pair(model_class=MLP):
    """Equal models for TrainLoop and for a reference run, the reference already on the training device (its
    AveragedModel is a copy made there)."""
    model, reference = model_pair(model_class)
    return model, reference.to(DEVICE)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def validation_loader() -> DataLoader:
    return seeded_loader(VALIDATION, 5, shuffle=False)


def train_loop(model: nn.Module, loader=None, test_loader=None) -> TrainLoop:
    loader = loader if loader is not None else seeded_loader(TRAIN, 8)
    return TrainLoop(model, loader, validation_loader(), test_loader, make_optimizer(model), nn.CrossEntropyLoss(),
                     show_progress=False)


def fit(model: nn.Module, callbacks, num_epochs: int = EPOCHS, loader=None, test_loader=None,
        **fit_options) -> TrainLoop:
    tl = train_loop(model, loader, test_loader)
    torch.manual_seed(TRAIN_SEED)
    tl.fit(num_epochs=num_epochs, callbacks=callbacks, **fit_options)
    return tl


def evaluate_by_hand(module: nn.Module) -> float:
    """The loop's validation loss: the sample-weighted mean of the batch losses, in eval mode."""
    was_training = module.training
    module.eval()
    total, count = (torch.zeros((), dtype=torch.float64, device=DEVICE) for _ in range(2))
    with torch.no_grad():
        for x, y in validation_loader():
            total = total + nn.functional.cross_entropy(module(x.to(DEVICE)), y.to(DEVICE)).double() * len(x)
            count += len(x)
    module.train(was_training)
    return float(total / count)  # a tensor divisor: on CUDA a Python number would be multiplied by its inverse


def reference_run(model: nn.Module, averaged: AveragedModel, num_epochs: int = EPOCHS, update_step=None,
                  update_epoch=None, loader=None) -> list:
    """Plain PyTorch training; ``update_step(step, epoch, batch_index)`` / ``update_epoch(epoch)`` say when to
    average. Returns, per epoch, ``(the averaged module's state, its validation loss)`` after the epoch."""
    loader = loader if loader is not None else seeded_loader(TRAIN, 8)
    optimizer = make_optimizer(model)
    torch.manual_seed(TRAIN_SEED)
    model.train()
    per_epoch, step, batch_index = [], 0, -1
    for epoch in range(num_epochs):
        for x, y in loader:
            batch_index += 1
            nn.functional.cross_entropy(model(x.to(DEVICE)), y.to(DEVICE)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if update_step is not None and update_step(step, epoch, batch_index):
                averaged.update_parameters(model)
            step += 1
        if update_epoch is not None and update_epoch(epoch):
            averaged.update_parameters(model)
        per_epoch.append((copy.deepcopy(averaged.module.state_dict()), evaluate_by_hand(averaged.module)))
    return per_epoch


class RecordAtEpochEnd(AbstractCallback):
    """At every epoch end (before WeightAveraging's own hook): the model's state and validation predictions."""

    def __init__(self):
        super().__init__("record", execution_order=0)
        self.states, self.predictions = [], []

    def on_epoch_end(self):
        tl = self.train_loop_obj
        self.states.append(copy.deepcopy(tl.model.state_dict()))
        self.predictions.append(tl.predict_on_validation_set()[0])


def assert_states_equal(expected: dict, got: dict) -> None:
    assert list(expected) == list(got)
    for key in expected:
        assert torch.equal(expected[key].cpu(), got[key].cpu()), f"{key} differs"


def assert_same_run(expected: TrainLoop, got: TrainLoop, expected_cb: WeightAveraging, got_cb: WeightAveraging):
    assert_states_equal(expected.model.state_dict(), got.model.state_dict())
    assert_states_equal(expected_cb.averaged_model.state_dict(), got_cb.averaged_model.state_dict())
    assert expected.train_history == got.train_history
    assert (expected.epoch, expected.total_iteration_idx) == (got.epoch, got.total_iteration_idx)


# --- the averages -------------------------------------------------------------------------------------------------
def test_ema_matches_averaged_model_and_evaluation_uses_it():
    model, reference = pair()  # dropout: the training run draws random numbers
    record = RecordAtEpochEnd()
    averaging = WeightAveraging(decay=0.9, save_average=False)
    tl = fit(model, [averaging, record])

    ema = AveragedModel(reference, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    expected = reference_run(reference, ema, update_step=lambda *_: True)

    assert_states_equal(ema.module.state_dict(), averaging.average_module.state_dict())
    assert averaging.num_averaged == 4 * EPOCHS
    assert_states_equal(reference.state_dict(), tl.model.state_dict())  # training weights back (save_average=False)
    for epoch, (state, val_loss) in enumerate(expected):
        assert_states_equal(state, record.states[epoch])  # the model holds the average at the epoch end...
        assert tl.train_history["val_loss"][epoch] == val_loss  # ...and the loop evaluated it
        ema.module.load_state_dict(state)
        ema.module.eval()
        with torch.no_grad():
            by_hand = torch.cat([ema.module(x.to(DEVICE)).argmax(dim=1).cpu() for x, _ in validation_loader()])
        assert torch.equal(record.predictions[epoch], by_hand)


def test_swa_from_a_start_epoch_with_batchnorm_statistics_recomputed_at_the_end():
    model, reference = pair(BatchNormMLP)
    averaging = WeightAveraging(mode="swa", start_epoch=1, update_bn=True)
    tl = fit(model, [averaging], num_epochs=4, test_loader=validation_loader())

    swa = AveragedModel(reference)
    loader = seeded_loader(TRAIN, 8)
    expected = reference_run(reference, swa, num_epochs=4, update_epoch=lambda epoch: epoch >= 1, loader=loader)
    update_bn(loader, swa, device=DEVICE)  # its generator drawn from 4 times, as the loop's was

    assert averaging.num_averaged == 3
    assert_states_equal(swa.module.state_dict(), averaging.average_module.state_dict())
    assert_states_equal(swa.module.state_dict(), tl.model.state_dict())  # save_average: fit returns the average
    assert tl.train_history["val_loss"][1:] == [val_loss for _, val_loss in expected[1:]]
    assert tl.train_history["val_loss"][0] != expected[0][1]  # epoch 0: no average yet, the training weights
    # Recomputed at the end of the last epoch (known to be the last), so the test loss at the end sees them.
    assert not torch.equal(swa.module.norm.running_mean, expected[3][0]["norm.running_mean"])
    assert tl.train_history["train_end_test_loss"] == [evaluate_by_hand(swa.module)]


def test_swa_every_n_steps_from_a_start_iteration():
    model, reference = pair()
    averaging = WeightAveraging(mode="swa", update_every=3, start_iteration=5)
    fit(model, [averaging])

    swa = AveragedModel(reference)
    reference_run(reference, swa, update_step=lambda step, epoch, batch: batch >= 5 and (step - 5) % 3 == 0)
    assert averaging.num_averaged == len(range(5, 4 * EPOCHS, 3))
    assert_states_equal(swa.module.state_dict(), averaging.average_module.state_dict())


def test_training_is_bitwise_the_same_as_without_the_callback():
    """Dropout, a shuffling loader, BatchNorm statistics recomputed at every fit's end: same training weights."""
    plain_model, averaged_model = model_pair(MLP)
    plain = fit(plain_model, [], num_epochs=2)
    plain.fit(num_epochs=4)
    averaging = WeightAveraging(decay=0.5, update_bn=True, save_average=False)
    averaged = fit(averaged_model, [averaging], num_epochs=2)
    averaged.fit(num_epochs=4)
    assert_states_equal(plain.model.state_dict(), averaged.model.state_dict())
    assert plain.train_history["accumulated_loss"] == averaged.train_history["accumulated_loss"]
    assert plain.train_history["val_loss"] != averaged.train_history["val_loss"]


def test_fit_continued_after_the_average_was_left_in_the_model():
    """save_average leaves the average in the model after fit; the next fit trains on from the training weights."""
    straight_model, split_model = model_pair()
    straight_cb, split_cb = WeightAveraging(decay=0.8), WeightAveraging(decay=0.8)
    straight = fit(straight_model, [straight_cb], num_epochs=4)
    split = fit(split_model, [split_cb], num_epochs=2)
    assert split_cb.average_in_model
    assert_states_equal(split_cb.average_module.state_dict(), split.model.state_dict())
    split.fit(num_epochs=4)
    assert_same_run(straight, split, straight_cb, split_cb)


@pytest.mark.parametrize("save_average", [True, False])
def test_final_model_saved_by_model_train_end_save(tmp_path, save_average):
    model, reference = pair()
    averaging = WeightAveraging(decay=0.9, save_average=save_average)
    tl = fit(model, [averaging, ModelTrainEndSave("proj", "exp", str(tmp_path))])
    (run,) = os.listdir(tmp_path / "proj")
    (name,) = os.listdir(tmp_path / "proj" / run / "model")
    checkpoint = torch.load(tmp_path / "proj" / run / "model" / name, weights_only=True)
    expected = averaging.average_module.state_dict() if save_average else reference_weights(reference)
    assert_states_equal(expected, checkpoint["model_state_dict"])
    assert_states_equal(expected, tl.model.state_dict())
    state = checkpoint["callbacks"]["WeightAveraging:0"]
    assert_states_equal(averaging.averaged_model.state_dict(), state["averaged"])
    assert (state["training_weights"] is not None) == save_average


def reference_weights(reference: nn.Module) -> dict:
    reference_run(reference, AveragedModel(reference))
    return reference.state_dict()


# --- checkpoints --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["ema", "swa"])
def test_resume_from_an_epoch_checkpoint_file_is_bitwise(tmp_path, mode):
    folder = dict(project_name="proj", experiment_name="exp", local_model_result_folder_path=str(tmp_path))
    options = dict(mode=mode, update_bn=mode == "swa")
    straight_model, stopped_model = model_pair(BatchNormMLP)
    straight_cb = WeightAveraging(**options)
    straight = fit(straight_model, [straight_cb], num_epochs=4)
    stopped_cb = WeightAveraging(**options)
    fit(stopped_model, [stopped_cb, ModelCheckpoint(**folder)], num_epochs=2)
    (run,) = os.listdir(tmp_path / "proj")
    first, second = list_checkpoints(str(tmp_path / "proj" / run / "checkpoint_model"))
    # Saved at an epoch end, while the model held the average: it is the checkpoint's model.
    checkpoint = torch.load(first, weights_only=True)
    averaged_state = checkpoint["callbacks"]["WeightAveraging:0"]["averaged"]
    assert_states_equal({k[len("module."):]: v for k, v in averaged_state.items() if k != "n_averaged"},
                        checkpoint["model_state_dict"])

    torch.manual_seed(123)  # the checkpoint's random state wins
    resumed_model, _ = model_pair(BatchNormMLP)
    resumed_cb = WeightAveraging(**options)
    resumed = train_loop(resumed_model)
    resumed.load_checkpoint(second)
    resumed.fit(num_epochs=4, callbacks=[resumed_cb])
    assert_same_run(straight, resumed, straight_cb, resumed_cb)


class Crash(Exception):
    pass


class CrashAfter(AbstractCallback):
    def __init__(self, batches: int):
        super().__init__("crash", execution_order=1000)
        self.batches = batches

    def on_batch_end(self):
        if self.train_loop_obj.total_iteration_idx + 1 == self.batches:
            raise Crash()


@pytest.mark.parametrize("save_every, crash_after", [(4, 4), (3, 7)], ids=["last-batch-of-epoch", "mid-epoch"])
def test_resume_from_a_mid_epoch_checkpoint_file_is_bitwise(tmp_path, save_every, crash_after):
    """At the epoch's last batch the average is already in the model (its evaluation comes next)."""
    folder = dict(project_name="proj", experiment_name="exp", local_model_result_folder_path=str(tmp_path))
    straight_model, crashed_model = model_pair()
    straight_cb = WeightAveraging(mode="swa", update_every=2)
    straight = fit(straight_model, [straight_cb])
    with pytest.raises(Crash):
        fit(crashed_model, [WeightAveraging(mode="swa", update_every=2),
                            ModelIterationCheckpoint(save_every, **folder), CrashAfter(crash_after)])
    (run,) = os.listdir(tmp_path / "proj")
    newest = list_checkpoints(str(tmp_path / "proj" / run / "checkpoint_model"))[-1]
    resumed_model, _ = model_pair()
    resumed_cb = WeightAveraging(mode="swa", update_every=2)
    resumed = train_loop(resumed_model)
    resumed.load_checkpoint(newest)
    resumed.fit(num_epochs=EPOCHS, callbacks=[resumed_cb])
    assert_same_run(straight, resumed, straight_cb, resumed_cb)


def test_a_state_of_another_mode_is_refused():
    tl = fit(MLP(), [WeightAveraging()], num_epochs=1)
    state = tl.checkpoint_state()
    other = train_loop(MLP())
    other.load_checkpoint(state)
    with pytest.raises(ValueError, match="mode 'ema'.*mode='swa'"):
        other.fit(num_epochs=2, callbacks=[WeightAveraging(mode="swa")])


def test_the_callback_pickles_with_its_state_after_training():
    """fit_distributed sends callbacks to its processes: the EMA function (a closure) stays behind, the state goes."""
    averaging = WeightAveraging(decay=0.9)
    fit(MLP(), [averaging], num_epochs=1)
    copied = pickle.loads(pickle.dumps(averaging))
    assert copied.averaged_model is None
    assert_states_equal(averaging.averaged_model.state_dict(), copied.state_dict()["averaged"])


# --- loaders without len ------------------------------------------------------------------------------------------
LOOP_HAS_EPOCH_TRAIN_END = hasattr(AbstractCallback, "on_epoch_train_end")


def test_a_loader_without_len_averages_the_same(caplog, monkeypatch):
    """Its last batch is known only after the loop: the average is in the model for the on_epoch_end callbacks after
    WeightAveraging, and for the loop's own evaluation only with the on_epoch_train_end hook (else a warning)."""
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    model, reference = pair()
    record = RecordAtEpochEnd()
    record.execution_order = 95  # after WeightAveraging
    averaging = WeightAveraging(decay=0.9)
    with caplog.at_level(logging.WARNING, logger="aitoolbox"):
        tl = fit(model, [averaging, record], loader=DataLoader(IterableTensorData(TRAIN), batch_size=8))
    ema = AveragedModel(reference, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    expected = reference_run(reference, ema, loader=DataLoader(IterableTensorData(TRAIN), batch_size=8),
                             update_step=lambda *_: True)
    assert_states_equal(ema.module.state_dict(), averaging.average_module.state_dict())
    assert_states_equal(expected[0][0], record.states[0])
    warnings = [r.getMessage() for r in distinct_records(caplog) if "could not tell the last batch" in r.getMessage()]
    if LOOP_HAS_EPOCH_TRAIN_END:
        assert tl.train_history["val_loss"] == [val_loss for _, val_loss in expected] and warnings == []
    else:
        assert tl.train_history["val_loss"][0] != expected[0][1]  # evaluated before the average was put in
        assert len(warnings) == 1


# --- arguments ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(mode="polyak"), ValueError, "mode must be one of 'ema', 'swa'"),
    (dict(mode="swa", decay=0.9), ValueError, "decay is for mode='ema'"),
    (dict(decay=1.5), ValueError, r"decay must be a number in \[0, 1\]"),
    (dict(start_epoch=-1), ValueError, "start_epoch must be an int >= 0"),
    (dict(start_iteration=1.5), ValueError, "start_iteration must be an int >= 0"),
    (dict(update_every=0), ValueError, "update_every must be an int >= 1"),
    (dict(update_every="batch"), ValueError, "or 'epoch', got 'batch'"),
    (dict(save_average=1), TypeError, "save_average must be True or False"),
    (dict(update_bn=True, use_buffers=True), ValueError, "choose one"),
    (dict(bn_forward_fn=print), ValueError, "given with update_bn=True"),
    (dict(execution_order=100), ValueError, "execution_order must be an int below 100"),
])
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        WeightAveraging(**kwargs)


def test_a_second_weight_averaging_is_refused():
    with pytest.raises(ValueError, match="a TrainLoop takes one WeightAveraging callback"):
        fit(MLP(), [WeightAveraging(), WeightAveraging(mode="swa", eval_with_average=False, save_average=False)])


def test_nothing_averaged_leaves_the_training_weights_with_a_warning(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    model, reference = pair()
    averaging = WeightAveraging(mode="swa", start_epoch=5)
    with caplog.at_level(logging.WARNING, logger="aitoolbox"):
        tl = fit(model, [averaging])
    assert averaging.num_averaged == 0 and not averaging.average_in_model
    assert_states_equal(reference_weights(reference), tl.model.state_dict())
    assert any("averaged no weights" in r.getMessage() for r in distinct_records(caplog))


# The CPU processes are forked, which CUDA initialised in this process forbids, and a TrainLoop initialises it
# on a machine with a GPU. There, run these tests with CUDA_VISIBLE_DEVICES="".
cpu_processes_only = pytest.mark.skipif(torch.cuda.is_available(), reason="forked CPU processes: run with "
                                        'CUDA_VISIBLE_DEVICES="" on a machine with a GPU')


# --- distributed ----------------------------------------------------------------------------------------------------
class RecordAverage(AbstractCallback):
    """At train end in every rank (after WeightAveraging): the averaged module, the model, the validation loss."""

    def __init__(self, folder):
        super().__init__("record average", execution_order=95)
        self.folder = str(folder)
        os.makedirs(self.folder, exist_ok=True)

    def on_train_end(self):
        tl = self.train_loop_obj
        (averaging,) = [cb for cb in tl.callbacks if isinstance(cb, WeightAveraging)]
        record = {"average": copy.deepcopy(averaging.average_module.state_dict()),
                  "model": copy.deepcopy(tl.model.state_dict()), "num_averaged": averaging.num_averaged,
                  "history": tl.train_history.get_train_history_dict()}
        torch.save(record, os.path.join(self.folder, f"rank{torch.distributed.get_rank()}.pt"))


def fit_two_processes(tl: TrainLoop, callbacks, sync_bn: bool, num_epochs: int = 3) -> None:
    with pytest.warns(UserWarning, match="CUDA is not available"):
        tl.fit_distributed(num_epochs=num_epochs, callbacks=callbacks, train_data_shuffle=False, num_gpus=2,
                           start_method="fork", sync_bn=sync_bn, on_gpu=False)


@cpu_processes_only
@pytest.mark.parametrize("options, sync_bn", [
    (dict(mode="ema", decay=0.8), False), (dict(mode="swa", update_bn=True), False),
    (dict(mode="swa", update_bn=True), True)], ids=["ema", "swa-update-bn", "swa-update-bn-sync-bn"])
def test_two_ddp_processes_hold_the_same_average(tmp_path, options, sync_bn):
    """Each rank averages its replica. Its BatchNorm statistics come from its own batches: the average takes rank
    0's, and update_bn's are averaged over the ranks. With SyncBatchNorm the run is one process on the global batch
    (equal up to the rounding of the all-reduce)."""
    initial = make_model(BatchNormRegressor)
    tl = make_train_loop(copy.deepcopy(initial), batch_size=4)
    fit_two_processes(tl, [WeightAveraging(**options), RecordAverage(tmp_path)], sync_bn)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    assert_states_equal(ranks[0]["average"], ranks[1]["average"])
    assert_states_equal(ranks[0]["average"], ranks[0]["model"])  # save_average
    assert_states_equal(ranks[0]["model"], tl.model.state_dict())  # the parent adopts rank 0's model
    assert ranks[0]["history"]["val_loss"] == ranks[1]["history"]["val_loss"]
    assert ranks[0]["num_averaged"] == (12 if options["mode"] == "ema" else 3)
    if options.get("update_bn") and not sync_bn:
        # The ranks' halves of each global batch have equal sizes: the mean over the ranks of their statistics'
        # running means is update_bn's over the global batches (DistributedSampler interleaves the samples).
        by_hand = make_model(BatchNormRegressor)
        by_hand.load_state_dict(ranks[0]["average"])
        update_bn(DataLoader(regression_data(32), batch_size=8), by_hand)
        torch.testing.assert_close(ranks[0]["average"]["norm.running_mean"], by_hand.norm.running_mean,
                                   rtol=0, atol=1e-6)
    if not sync_bn:
        return
    single_cb = WeightAveraging(**options)
    single = make_train_loop(copy.deepcopy(initial), batch_size=8)
    single.fit(num_epochs=3, callbacks=[single_cb])
    expected = single_cb.average_module.state_dict()
    for name, value in ranks[0]["average"].items():
        torch.testing.assert_close(value, expected[name].cpu(), rtol=0, atol=1e-5)
    assert ranks[0]["history"]["val_loss"] == pytest.approx(single.train_history["val_loss"], abs=1e-5)


@cpu_processes_only
def test_two_ddp_processes_resume_bitwise_from_an_epoch_checkpoint(tmp_path):
    """Averaged buffers too (use_buffers): each rank's, taken from rank 0 at every epoch end."""
    initial = make_model(BatchNormRegressor)
    options = dict(mode="ema", decay=0.8, use_buffers=True)
    straight = make_train_loop(copy.deepcopy(initial), batch_size=4)
    fit_two_processes(straight, [WeightAveraging(**options), RecordAverage(tmp_path / "straight")], False, 3)
    stopped = make_train_loop(copy.deepcopy(initial), batch_size=4)
    fit_two_processes(stopped, [WeightAveraging(**options), ModelCheckpoint("proj", "ddp", str(tmp_path))], False, 2)
    (run,) = os.listdir(tmp_path / "proj")
    resumed = make_train_loop(make_model(BatchNormRegressor, seed=1), batch_size=4)
    resumed.load_checkpoint(list_checkpoints(str(tmp_path / "proj" / run / "checkpoint_model"))[-1])
    fit_two_processes(resumed, [WeightAveraging(**options), RecordAverage(tmp_path / "resumed")], False, 3)
    for rank in (0, 1):
        expected, got = (torch.load(tmp_path / name / f"rank{rank}.pt", weights_only=True)
                         for name in ("straight", "resumed"))
        assert_states_equal(expected["average"], got["average"])
        assert_states_equal(expected["model"], got["model"])
        assert expected["history"] == got["history"]


@cpu_processes_only
def test_fsdp_is_refused(tmp_path):
    tl = make_train_loop(make_model(), gpu_mode="fsdp")
    with pytest.warns(UserWarning, match="CUDA is not available"), \
            pytest.raises(Exception, match="WeightAveraging does not support gpu_mode='fsdp'"):
        tl.fit_distributed(num_epochs=1, callbacks=[WeightAveraging()], num_gpus=2, start_method="fork", on_gpu=False)


