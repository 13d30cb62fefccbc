"""Several validation sets (``validation_loader={'in_domain': dl1, 'shifted': dl2}``) against hand evaluation.

Each set's ``val_<name>_loss`` equals a hand-written evaluation loop over that loader with the same weights
(bitwise: the same float64 sample-weighted sum), metrics per set equal sklearn's, the first set fills the plain
names, EarlyStopping and checkpoint ranking follow the set they monitor, a two-process run equals one process,
a run resumed from a checkpoint equals the straight run, and bad input is refused at construction.

The data: the model trains on ``train``; ``in_domain`` is part of the training data (its loss falls), ``shifted`` is
the same inputs with every label moved to the next class (its loss falls for two epochs, then rises), so a
callback that follows one set acts differently from one that follows the other.
"""
import copy
import os
import re

import pytest
import torch
from sklearn import metrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aitoolbox.experiment.local_save.checkpoints import list_checkpoints
from aitoolbox.experiment.result_package.basic_packages import ClassificationResultPackage
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.basic import DataSubsetTestRun
from aitoolbox.torchtrain.callbacks.model_save import ModelCheckpoint, ModelTrainEndSave
from aitoolbox.torchtrain.callbacks.performance_eval import ModelPerformanceEvaluation, ModelPerformancePrintReport
from aitoolbox.torchtrain.callbacks.stopping import EarlyStopping
from aitoolbox.torchtrain.multi_loss_optim import MultiLoss
from aitoolbox.torchtrain.train_loop import TrainLoop, TrainLoopCheckpoint
from tests.helpers import MLP, classification_data, single_torch_thread

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")

TRAIN = classification_data(24)
X, Y = TRAIN.tensors
IN_DOMAIN = TensorDataset(X[:7], Y[:7])
SHIFTED = TensorDataset(X[:5], (Y[:5] + 1) % 3)


def validation_sets(batch_sizes=(2, 2)) -> dict:
    return {"in_domain": DataLoader(IN_DOMAIN, batch_size=batch_sizes[0]),
            "shifted": DataLoader(SHIFTED, batch_size=batch_sizes[1])}


def make_loop(validation=None, model=None, lr=0.5, loop_class=TrainLoop, loop_args=(), **kwargs):
    torch.manual_seed(0)
    model = model if model is not None else MLP(dropout=0.0)
    validation = validation_sets() if validation is None else validation
    return loop_class(model, DataLoader(TRAIN, batch_size=8), validation, None,
                      torch.optim.SGD(model.parameters(), lr=lr), nn.CrossEntropyLoss(), *loop_args,
                      show_progress=False, **kwargs)


class WeightsAtEpochEnd(AbstractCallback):
    """Copies of the weights at every epoch end (after the loop's own evaluation, before any later step)."""

    def __init__(self):
        super().__init__("weights at epoch end")
        self.states = []

    def on_epoch_end(self):
        self.states.append(copy.deepcopy(self.train_loop_obj.model.state_dict()))


def hand_loss(model, loader, loss_of=None) -> torch.Tensor:
    """The per-sample mean loss, as a hand-written loop computes it: batch means weighted by batch size, in
    float64, summed in batch order; one value per loss for a model returning several (``loss_of``)."""
    loss_of = loss_of or (lambda x, y: nn.CrossEntropyLoss()(model(x), y))
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    count = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for x, y in loader:
            total = total + loss_of(x, y).double() * len(x)
            count += len(x)
    model.train()
    return total / count


def hand_predictions(model, dataset):
    model.eval()
    with torch.no_grad():
        predicted = model(dataset.tensors[0]).argmax(dim=1)
    model.train()
    return predicted


def model_with(state) -> MLP:
    model = MLP(dropout=0.0)
    model.load_state_dict(state)
    return model


