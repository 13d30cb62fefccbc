"""Whole-set evaluation: sample-weighted losses, predictions, caching, and no side effects on training."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.train_loop import TrainLoop
from aitoolbox.torchtrain.train_loop.evaluation import batch_size_of, loader_generators, merge_metadata
from aitoolbox.torchtrain.train_loop.pred_collate_fns import keep_list_transf
from tests.helpers import MLP, EmptyIterableData, classification_data, indexed_classification_data, seeded_loader


def make_loop(model=None, train=None, validation=None, test=None, **kwargs):
    torch.manual_seed(0)
    model = model or MLP()
    train = train or DataLoader(classification_data(10), batch_size=4)
    return TrainLoop(model, train, validation, test, torch.optim.SGD(model.parameters(), lr=0.1),
                     nn.CrossEntropyLoss(), **{"end_auto_eval": False, "show_progress": False, **kwargs})


def exact_mean_loss(model, dataset):
    device = next(model.parameters()).device
    x, y = dataset.tensors[0].to(device), dataset.tensors[1].to(device)
    model.eval()
    with torch.no_grad():
        total = nn.CrossEntropyLoss(reduction="sum")(model(x), y)
    model.train()
    return total.item() / len(dataset)


class CountingMLP(MLP):
    """Counts get_predictions calls and can return a malformed prediction tuple."""

    def __init__(self, bad_output=None):
        super().__init__()
        self.prediction_calls = 0
        self.bad_output = bad_output

    def get_predictions(self, batch_data, device):
        self.prediction_calls += 1
        if self.bad_output is not None:
            return self.bad_output(batch_data)
        return super().get_predictions(batch_data, device)


# --- losses ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["train", "validation", "test"])
def test_loss_is_the_sample_weighted_mean_over_an_uneven_last_batch(which):
    data = classification_data(10)  # batches of 4, 4 and 2 samples
    loader = DataLoader(data, batch_size=4)
    tl = make_loop(train=loader if which == "train" else None,
                   validation=loader if which == "validation" else None,
                   test=loader if which == "test" else None)
    loss = getattr(tl, f"evaluate_loss_on_{which}_set")()
    expected = exact_mean_loss(tl.model, data)
    assert loss == pytest.approx(expected, rel=1e-6)
    # The mean of the batch means weighs the two samples of the last batch double: it must differ.
    with torch.no_grad():
        tl.model.eval()
        batch_means = [nn.CrossEntropyLoss()(tl.model(x.to(tl.device)), y.to(tl.device)).item() for x, y in loader]
        tl.model.train()
    assert sum(batch_means) / len(batch_means) != pytest.approx(expected, rel=1e-4)


def test_evaluation_uses_get_loss_eval():
    class EvalLossModel(MLP):
        def get_loss_eval(self, batch_data, criterion, device):
            return 2 * self.get_loss(batch_data, criterion, device)

    plain = make_loop()
    model = EvalLossModel()
    model.load_state_dict(plain.model.state_dict())
    tl = make_loop(model=model)
    assert tl.evaluate_loss_on_train_set(float_dict_format=True) == pytest.approx(
        2 * plain.evaluate_loss_on_train_set(float_dict_format=True), rel=1e-6)


@pytest.mark.parametrize("start_in_train_mode", [True, False])
def test_evaluation_restores_mode_and_leaves_no_gradients(start_in_train_mode):
    tl = make_loop(validation=DataLoader(classification_data(7), batch_size=3))
    tl.model.train(start_in_train_mode)
    tl.evaluate_loss_on_train_set()
    tl.predict_on_validation_set()
    assert tl.model.training is start_in_train_mode
    assert all(p.grad is None for p in tl.model.parameters())


def test_evaluation_runs_in_eval_mode_without_grad():
    seen = []

    class Spy(MLP):
        def get_loss(self, batch_data, criterion, device):
            seen.append((self.training, torch.is_grad_enabled()))
            return super().get_loss(batch_data, criterion, device)

    tl = make_loop(model=Spy())
    tl.evaluate_loss_on_train_set()
    assert seen and all(entry == (False, False) for entry in seen)


def test_evaluation_leaves_global_and_loader_random_state_unchanged():
    train = seeded_loader(classification_data(10), batch_size=4)
    validation = DataLoader(classification_data(10), batch_size=4, shuffle=True)  # draws from the global RNG
    tl = make_loop(train=train, validation=validation)
    assert loader_generators(train) == [train.generator]
    global_state, loader_state = torch.get_rng_state(), train.generator.get_state()
    tl.evaluate_loss_on_train_set()
    tl.evaluate_loss_on_validation_set()
    tl.predict_on_train_set()
    tl.predict_on_validation_set()
    assert torch.equal(torch.get_rng_state(), global_state)
    assert torch.equal(train.generator.get_state(), loader_state)


def test_loader_generators_finds_a_samplers_own_generator():
    data = classification_data(10)
    generator = torch.Generator().manual_seed(3)
    loader = DataLoader(data, batch_size=4, sampler=torch.utils.data.RandomSampler(data, generator=generator))
    assert loader_generators(loader) == [generator]
    assert loader_generators(DataLoader(data, batch_size=4)) == []
    assert loader_generators([torch.zeros(2)]) == []  # any iterable of batches


@pytest.mark.parametrize("which", ["validation", "test"])
def test_missing_loader_is_a_clear_error(which):
    tl = make_loop()
    with pytest.raises(ValueError, match=f"no {which}_loader"):
        getattr(tl, f"evaluate_loss_on_{which}_set")()
    with pytest.raises(ValueError, match=f"no {which}_loader"):
        getattr(tl, f"predict_on_{which}_set")()


def test_evaluating_an_empty_loader_is_a_clear_error():
    tl = make_loop(validation=DataLoader(EmptyIterableData(), batch_size=4))
    with pytest.raises(ValueError, match="yielded no batches"):
        tl.evaluate_loss_on_validation_set()


def test_an_unsized_validation_set_found_empty_at_the_epoch_end_says_what_to_do_and_fit_continues():
    """Review of issue 34, C4: a named validation set over an IterableDataset that yields nothing can only be
    found empty at the first epoch's end; the error names the set and the way on, and the run continues."""
    tl = make_loop(validation={"main": DataLoader(classification_data(8, seed=3), batch_size=4),
                               "other": DataLoader(EmptyIterableData(), batch_size=4)}, end_auto_eval=True)
    with pytest.raises(ValueError, match=r"validation:other: its data loader yielded no batches.*tl.validation_loader"):
        tl.fit(num_epochs=2)
    tl.validation_loader = {"main": DataLoader(classification_data(8, seed=3), batch_size=4),
                            "other": DataLoader(classification_data(8, seed=4), batch_size=4)}
    tl.fit(num_epochs=2)
    assert tl.epochs_completed == 2 and len(tl.train_history["val_other_loss"]) == 2


