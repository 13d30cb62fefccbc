"""A checkpoint's entries that fit applies (random, callback and sampler states) were checked only by kind when
the file was read: what is wrong with them, found at fit, names the file as load_checkpoint's own errors do
(issue 31's review), never a bare TypeError, OverflowError or KeyError."""
import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.experiment.local_save.safe_load import CheckpointMismatchError, CorruptCheckpointError
from aitoolbox.torchtrain.callbacks import EarlyStopping
from aitoolbox.torchtrain.callbacks.model_load import ModelLoadContinueTraining
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import classification_data
from tests.security import hostile


def _loop() -> TrainLoop:
    model = hostile.small_model()
    return TrainLoop(model, DataLoader(classification_data(8), batch_size=4), None, None,
                     torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), nn.CrossEntropyLoss(),
                     show_progress=False)


@pytest.fixture(scope="module")
def saved():
    tl = _loop()
    tl.fit(num_epochs=1, callbacks=[EarlyStopping(monitor="loss", patience=3)])
    return tl.checkpoint_state()


def _sampler_attributes(checkpoint):
    for rng in checkpoint["rng"]:
        rng["samplers"] = {"SequentialSampler:0": {"attributes": {"__class__": "planted", "data_source": [1]}}}


BROKEN = {
    "rng_python_not_a_state": (lambda c: c["rng"][0].update(python=5), CorruptCheckpointError),
    "rng_torch_a_text": (lambda c: c["rng"][0].update(torch="x"), CorruptCheckpointError),
    "callback_count_infinite": (lambda c: c["callbacks"]["EarlyStopping:0"].update(
        epochs_without_improvement=float("inf")), CorruptCheckpointError),
    "callback_key_missing": (lambda c: c["callbacks"]["EarlyStopping:0"].pop("best_epoch"), CorruptCheckpointError),
    "sampler_attribute_not_a_generator": (_sampler_attributes, CheckpointMismatchError),
}


@pytest.mark.parametrize("name", BROKEN)
@pytest.mark.parametrize("how", ["load_checkpoint", "ModelLoadContinueTraining"])
def test_a_broken_entry_applied_at_fit_names_the_file(saved, tmp_path, name, how):
    change, error = BROKEN[name]
    checkpoint = copy.deepcopy(saved)
    change(checkpoint)
    path = str(tmp_path / "model_exp_2024-01-01_00-00-00_E1.pth")
    torch.save(checkpoint, path)
    tl = _loop()
    callbacks = [EarlyStopping(monitor="loss", patience=3)]
    if how == "load_checkpoint":
        tl.load_checkpoint(path)
    else:
        callbacks.append(ModelLoadContinueTraining(saved_model_path=path))
    with pytest.raises(error) as refused:
        tl.fit(num_epochs=3, callbacks=callbacks)
    assert path in str(refused.value)
