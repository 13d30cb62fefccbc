"""torch_compile under fit_distributed: two real processes over gloo, the model compiled inside DDP."""
import copy
import os

import pytest
import torch
import torch._dynamo

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from tests.torchtrain.distributed.support import (
    assert_state_dicts_close, assert_state_dicts_equal, make_model, make_train_loop)

pytestmark = pytest.mark.filterwarnings("ignore:CUDA is not available")

AOT_EAGER = {"backend": "aot_eager"}


class RecordCompiles(AbstractCallback):
    """Saves each rank's weights and compile statistics at the end of training."""

    def __init__(self, folder):
        super().__init__("record compiles")
        self.folder = str(folder)

    def on_train_end(self):
        tl = self.train_loop_obj
        stats = tl.compile_stats
        torch.save({"state_dict": {k: v.detach().clone() for k, v in tl.model.state_dict().items()},
                    "compiles": stats.compiles if stats is not None else 0,
                    "compiles_after_first_epoch": len(stats.compiles_since(1)) if stats is not None else 0,
                    "forward_compiles": tl._compiler.model_call.compiles if stats is not None else 0},
                   os.path.join(self.folder, f"rank{tl.strategy.rank}.pt"))


def rank_records(folder):
    return [torch.load(os.path.join(str(folder), f"rank{rank}.pt"), weights_only=True) for rank in (0, 1)]


@pytest.mark.parametrize("grad_accumulation", [1, 2])
def test_compiled_ddp_training_equals_eager_ddp_training(tmp_path, grad_accumulation):
    """34 samples in batches of 4 per rank: a smaller last batch; with grad_accumulation=2 the micro-batches before
    a step run under DDP's no_sync. The replicas stay identical and agree with the eager two-process run."""
    torch._dynamo.reset()
    initial = make_model()
    eager_folder, compiled_folder = tmp_path / "eager", tmp_path / "compiled"
    eager_folder.mkdir()
    compiled_folder.mkdir()
    eager = make_train_loop(copy.deepcopy(initial), train_samples=34)
    eager.fit_distributed(num_epochs=3, grad_accumulation=grad_accumulation, callbacks=[RecordCompiles(eager_folder)],
                          train_data_shuffle=False, num_gpus=2, start_method="fork")
    compiled = make_train_loop(copy.deepcopy(initial), train_samples=34, torch_compile=AOT_EAGER)
    compiled.fit_distributed(num_epochs=3, grad_accumulation=grad_accumulation,
                             callbacks=[RecordCompiles(compiled_folder)], train_data_shuffle=False, num_gpus=2,
                             start_method="fork")

    rank0, rank1 = rank_records(compiled_folder)
    eager_rank0, _ = rank_records(eager_folder)
    assert_state_dicts_equal(rank0["state_dict"], rank1["state_dict"])
    assert_state_dicts_close(rank0["state_dict"], eager_rank0["state_dict"], atol=1e-5)
    for rank in (rank0, rank1):
        assert rank["forward_compiles"] > 0 and rank["compiles"] > rank["forward_compiles"]  # the SGD step too
        assert rank["compiles_after_first_epoch"] == 0
    # The parent holds rank 0's weights in its own (uncompiled) model, with the model's own state_dict keys.
    assert_state_dicts_equal(compiled.model.state_dict(), rank0["state_dict"])
    assert list(compiled.model.state_dict()) == list(initial.state_dict())