def test_evaluation_checks_the_loss_type():
    class FloatEvalLoss(MLP):
        def get_loss_eval(self, batch_data, criterion, device):
            return 0.5

    tl = make_loop(model=FloatEvalLoss())
    with pytest.raises(TypeError, match="get_loss_eval must return the loss as a torch.Tensor"):
        tl.evaluate_loss_on_train_set()


@pytest.mark.parametrize("batch, expected", [
    (torch.zeros(5, 3), 5),
    (torch.tensor(1.0), 1),
    ((torch.zeros(4, 2), torch.zeros(4)), 4),
    ([["text"], (torch.zeros(3, 1),)], 3),
    ({"x": torch.zeros(6, 2), "y": torch.zeros(6)}, 6),
    (("no", "tensors"), None),
])
def test_batch_size_of(batch, expected):
    assert batch_size_of(batch) == expected


# --- predictions -------------------------------------------------------------------------------------------
def test_predictions_are_concatenated_in_loader_order():
    data = classification_data(10)
    tl = make_loop(test=DataLoader(data, batch_size=4))
    y_pred, y_true, metadata = tl.predict_on_test_set()
    tl.model.eval()
    with torch.no_grad():
        expected = tl.model(data.tensors[0].to(tl.device)).argmax(dim=1).cpu()
    assert torch.equal(y_pred, expected)
    assert torch.equal(y_true, data.tensors[1])
    assert metadata is None


