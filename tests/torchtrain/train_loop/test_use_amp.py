"""TrainLoop's ``use_amp``: what it sets up, and that nothing of a finished TrainLoop stays in memory."""
import gc
import weakref

import pytest
import torch
from torch import nn

from aitoolbox.torchtrain import amp
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import MLP, classification_data, seeded_loader


def short_fit(use_amp):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    tl = TrainLoop(model, seeded_loader(classification_data()), None, None, optimizer, nn.CrossEntropyLoss(),
                   end_auto_eval=False, show_progress=False, use_amp=use_amp)
    tl.fit(num_epochs=1)
    return tl, model, optimizer


@pytest.mark.parametrize("use_amp", [True, {"opt_level": "O1"}, {"opt_level": "O2"}, {"init_scale": 2.0 ** 10}],
                         ids=["true", "O1", "O2", "grad_scaler"])
def test_train_loop_model_optimizer_and_amp_state_are_freed_after_fit(use_amp):
    tl, model, optimizer = short_fit(use_amp)
    refs = {"train_loop": weakref.ref(tl), "model": weakref.ref(model), "optimizer": weakref.ref(optimizer),
            "precision": weakref.ref(tl.precision)}
    refs.update({f"stepped{i}": weakref.ref(p) for i, p in enumerate(optimizer.param_groups[0]["params"])})
    state = amp.state_of(optimizer)
    if isinstance(use_amp, dict) and "opt_level" in use_amp:
        refs["amp_state"] = weakref.ref(state)
        if use_amp["opt_level"] == "O2":
            assert state.master_weights is not None  # the stepped tensors above are its float32 masters
    else:
        assert state is None
    del tl, model, optimizer, state
    gc.collect()
    alive = [name for name, ref in refs.items() if ref() is not None]
    assert not alive, f"still alive after del + gc.collect(): {alive}"