# --- losses ------------------------------------------------------------------------------------------------------
def test_each_set_is_recorded_as_evaluated_by_hand_and_the_first_fills_val_loss():
    weights = WeightsAtEpochEnd()
    tl = make_loop()
    tl.fit(num_epochs=3, callbacks=[weights])
    history = tl.train_history
    assert tl.validation_set_names == ["in_domain", "shifted"]
    for epoch, state in enumerate(weights.states):
        model = model_with(state)
        for name in ("in_domain", "shifted"):
            # Bitwise: the same float64 arithmetic over the same batches.
            assert history[f"val_{name}_loss"][epoch] == hand_loss(model, tl.validation_loader[name]).item(), \
                (name, epoch)
    assert history["val_loss"] == history["val_in_domain_loss"]
    assert history["val_loss"] != history["val_shifted_loss"]
    # The 1.x methods: the first set by default, another by name=.
    assert tl.evaluate_loss_on_validation_set(float_dict_format=True) == history["val_in_domain_loss"][-1]
    assert tl.evaluate_loss_on_validation_set(float_dict_format=True, name="shifted") == history["val_shifted_loss"][-1]
    y_pred, y_true, _ = tl.predict_on_validation_set(name="shifted")
    assert torch.equal(y_true, SHIFTED.tensors[1]) and torch.equal(y_pred, hand_predictions(tl.model, SHIFTED))
    y_pred, y_true, _ = tl.predict_on_validation_set()
    assert torch.equal(y_true, IN_DOMAIN.tensors[1])


def test_a_single_loader_records_exactly_the_keys_it_did_before():
    tl = make_loop(validation=DataLoader(IN_DOMAIN, batch_size=2))
    tl.fit(num_epochs=2)
    assert list(tl.train_history) == ["loss", "accumulated_loss", "val_loss"]
    assert tl.validation_set_names is None
    dict_run = make_loop(validation={"only": DataLoader(IN_DOMAIN, batch_size=2)})
    dict_run.fit(num_epochs=2)
    assert dict_run.train_history["val_loss"] == dict_run.train_history["val_only_loss"] == tl.train_history["val_loss"]


class TwoLossMLP(MLP):
    def get_loss(self, batch_data, criterion, device):
        x, y = batch_data
        logits = self(x)
        return MultiLoss({"ce": criterion(logits, y), "margin": logits.pow(2).mean()})


def test_a_multi_loss_is_recorded_per_set_and_per_loss():
    weights = WeightsAtEpochEnd()
    torch.manual_seed(0)
    tl = make_loop(model=TwoLossMLP(dropout=0.0))
    tl.fit(num_epochs=1, callbacks=[weights])
    model = TwoLossMLP(dropout=0.0)
    model.load_state_dict(weights.states[0])
    for name in ("in_domain", "shifted"):
        for index, loss_name in enumerate(["ce", "margin"]):  # sorted names, as the loop records them
            def loss_of(x, y, index=index):
                return torch.stack([nn.CrossEntropyLoss()(model(x), y), model(x).pow(2).mean()])[index]
            expected = hand_loss(model, tl.validation_loader[name], loss_of).item()
            assert tl.train_history[f"val_{name}_loss_{loss_name}"] == [expected]
    assert tl.train_history["val_loss_ce"] == tl.train_history["val_in_domain_loss_ce"]
    assert tl.train_history["val_loss_margin"] == tl.train_history["val_in_domain_loss_margin"]


def test_end_auto_eval_every_n_epochs_evaluates_every_set_and_early_stopping_waits():
    tl = make_loop(end_auto_eval=2)
    tl.fit(num_epochs=4, callbacks=[EarlyStopping(monitor="val_shifted_loss", patience=5)])
    assert len(tl.train_history["val_shifted_loss"]) == len(tl.train_history["val_in_domain_loss"]) == 2


