"""Bad inputs: each is rejected with a built-in exception whose message names the problem and the fix."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.model import ModelWrap
from aitoolbox.torchtrain.train_loop import TrainLoop
from aitoolbox.torchtrain.train_loop.validation import check_fit_arguments, check_loss
from tests.helpers import MLP, ClassifierFeedDefinition, EmptyIterableData, PlainMLP, classification_data

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised on a machine without CUDA")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def loader(num_samples=10):
    return DataLoader(classification_data(num_samples), batch_size=4)


def build(model=None, train_loader="default", validation_loader=None, test_loader=None, optimizer=None,
          criterion="default", **kwargs):
    model = MLP() if model is None else model
    train_loader = loader() if isinstance(train_loader, str) else train_loader
    criterion = nn.CrossEntropyLoss() if isinstance(criterion, str) else criterion
    if optimizer is None:  # the model's own parameters (fit refuses an optimizer over none of them)
        optimizer = torch.optim.SGD((model if isinstance(model, nn.Module) else MLP()).parameters(), lr=0.1)
    return TrainLoop(model, train_loader, validation_loader, test_loader, optimizer, criterion,
                     show_progress=False, **kwargs)


# --- the model --------------------------------------------------------------------------------------------
def test_plain_module_points_to_model_wrap():
    with pytest.raises(TypeError, match=r"got PlainMLP\. It is a plain nn\.Module: wrap it as ModelWrap"):
        build(model=PlainMLP())


@pytest.mark.parametrize("model", ["a string", lambda x: x, 42])
def test_model_of_another_type(model):
    with pytest.raises(TypeError, match="model must be a TTModel or a ModelWrap, got"):
        build(model=model)


# --- loaders ---------------------------------------------------------------------------------------------
def test_a_train_loop_without_train_loader_or_optimizer_predicts_but_does_not_fit():
    model = MLP()
    test_loader = loader(9)
    tl = TrainLoop(model, None, None, test_loader, None, nn.CrossEntropyLoss(), show_progress=False)
    y_pred, y_true, _ = tl.predict_on_test_set()
    x, y = classification_data(9).tensors
    with torch.no_grad():
        expected = model.eval()(x).argmax(dim=1)
    assert torch.equal(y_pred, expected) and torch.equal(y_true, y)
    assert isinstance(tl.evaluate_loss_on_test_set(float_dict_format=True), float)
    with pytest.raises(ValueError, match="no train_loader and no optimizer, so it can only predict"):
        tl.fit(num_epochs=1)
    without_optimizer = TrainLoop(MLP(), loader(), None, None, None, nn.CrossEntropyLoss(), show_progress=False)
    with pytest.raises(ValueError, match="no optimizer, so it can only predict"):
        without_optimizer.fit(num_epochs=1)


def test_empty_train_loader():
    empty = DataLoader(classification_data(3), batch_size=4, drop_last=True)
    assert len(empty) == 0
    with pytest.raises(ValueError, match=r"train_loader is empty \(len 0\)"):
        build(train_loader=empty)


def test_iterable_train_loader_yielding_nothing_fails_at_the_first_epoch_end():
    tl = build(train_loader=DataLoader(EmptyIterableData(), batch_size=4))
    with pytest.raises(ValueError, match="train_loader yielded no batches"):
        tl.fit(num_epochs=1)


@pytest.mark.parametrize("argument", ["train_loader", "validation_loader", "test_loader"])
def test_dataset_passed_instead_of_a_loader(argument):
    with pytest.raises(TypeError, match=rf"{argument} must be an iterable of batches.*TensorDataset.*"
                                        r"wrap it as DataLoader\(dataset"):
        build(**{argument: classification_data(10)})


class SequenceLoader:
    """A Keras-Sequence-style loader: batches by index (Python's sequence protocol), no __iter__."""

    def __init__(self, batches):
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, index):
        return self.batches[index]  # a list's IndexError ends the iteration


@pytest.mark.parametrize("argument", ["train_loader", "validation_loader"])
def test_a_sequence_of_batches_is_a_loader(argument):
    """Review of issue 35, D8: Python iterates a __len__ + __getitem__ loader, so it is not refused as a Dataset."""
    tl = build(**{argument: SequenceLoader(list(loader()))})
    tl.fit(num_epochs=1)
    assert tl.epochs_completed == 1


def test_loader_that_is_not_iterable():
    with pytest.raises(TypeError, match="validation_loader must be an iterable of batches such as a DataLoader, "
                                        "got int"):
        build(validation_loader=3)


@pytest.mark.parametrize("argument", ["train_loader", "test_loader"])
def test_a_dict_of_loaders_is_refused_where_one_loader_goes(argument):
    """A dict as test_loader used to train fully and then fail at the end; only validation sets have names."""
    with pytest.raises(TypeError, match=rf"{argument} is a dict .*only validation_loader takes named sets.*one "
                                        rf"DataLoader"):
        build(**{argument: {"a": loader(), "b": loader()}})


