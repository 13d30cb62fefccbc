"""TTModel, TTBasicModel, ModelWrap and the adapter the loop uses for ModelWrap."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aitoolbox.torchtrain.data.batch_model_feed_defs import AbstractModelFeedDefinition
from aitoolbox.torchtrain.model import (
    FeedDefinitionModel, ModelWrap, MultiGPUModelWrap, TTBasicModel, TTBasicMultiGPUModel, TTModel,
)
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import (
    MLP, ClassifierFeedDefinition, PlainMLP, assert_params_equal, classification_data, reference_fit,
)


class ForwardOnly(TTModel):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 1)

    def forward(self, x):
        return self.fc(x)


class TwoInputRegressor(TTBasicModel):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 1)
        self.b = nn.Linear(2, 1)

    def forward(self, x1, x2):
        return self.a(x1) + self.b(x2)


def two_input_data(num_samples=12):
    generator = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(num_samples, 3, generator=generator),
                         torch.randn(num_samples, 2, generator=generator),
                         torch.randn(num_samples, 1, generator=generator))


# --- TTModel ---------------------------------------------------------------------------------------------
def test_tt_model_is_a_module_whose_methods_must_be_implemented():
    model = ForwardOnly()
    assert isinstance(model, nn.Module)
    with pytest.raises(NotImplementedError,
                       match=r"ForwardOnly must implement get_loss\(batch_data, criterion, device\)"):
        model.get_loss(None, None, torch.device("cpu"))
    with pytest.raises(NotImplementedError, match=r"ForwardOnly must implement get_predictions"):
        model.get_predictions(None, torch.device("cpu"))


def test_get_loss_eval_defaults_to_get_loss():
    torch.manual_seed(0)
    model = MLP().eval()
    x, y = classification_data(5).tensors
    criterion = nn.CrossEntropyLoss()
    assert torch.equal(model.get_loss_eval((x, y), criterion, torch.device("cpu")),
                       model.get_loss((x, y), criterion, torch.device("cpu")))


# --- TTBasicModel --------------------------------------------------------------------------------------------
def test_basic_model_feeds_all_but_the_last_element_as_inputs():
    torch.manual_seed(0)
    model = TwoInputRegressor()
    x1, x2, y = two_input_data().tensors
    cpu = torch.device("cpu")
    expected_output = model(x1, x2)
    assert torch.equal(model.get_loss((x1, x2, y), nn.MSELoss(), cpu), nn.MSELoss()(expected_output, y))
    y_pred, y_true, metadata = model.get_predictions((x1, x2, y), cpu)
    assert torch.equal(y_pred, expected_output) and torch.equal(y_true, y) and metadata == {}


def test_basic_model_trains_like_the_hand_written_loop():
    torch.manual_seed(0)
    model = TwoInputRegressor()
    reference = TwoInputRegressor()
    reference.load_state_dict(model.state_dict())
    data = two_input_data()
    tl = TrainLoop(model, DataLoader(data, batch_size=5), None, None, torch.optim.SGD(model.parameters(), lr=0.05),
                   nn.MSELoss(), end_auto_eval=False, show_progress=False)
    tl.fit(num_epochs=3, grad_accumulation=2)
    reference_fit(reference, DataLoader(data, batch_size=5), [torch.optim.SGD(reference.parameters(), lr=0.05)],
                  nn.MSELoss(), num_epochs=3, grad_accumulation=2,
                  loss_fn=lambda m, batch, criterion: criterion(m(batch[0], batch[1]), batch[2]))
    assert_params_equal(model, reference)


def test_basic_model_fed_a_dict_batch_says_what_to_do():
    """It used to fail with "'str' object has no attribute 'to'" (the dict's keys taken as the inputs)."""
    model = TwoInputRegressor()
    x1, x2, y = two_input_data().tensors
    batch = {"x1": x1, "x2": x2, "labels": y}
    with pytest.raises(TypeError, match=r"TwoInputRegressor \(a TTBasicModel\) takes each batch as a sequence "
                                        r"\(input_1, \.\.\., input_n, target\), got a dict with keys \['x1', 'x2', "
                                        r"'labels'\].*subclass TTModel"):
        model.get_loss(batch, nn.MSELoss(), torch.device("cpu"))
    tl = TrainLoop(model, [batch], None, None, torch.optim.SGD(model.parameters(), lr=0.05), nn.MSELoss(),
                   show_progress=False)
    with pytest.raises(TypeError, match="got a dict with keys"):
        tl.fit(num_epochs=1)


@pytest.mark.parametrize("batch, message", [
    ((torch.zeros(2, 3),), "at least two elements"),
    ((torch.zeros(2, 3), [1.0, 2.0], torch.zeros(2, 1)), "element 1 of the batch is a list, not a tensor"),
])
def test_basic_model_fed_another_batch_it_cannot_split(batch, message):
    with pytest.raises((TypeError, ValueError), match=message):
        TwoInputRegressor().get_predictions(batch, torch.device("cpu"))


# --- ModelWrap and its adapter ------------------------------------------------------------------------------
def test_model_wrap_holds_the_module_and_the_feed_definition():
    module, feed = PlainMLP(), ClassifierFeedDefinition()
    wrap = ModelWrap(module, feed)
    assert wrap.model is module and wrap.batch_model_feed_def is feed


def test_feed_definition_needs_its_abstract_methods():
    class OnlyLoss(AbstractModelFeedDefinition):
        def get_loss(self, model, batch_data, criterion, device):
            return torch.tensor(0.0)

    with pytest.raises(TypeError, match="abstract"):
        OnlyLoss()


def test_feed_definition_get_loss_eval_defaults_to_get_loss():
    torch.manual_seed(0)
    module = PlainMLP().eval()
    feed = ClassifierFeedDefinition()
    batch = classification_data(4).tensors
    cpu = torch.device("cpu")
    assert torch.equal(feed.get_loss_eval(module, batch, nn.CrossEntropyLoss(), cpu),
                       feed.get_loss(module, batch, nn.CrossEntropyLoss(), cpu))


def test_adapter_routes_calls_through_itself_to_the_users_module():
    seen_models = []

    class RecordingFeed(ClassifierFeedDefinition):
        def get_loss(self, model, batch_data, criterion, device):
            seen_models.append(model)
            return super().get_loss(model, batch_data, criterion, device)

        def get_predictions(self, model, batch_data, device):
            seen_models.append(model)
            return super().get_predictions(model, batch_data, device)

    torch.manual_seed(0)
    module = PlainMLP().eval()
    adapter = FeedDefinitionModel(ModelWrap(module, RecordingFeed()))
    x, y = classification_data(4).tensors
    cpu = torch.device("cpu")
    assert torch.equal(adapter(x), module(x))
    assert torch.equal(adapter.get_loss((x, y), nn.CrossEntropyLoss(), cpu), nn.CrossEntropyLoss()(module(x), y))
    adapter.get_loss_eval((x, y), nn.CrossEntropyLoss(), cpu)
    y_pred, y_true, _ = adapter.get_predictions((x, y), cpu)
    assert torch.equal(y_pred, module(x).argmax(dim=1))
    assert seen_models == [adapter, adapter, adapter]  # the feed definition sees the adapter, whose forward
    # is the module's: a parallel wrapper around the adapter therefore sees every computation
    assert all(a is b for a, b in zip(adapter.parameters(), module.parameters()))
    assert set(adapter.state_dict()) == {f"model.{key}" for key in module.state_dict()}


def test_train_loop_accepts_model_wrap_and_returns_the_module():
    module = PlainMLP()
    tl = TrainLoop(ModelWrap(module, ClassifierFeedDefinition()),
                   DataLoader(classification_data(10), batch_size=4), None, None,
                   torch.optim.SGD(module.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                   end_auto_eval=True, show_progress=False)
    assert isinstance(tl.loop_model, FeedDefinitionModel) and tl.loop_model.model is module
    assert tl.model is module and isinstance(tl.batch_model_feed_def, ClassifierFeedDefinition)  # as in 1.x
    assert tl.fit(num_epochs=1) is module
    assert len(tl.train_history["loss"]) == 1
    assert tl.evaluate_loss_on_train_set() == tl.train_history["loss"][0]



# --- transfer_model_attributes ------------------------------------------------------------------------------
def test_transfer_model_attributes_is_a_fresh_list_per_model():
    first, second = ForwardOnly(), ForwardOnly()
    assert first.transfer_model_attributes == []
    first.transfer_model_attributes.append("fc")
    assert second.transfer_model_attributes == []


def test_class_level_transfer_model_attributes_are_copied_per_instance():
    class Declared(ForwardOnly):
        transfer_model_attributes = ["fc"]

    model = Declared()
    assert model.transfer_model_attributes == ["fc"]
    model.transfer_model_attributes.append("other")
    assert Declared.transfer_model_attributes == ["fc"]


# --- TTBasicMultiGPUModel and MultiGPUModelWrap ---------------------------------------------------------------
class LossInForward(TTBasicMultiGPUModel):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 1)
        self.b = nn.Linear(2, 1)

    def forward(self, x1, x2, targets=None, criterion=None):
        predictions = self.a(x1) + self.b(x2)
        return criterion(predictions, targets) if criterion is not None else predictions


def test_multi_gpu_model_computes_the_loss_inside_forward():
    torch.manual_seed(0)
    model = LossInForward()
    x1, x2, y = two_input_data().tensors
    cpu = torch.device("cpu")
    criterion_calls = []

    def criterion(pred, target):
        criterion_calls.append(pred.shape)
        return nn.functional.mse_loss(pred, target)

    expected = nn.functional.mse_loss(model(x1, x2), y)
    assert torch.equal(model.get_loss((x1, x2, y), criterion, cpu), expected)
    assert criterion_calls == [torch.Size([12, 1])]
    y_pred, y_true, _ = model.get_predictions((x1, x2, y), cpu)
    assert torch.equal(y_pred, model(x1, x2)) and torch.equal(y_true, y)


def test_multi_gpu_model_wrap_wraps_a_plain_module():
    torch.manual_seed(0)
    module = nn.Linear(3, 1)
    wrapped = MultiGPUModelWrap(module)
    assert isinstance(wrapped, TTBasicMultiGPUModel) and wrapped.model is module
    assert set(wrapped.state_dict()) == {"model.weight", "model.bias"}
    x, _, y = two_input_data().tensors
    cpu = torch.device("cpu")
    assert torch.equal(wrapped(x), module(x))
    assert torch.equal(wrapped(x, targets=y, criterion=nn.MSELoss()), nn.MSELoss()(module(x), y))
    assert torch.equal(wrapped.get_loss((x, y), nn.MSELoss(), cpu), nn.MSELoss()(module(x), y))
    assert torch.equal(wrapped.get_predictions((x, y), cpu)[0], module(x))


def test_multi_gpu_model_wrap_rejects_a_non_module():
    with pytest.raises(TypeError, match="nn.Module"):
        MultiGPUModelWrap(lambda x: x)


def test_multi_gpu_model_wrap_trains_like_the_hand_written_loop():
    torch.manual_seed(0)
    wrapped = MultiGPUModelWrap(nn.Linear(3, 1))
    reference = nn.Linear(3, 1)
    reference.load_state_dict(wrapped.model.state_dict())
    data = two_input_data()
    pairs = TensorDataset(data.tensors[0], data.tensors[2])
    tl = TrainLoop(wrapped, DataLoader(pairs, batch_size=4), None, None,
                   torch.optim.SGD(wrapped.parameters(), lr=0.05), nn.MSELoss(),
                   end_auto_eval=False, show_progress=False)
    tl.fit(num_epochs=2)
    reference_fit(reference, DataLoader(pairs, batch_size=4), [torch.optim.SGD(reference.parameters(), lr=0.05)],
                  nn.MSELoss(), num_epochs=2, grad_accumulation=1,
                  loss_fn=lambda m, batch, criterion: criterion(m(batch[0]), batch[1]))
    assert_params_equal(wrapped.model, reference)