# --- metrics -----------------------------------------------------------------------------------------------------
def test_metrics_per_set_equal_sklearn_and_the_first_fills_the_plain_names():
    weights = WeightsAtEpochEnd()
    evaluation = ModelPerformanceEvaluation(ClassificationResultPackage())
    report = ModelPerformancePrintReport(["val_Accuracy", "val_shifted_Accuracy"])
    tl = make_loop()
    tl.fit(num_epochs=3, callbacks=[evaluation, report, weights])
    history = tl.train_history
    for epoch, state in enumerate(weights.states):
        model = model_with(state)
        for name, dataset in (("in_domain", IN_DOMAIN), ("shifted", SHIFTED)):
            expected = metrics.accuracy_score(dataset.tensors[1].numpy(), hand_predictions(model, dataset).numpy())
            assert history[f"val_{name}_Accuracy"][epoch] == expected, (name, epoch)
    assert history["val_Accuracy"] == history["val_in_domain_Accuracy"]
    final = hand_predictions(tl.model, SHIFTED)
    assert history["train_end_val_shifted_Accuracy"] == [metrics.accuracy_score(SHIFTED.tensors[1], final)]
    assert history["train_end_val_Accuracy"] == history["train_end_val_in_domain_Accuracy"]
    # 1.x code reads result_package: the first set's results; each set has its own package.
    assert evaluation.result_package is evaluation.val_result_packages["in_domain"]
    assert evaluation.val_result_packages["shifted"] is not evaluation.result_package
    assert evaluation.result_package.get_results()["Accuracy"] == history["train_end_val_in_domain_Accuracy"][-1]


def test_train_end_save_evaluates_every_set(tmp_path):
    save = ModelTrainEndSave("proj", "exp", str(tmp_path), {}, val_result_package=ClassificationResultPackage())
    tl = make_loop()
    tl.fit(num_epochs=1, callbacks=[save])
    for key, dataset in (("validation", IN_DOMAIN), ("validation_in_domain", IN_DOMAIN),
                         ("validation_shifted", SHIFTED)):
        expected = metrics.accuracy_score(dataset.tensors[1], hand_predictions(tl.model, dataset))
        assert save.results[key]["Accuracy"] == expected, key


def test_predictions_tell_the_callbacks_which_set():
    class Seen(AbstractCallback):
        def __init__(self):
            super().__init__("seen")
            self.infos = []

        def on_after_batch_prediction(self, y_pred, y_true, metadata, dataset_info):
            self.infos.append(dict(dataset_info))

    seen = Seen()
    tl = make_loop()
    tl.callbacks_handler.register_callbacks([seen])
    tl.predict_on_validation_set(execute_callbacks=True, name="shifted")
    assert seen.infos == [{"type": "validation", "name": "shifted"}] * 3  # 5 samples in batches of 2


def test_data_subset_test_run_cuts_every_set():
    tl = make_loop()
    tl.fit(num_epochs=1, callbacks=[DataSubsetTestRun(num_train_batches=1, num_val_batches=1)])
    assert [len(loader) for loader in tl.validation_loader.values()] == [1, 1]
    assert len(tl.train_history["val_shifted_loss"]) == 1


# --- following one set: EarlyStopping and checkpoint ranking -----------------------------------------------------
def first_rise(values) -> int:
    return next(epoch for epoch in range(1, len(values)) if values[epoch] > values[epoch - 1])


@pytest.fixture(scope="module")
def unmonitored_history():
    tl = make_loop()
    tl.fit(num_epochs=6)
    history = tl.train_history
    # The premise: the first set's loss keeps falling while the second set's rises after a while.
    assert all(later < earlier for earlier, later in zip(history["val_loss"], history["val_loss"][1:]))
    assert 1 < first_rise(history["val_shifted_loss"]) < 5
    return history.get_train_history_dict()


def test_early_stopping_follows_the_set_it_monitors(unmonitored_history):
    on_shifted = make_loop()
    on_shifted.fit(num_epochs=6, callbacks=[EarlyStopping(monitor="val_shifted_loss")])
    stop_epoch = first_rise(unmonitored_history["val_shifted_loss"])
    assert on_shifted.epochs_completed == stop_epoch + 1
    assert on_shifted.train_history["val_shifted_loss"] == unmonitored_history["val_shifted_loss"][:stop_epoch + 1]
    on_first = make_loop()
    on_first.fit(num_epochs=6, callbacks=[EarlyStopping(monitor="val_loss")])
    assert on_first.epochs_completed == 6