@pytest.mark.parametrize("argument", ["train_loader", "test_loader"])
def test_a_list_of_loaders_is_refused_where_one_loader_goes(argument):
    with pytest.raises(TypeError, match=rf"{argument} is a list of 2 DataLoaders"):
        build(**{argument: [loader(), loader()]})


def test_an_empty_test_loader_is_refused():
    with pytest.raises(ValueError, match=r"test_loader is empty \(len 0\)"):
        build(test_loader=DataLoader(classification_data(3), batch_size=4, drop_last=True))


def test_a_list_of_batches_is_still_a_loader():
    """Any iterable of batches is a loader (the docs say so): only a list of loaders is refused."""
    x, y = classification_data(8).tensors
    batches = [(x[:4], y[:4]), (x[4:], y[4:])]
    tl = build(train_loader=batches, validation_loader=batches, test_loader=batches)
    tl.fit(num_epochs=1)
    assert len(tl.train_history["val_loss"]) == 1


# --- optimizer, criterion, options --------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer, error, message", [
    ("sgd", TypeError, r"optimizer must be a torch.optim.Optimizer \(or an object with its step\(\) and zero_grad\(\) "
                       r"methods\), a list of them or a MultiOptimizer, got str"),
    ([], ValueError, "optimizer list is empty"),
])
def test_bad_optimizer(optimizer, error, message):
    with pytest.raises(error, match=message):
        build(optimizer=optimizer)


class OptimizerWrapper:
    """An optimizer wrapper that is not a torch.optim.Optimizer (some libraries ship such wrappers)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.steps = 0

    def step(self):
        self.steps += 1
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad()


def test_an_optimizer_wrapper_trains_but_needs_a_torch_optimizer_for_amp_and_checkpoints():
    model = MLP()
    wrapper = OptimizerWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    tl = build(model=model, optimizer=wrapper)
    tl.fit(num_epochs=1)
    assert wrapper.steps == 3  # 10 samples in batches of 4
    with pytest.raises(TypeError, match="cannot checkpoint optimizer\\(s\\) OptimizerWrapper: a checkpoint needs"):
        tl.checkpoint_state()
    with pytest.raises(TypeError, match="mixed precision needs torch.optim.Optimizer instances .* OptimizerWrapper"):
        build(model=model, optimizer=wrapper, use_amp=True).fit(num_epochs=1)


@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, [torch.optim.SGD]])
def test_an_optimizer_class_is_refused_at_construction(optimizer):
    """torch.optim.AdamW has step() and zero_grad() too: it used to fail 6 s in with torch's raw error."""
    with pytest.raises(TypeError, match=r"optimizer is the class torch\.optim\.\w+\.?\w*, not an optimizer: build one, "
                                        r"e\.g\. \w+\(model\.parameters\(\), lr=1e-3\)"):
        build(optimizer=optimizer)


@pytest.mark.parametrize("criterion, shown", [(nn.CrossEntropyLoss, "nn.CrossEntropyLoss"),
                                              ({"ce": nn.CrossEntropyLoss}, "criterion['ce']"),
                                              ([nn.MSELoss(), nn.L1Loss], "criterion[1]")])
def test_a_criterion_class_is_refused_at_construction(criterion, shown):
    with pytest.raises(TypeError, match=r"is the class .*(CrossEntropyLoss|L1Loss), not a loss function: pass an "
                                        r"instance, e\.g\. nn\.(CrossEntropyLoss|L1Loss)\(\)"):
        build(criterion=criterion)


def test_a_class_that_is_not_a_loss_is_a_valid_criterion():
    """Review of issue 35, D8: the criterion is anything get_loss reads, e.g. a namespace class of loss functions;
    only an nn.Module class (a torch loss without its ()) is a mistake."""

    class Losses:
        cross_entropy = staticmethod(nn.functional.cross_entropy)

    class NamespaceCriterionModel(MLP):
        def get_loss(self, batch, criterion, device):
            inputs, targets = (item.to(device) for item in batch)
            return criterion.cross_entropy(self(inputs), targets)

    tl = build(model=NamespaceCriterionModel(), criterion=Losses)
    tl.fit(num_epochs=1)
    assert tl.epochs_completed == 1


def test_list_with_a_non_optimizer():
    with pytest.raises(TypeError, match="got NoneType"):
        build(optimizer=[torch.optim.SGD(MLP().parameters(), lr=0.1), None])


def test_the_criterion_is_handed_to_get_loss_as_it_is():
    """The loop never calls the criterion itself: a dict of losses (a 1.x multi-loss pattern) is fine."""
    seen = []

    class DictCriterionModel(MLP):
        def get_loss(self, batch_data, criterion, device):
            seen.append(criterion)
            x, y = batch_data
            return criterion["ce"](self(x), y)

    criteria = {"ce": nn.CrossEntropyLoss()}
    build(model=DictCriterionModel(), criterion=criteria).fit(num_epochs=1)
    assert seen and all(criterion is criteria for criterion in seen)


def test_criterion_may_be_none():
    build(criterion=None)


@pytest.mark.parametrize("end_auto_eval", [0, -2, "yes", 1.5])
def test_bad_end_auto_eval(end_auto_eval):
    with pytest.raises(ValueError, match="end_auto_eval must be True, False or a positive int"):
        build(end_auto_eval=end_auto_eval)