def test_metadata_dicts_are_merged_across_batches():
    data = indexed_classification_data(11)
    tl = make_loop(validation=DataLoader(data, batch_size=4, shuffle=True))
    y_pred, y_true, metadata = tl.predict_on_validation_set()
    assert set(metadata) == {"index"}
    assert sorted(metadata["index"]) == list(range(11))
    assert torch.equal(y_true, data.tensors[1][metadata["index"]])  # metadata follows the shuffled order


def test_merge_metadata():
    collected = merge_metadata({"id": [1, 2], "t": torch.tensor([0.5, 1.5])}, None)
    collected = merge_metadata({"id": [3], "t": torch.tensor([2.5])}, collected)
    collected = merge_metadata(None, collected)
    assert collected == {"id": [1, 2, 3], "t": [0.5, 1.5, 2.5]}
    assert merge_metadata(None, None) is None
    with pytest.raises(TypeError, match="metadata as a dict"):
        merge_metadata(["not", "a", "dict"], None)


def test_predictions_are_cached_within_an_iteration():
    model = CountingMLP()
    tl = make_loop(model=model, validation=DataLoader(classification_data(10), batch_size=4))
    first = tl.predict_on_validation_set()
    second = tl.predict_on_validation_set()
    assert model.prediction_calls == 3  # one pass over 3 batches
    assert second is first
    tl.fit(num_iterations=1)  # the weights change: the next request recomputes
    tl.predict_on_validation_set()
    assert model.prediction_calls == 6


def test_each_data_set_is_cached_separately():
    model = CountingMLP()
    tl = make_loop(model=model, validation=DataLoader(classification_data(10), batch_size=4),
                   test=DataLoader(classification_data(5), batch_size=4))
    validation = tl.predict_on_validation_set()
    test = tl.predict_on_test_set()
    train = tl.predict_on_train_set()
    assert model.prediction_calls == 3 + 2 + 3
    assert tl.predict_on_validation_set() is validation and tl.predict_on_test_set() is test
    assert tl.predict_on_train_set() is train
    assert model.prediction_calls == 8
    assert len(validation[0]) == 10 and len(test[0]) == 5


def test_predictions_cached_during_training_are_shared_by_callbacks():
    from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback

    class AskForPredictions(AbstractCallback):
        def __init__(self):
            super().__init__("ask")
            self.results = []

        def on_epoch_end(self):
            self.results.append(self.train_loop_obj.predict_on_validation_set())

    model = CountingMLP()
    tl = make_loop(model=model, validation=DataLoader(classification_data(10), batch_size=4))
    first, second = AskForPredictions(), AskForPredictions()
    tl.fit(num_epochs=2, callbacks=[first, second])
    assert model.prediction_calls == 2 * 3  # one pass per epoch, shared by both callbacks
    assert first.results[0] is second.results[0]
    assert first.results[1] is not first.results[0]


@pytest.mark.parametrize("bad_output, message", [
    (lambda batch: (batch[1], batch[1]), "of length 2"),
    (lambda batch: (batch[1], batch[1], None, None), "of length 4"),
    (lambda batch: batch[1], "got Tensor"),
])
def test_malformed_predictions_are_a_clear_error(bad_output, message):
    tl = make_loop(model=CountingMLP(bad_output), test=DataLoader(classification_data(10), batch_size=4))
    with pytest.raises(ValueError,
                       match=rf"get_predictions must return a tuple \(y_pred, y_true, metadata\).*{message}"):
        tl.predict_on_test_set()


def test_custom_collate_and_transform_functions():
    tl = make_loop(test=DataLoader(classification_data(10), batch_size=4), pred_transform_fn=keep_list_transf)
    y_pred, y_true, _ = tl.predict_on_test_set()
    assert [len(batch) for batch in y_pred] == [4, 4, 2]
    assert [len(batch) for batch in y_true] == [4, 4, 2]