def kept_epochs(root) -> list:
    (run,) = os.listdir(os.path.join(root, "proj"))
    paths = list_checkpoints(os.path.join(root, "proj", run, "checkpoint_model"))
    return [int(re.search(r"_E(\d+)\.pth$", path).group(1)) for path in paths]


@pytest.mark.parametrize("metric", ["val_shifted_loss", "val_in_domain_loss", "val_loss"])
def test_checkpoints_are_ranked_by_the_monitored_set(tmp_path, unmonitored_history, metric):
    tl = make_loop()
    tl.fit(num_epochs=6, callbacks=[ModelCheckpoint("proj", "exp", str(tmp_path), rm_subopt_local_models=metric,
                                                    num_best_checkpoints_kept=1)])
    values = unmonitored_history[metric]
    best = min(range(6), key=values.__getitem__)
    assert kept_epochs(str(tmp_path)) == sorted({best, 5})  # the best, and the newest for resuming
    if metric == "val_shifted_loss":
        assert best < 5


@pytest.mark.parametrize("monitoring", ["EarlyStopping", "ModelCheckpoint"])
def test_monitoring_a_name_that_does_not_exist_lists_the_recorded_names_and_sets(tmp_path, monitoring):
    if monitoring == "EarlyStopping":
        callback, message = EarlyStopping(monitor="val_shift_loss"), "'val_shift_loss' is not in train_history"
    else:
        callback = ModelCheckpoint("proj", "exp", str(tmp_path), rm_subopt_local_models="val_shift_loss")
        message = "ranks checkpoints by 'val_shift_loss', which is not in the training history"
    with pytest.raises(ValueError) as error:
        make_loop().fit(num_epochs=1, callbacks=[callback])
    text = str(error.value)
    assert message in text and "val_shifted_loss" in text and "val_in_domain_loss" in text
    assert "['in_domain', 'shifted']" in text


# --- resume ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["load_checkpoint", "auto_resume"])
def test_resume_from_a_checkpoint_with_several_sets_equals_the_straight_run(tmp_path, how):
    straight = make_loop()
    straight.fit(num_epochs=3, callbacks=[ModelPerformanceEvaluation(ClassificationResultPackage()),
                                          EarlyStopping(monitor="val_shifted_loss", patience=5)])
    first = make_loop(loop_class=TrainLoopCheckpoint, loop_args=("proj", "exp", str(tmp_path), {}))
    first.fit(num_epochs=2, callbacks=[ModelPerformanceEvaluation(ClassificationResultPackage()),
                                       EarlyStopping(monitor="val_shifted_loss", patience=5)])
    if how == "auto_resume":
        resumed = make_loop(loop_class=TrainLoopCheckpoint, loop_args=("proj", "exp", str(tmp_path), {}),
                            auto_resume=True)
    else:
        resumed = make_loop()
        resumed.load_checkpoint(first.experiment_folder.path)
    weights = WeightsAtEpochEnd()
    resumed.fit(num_epochs=3, callbacks=[ModelPerformanceEvaluation(ClassificationResultPackage()),
                                         EarlyStopping(monitor="val_shifted_loss", patience=5), weights])
    assert len(weights.states) == 1  # it continued: one epoch trained here
    for key, value in straight.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[key]), key
    assert resumed.train_history.get_train_history_dict() == straight.train_history.get_train_history_dict()
    assert len(resumed.train_history["val_shifted_Accuracy"]) == 3


# --- torch.compile -----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_compiled_model_evaluates_every_set_as_the_eager_one():
    """Sets of other batch sizes than training (2 and 3 against 8) go through the compiled forward too."""
    sets = (2, 3)
    eager = make_loop(validation=validation_sets(sets))
    eager.fit(num_epochs=2)
    compiled = make_loop(validation=validation_sets(sets), torch_compile={"backend": "aot_eager"})
    compiled.fit(num_epochs=2)
    for name in ("val_loss", "val_in_domain_loss", "val_shifted_loss"):
        assert compiled.train_history[name] == pytest.approx(eager.train_history[name], rel=1e-6, abs=0), name
    assert compiled.compile_stats.compiles > 0