def test_bad_use_amp():
    with pytest.raises(TypeError, match="use_amp must be True, False or a dict"):
        build(use_amp="O1")


def test_unknown_gpu_mode():
    with pytest.raises(ValueError, match=r"gpu_mode must be one of 'single', 'dp', 'ddp', 'fsdp'; got 'tpu'"):
        build(gpu_mode="tpu")


@no_cuda
def test_data_parallel_without_cuda_trains_on_the_cpu_with_a_warning():
    with pytest.warns(UserWarning, match=r"gpu_mode='dp' \(torch.nn.DataParallel\) needs CUDA GPUs .* on the CPU"):
        tl = build(gpu_mode="dp")
    tl.fit(num_epochs=1, dp_model_args={"dim": 0})
    assert tl.device.type == "cpu" and len(tl.train_history["accumulated_loss"]) == 1
    with pytest.raises(TypeError, match="dp_model_args needs gpu_mode='dp'"):
        build().fit(num_epochs=1, dp_model_args={})


@no_cuda
def test_cuda_device_idx_without_cuda():
    with pytest.raises(ValueError, match="cuda_device_idx=0 was given but CUDA is not available"):
        build(cuda_device_idx=0)


@needs_cuda
def test_cuda_device_idx_out_of_range():
    index = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"cuda_device_idx={index} is out of range"):
        build(cuda_device_idx=index)


@pytest.mark.parametrize("index", ["0", 1.0, True])
def test_cuda_device_idx_not_an_int(index):
    with pytest.raises(TypeError, match="cuda_device_idx must be an int GPU index or None"):
        build(cuda_device_idx=index)


# --- fit arguments -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_epochs, num_iterations", [(0, 0), (2, 3)])
def test_exactly_one_of_epochs_and_iterations(num_epochs, num_iterations):
    tl = build()
    with pytest.raises(ValueError, match="set exactly one of num_epochs and num_iterations"):
        tl.fit(num_epochs=num_epochs, num_iterations=num_iterations)


def test_fit_without_arguments():
    with pytest.raises(ValueError, match="set exactly one of num_epochs and num_iterations"):
        build().fit()


@pytest.mark.parametrize("name, value", [("num_epochs", -1), ("num_iterations", 2.5), ("num_epochs", True)])
def test_bad_counts(name, value):
    with pytest.raises(ValueError, match=f"{name} must be a non-negative int"):
        check_fit_arguments(**{"num_epochs": 0, "num_iterations": 0, name: value, "grad_accumulation": 1})


@pytest.mark.parametrize("grad_accumulation", [0, -1, 1.5, True])
def test_bad_grad_accumulation(grad_accumulation):
    tl = build()
    with pytest.raises(ValueError, match="grad_accumulation must be an int >= 1"):
        tl.fit(num_epochs=1, grad_accumulation=grad_accumulation)


def test_callback_that_is_not_an_abstract_callback():
    with pytest.raises(TypeError, match=r"callbacks\[1\] is a function, not an AbstractCallback"):
        build().fit(num_epochs=1, callbacks=[AbstractCallback("noop"), lambda: None])


# --- what the user's model returns ----------------------------------------------------------------------
class FloatLoss(MLP):
    def get_loss(self, batch_data, criterion, device):
        return super().get_loss(batch_data, criterion, device).item()


class VectorLoss(MLP):
    def get_loss(self, batch_data, criterion, device):
        x, y = batch_data
        return nn.functional.cross_entropy(self(x.to(device)), y.to(device), reduction="none")


def test_loss_as_python_float():
    with pytest.raises(TypeError, match=r"get_loss must return the loss as a torch.Tensor, got float.*loss.item\(\)"):
        build(model=FloatLoss()).fit(num_epochs=1)


def test_loss_not_a_scalar():
    with pytest.raises(ValueError, match=r"get_loss must return a scalar loss, got a tensor of shape \(4,\)"):
        build(model=VectorLoss()).fit(num_epochs=1)


def test_check_loss_accepts_one_element_tensors():
    check_loss(torch.tensor(1.0), "get_loss")
    check_loss(torch.tensor([1.0]), "get_loss")


class BadPredictions(MLP):
    def get_predictions(self, batch_data, device):
        return self(batch_data[0].to(device)).cpu(), batch_data[1]


def test_predictions_of_the_wrong_shape():
    tl = build(model=BadPredictions(), validation_loader=loader())
    with pytest.raises(ValueError, match=r"get_predictions must return a tuple \(y_pred, y_true, metadata\).*length 2"):
        tl.predict_on_validation_set()


# --- ModelWrap's own checks -------------------------------------------------------------------------------
def test_model_wrap_checks_its_arguments():
    with pytest.raises(TypeError, match="ModelWrap needs an nn.Module as model, got str"):
        ModelWrap("model", ClassifierFeedDefinition())
    with pytest.raises(TypeError, match="needs an AbstractModelFeedDefinition instance.*got PlainMLP"):
        ModelWrap(PlainMLP(), PlainMLP())