# --- distributed -------------------------------------------------------------------------------------------------
def uneven_sets() -> dict:
    """7 and 5 samples over 2 ranks: 3 + 4 and 2 + 3 samples. Batches of 1, and of 3: one process evaluates
    [0, 1, 2] [3, 4], the two ranks [0, 1] and [2, 3, 4]."""
    return {"seven": DataLoader(IN_DOMAIN, batch_size=1), "five": DataLoader(SHIFTED, batch_size=3)}


class RecordSetPredictions(AbstractCallback):
    """In every rank at the end of training: each set's gathered predictions, saved to ``<folder>/rank<r>.pt``."""

    def __init__(self, folder: str):
        super().__init__("record set predictions")
        self.folder = folder

    def on_train_end(self):
        tl = self.train_loop_obj
        record = {name: tl.predict_on_validation_set(name=name)[:2] for name in tl.validation_set_names}
        torch.save(record, os.path.join(self.folder, f"rank{tl.strategy.rank}.pt"))


@pytest.mark.filterwarnings("ignore:CUDA is not available")
@pytest.mark.parametrize("start_method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_two_processes_evaluate_every_set_exactly_as_one_process(tmp_path, start_method):
    """lr=0 keeps the weights as they start, so both runs evaluate the same weights. Batches of one sample: every
    sample's loss is computed alone in both runs and the float64 sums are exact, so the values are equal bitwise.
    Batches of three: the ranks group the samples differently, and the float32 batch means round differently:
    equal to 1e-6. Spawned processes get the loop pickled, loaders dict included, and
    prepare each set's share of the data themselves."""
    callbacks = [ModelPerformanceEvaluation(ClassificationResultPackage())]
    single = make_loop(validation=uneven_sets(), lr=0.0)
    single.fit(num_epochs=1, callbacks=copy.deepcopy(callbacks))
    distributed = make_loop(validation=uneven_sets(), lr=0.0, gpu_mode="ddp")
    distributed.fit_distributed(num_epochs=1, num_gpus=2, start_method=start_method,
                                callbacks=copy.deepcopy(callbacks) + [RecordSetPredictions(str(tmp_path))])
    got, expected = distributed.train_history, single.train_history
    assert got["val_seven_loss"] == expected["val_seven_loss"] == got["val_loss"]
    assert got["val_five_loss"] == pytest.approx(expected["val_five_loss"], rel=1e-6, abs=0)
    assert got["val_five_loss"] != got["val_seven_loss"]
    for name in ("val_seven_Accuracy", "val_five_Accuracy", "val_Accuracy", "train_end_val_five_Accuracy"):
        assert got[name] == expected[name], name
    # Every sample once, in order, on every rank: no padding duplicate (7 and 5 are odd), no set evaluated whole twice.
    for rank in range(2):
        record = torch.load(os.path.join(str(tmp_path), f"rank{rank}.pt"), weights_only=True)
        for name, dataset in (("seven", IN_DOMAIN), ("five", SHIFTED)):
            y_pred, y_true = record[name]
            assert torch.equal(y_true, dataset.tensors[1]), (rank, name)
            assert torch.equal(y_pred, hand_predictions(distributed.model, dataset)), (rank, name)


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_a_set_that_cannot_be_pickled_is_named_before_any_process_starts():
    sets = {"fine": DataLoader(IN_DOMAIN), "broken": DataLoader(SHIFTED, collate_fn=lambda batch: batch)}
    tl = make_loop(validation=sets, gpu_mode="ddp")
    with pytest.raises(TypeError, match=r"the validation_loader\['broken'\] cannot be pickled.*lambda"):
        tl.fit_distributed(num_epochs=1, num_gpus=2, start_method="spawn")


# --- bad input ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("validation, error, message", [
    ({}, ValueError, "validation_loader is an empty dict"),
    ({1: DataLoader(IN_DOMAIN)}, TypeError, "keys must be strings .*the key 1 of type int"),
    ({"a/b": DataLoader(IN_DOMAIN)}, ValueError, "validation set name 'a/b' cannot name history keys"),
    ({"a b": DataLoader(IN_DOMAIN)}, ValueError, "validation set name 'a b' cannot name history keys"),
    ({"": DataLoader(IN_DOMAIN)}, ValueError, "validation set name '' cannot name history keys"),
    ({"_x": DataLoader(IN_DOMAIN)}, ValueError, "starts with a letter or digit"),
    ({"loss": DataLoader(IN_DOMAIN)}, ValueError, "read as the loss entries of the plain val_loss"),
    ({"loss_b": DataLoader(IN_DOMAIN)}, ValueError, "does not start with 'loss'"),
    ({"Shifted": DataLoader(IN_DOMAIN), "shifted": DataLoader(SHIFTED)}, ValueError, "differ only in case"),
    ({"a": None}, TypeError, r"validation_loader\['a'\] is None"),
    ({"a": IN_DOMAIN}, TypeError, r"validation_loader\['a'\] must be .*DataLoader.*looks like a Dataset"),
    ({"a": {"b": DataLoader(IN_DOMAIN)}}, TypeError, "Nested dicts are not supported"),
    ({"a": "loader"}, TypeError, r"validation_loader\['a'\] must be an iterable of batches"),
    ({"a": 3}, TypeError, r"validation_loader\['a'\] must be an iterable of batches .*got int"),
])
def test_bad_validation_sets_are_refused_at_construction(validation, error, message):
    with pytest.raises(error, match=message):
        make_loop(validation=validation)


def test_an_empty_named_set_is_refused_at_construction():
    """Issue 34, item 7: it used to pass construction and fail after the first epoch's training."""
    empty = DataLoader(IN_DOMAIN, batch_size=len(IN_DOMAIN) + 1, drop_last=True)
    assert len(empty) == 0
    with pytest.raises(ValueError, match=r"validation_loader\['shifted'\] is empty \(len 0\)"):
        make_loop(validation={"in_domain": DataLoader(IN_DOMAIN), "shifted": empty})
    with pytest.raises(ValueError, match=r"validation_loader is empty \(len 0\)"):
        make_loop(validation=empty)


def test_a_list_of_loaders_is_refused_at_construction_with_the_dict_to_write():
    """A Lightning habit: it used to train an epoch and then fail inside get_loss ('DataLoader' object is not
    subscriptable)."""
    with pytest.raises(TypeError, match=r"validation_loader is a list of 2 DataLoaders.*name each set: "
                                        r"validation_loader=\{'set_0': \.\.\., 'set_1': \.\.\.\}"):
        make_loop(validation=[DataLoader(IN_DOMAIN), DataLoader(SHIFTED)])
    tl = make_loop()
    with pytest.raises(TypeError, match="a tuple of 1 DataLoader: "):
        tl.validation_loader = (DataLoader(SHIFTED),)
    assert tl.validation_set_names == ["in_domain", "shifted"]


def test_a_bad_dict_assigned_later_is_refused_and_the_loader_kept():
    tl = make_loop()
    with pytest.raises(ValueError, match="empty dict"):
        tl.validation_loader = {}
    assert tl.validation_set_names == ["in_domain", "shifted"]


def test_names_that_do_not_exist_or_do_not_apply_are_errors():
    tl = make_loop()
    with pytest.raises(ValueError, match=r"no validation set named 'other'; the validation sets are \['in_domain', "
                                         r"'shifted'\]"):
        tl.evaluate_loss_on_validation_set(name="other")
    with pytest.raises(ValueError, match="no validation set named 'other'"):
        tl.predict_on_validation_set(name="other")
    single = make_loop(validation=DataLoader(IN_DOMAIN))
    with pytest.raises(ValueError, match="validation_loader is a single loader"):
        single.evaluate_loss_on_validation_set(name="in_domain")
