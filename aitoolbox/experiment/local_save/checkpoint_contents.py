"""The entries of a checkpoint read from storage, checked once where it is read.

A file that loads without running code can still hold anything plain: a number where the loop expects its
optimizer's state, a list where it expects its history. The entries a TrainLoop and aitoolbox 1.x's loaders use
are checked here, by type, when the file is read; a file whose entries are not what aitoolbox writes is refused
with :class:`~aitoolbox.experiment.local_save.safe_load.CorruptCheckpointError` naming the file and the entry,
rather than failing later, somewhere in the loop, with an error that names neither.

Only what aitoolbox 1.8 and this package write is required: ``model_state_dict`` (not for a sharded checkpoint,
whose weights are in its DCP files); every other entry is checked when it is present. Values that are only
handed back to the user (``hyperparams``) are not checked.
"""
import numbers
from typing import Any, Callable, Dict

import torch

from aitoolbox.experiment.local_save.safe_load import CorruptCheckpointError


def _whole(minimum: int) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum
    return check


def _is_dict(value: Any) -> bool:
    return isinstance(value, dict)


def _list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    def checked(value: Any) -> bool:
        return isinstance(value, (list, tuple)) and all(check(item) for item in value)
    return checked


def _model_state(value: Any) -> bool:
    """A module's state dict: names to tensors (an ``_extra_state`` entry holds whatever the module keeps)."""
    return isinstance(value, dict) and all(
        isinstance(key, str) and (isinstance(item, torch.Tensor) or key.endswith("_extra_state"))
        for key, item in value.items())


def _optimizer_state(value: Any) -> bool:
    """An optimizer's state dict (parameters by index, or by name from DCP), or only its ``param_groups``."""
    if not isinstance(value, dict):
        return False
    state, groups = value.get("state", {}), value.get("param_groups", [])
    return (isinstance(state, dict) and all(isinstance(key, (int, str)) and isinstance(item, dict)
                                            for key, item in state.items())
            and isinstance(groups, list) and all(
                isinstance(group, dict) and all(isinstance(key, str) for key in group)
                and _list_of(lambda param: isinstance(param, (int, str)))(group.get("params", []))
                for group in groups))


def _optimizers(value: Any) -> bool:
    return _optimizer_state(value) or _list_of(_optimizer_state)(value)


def _history(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(key, str) and isinstance(item, list)
                                           for key, item in value.items())


def _flag(value: Any) -> bool:
    return isinstance(value, (bool, numbers.Integral)) or type(value).__name__ == "bool_"


_ENTRIES: Dict[str, tuple] = {
    "model_state_dict": (_model_state, "a dict of parameter names to tensors"),
    "optimizer_state_dict": (lambda value: value is None or _optimizers(value),
                             "an optimizer's state dict or a list of them"),
    "schedulers_state_dict": (lambda value: value is None or _list_of(_is_dict)(value),
                              "a list of LR scheduler state dicts"),
    "epoch": (_whole(-1), "an epoch number"),
    "iteration_idx": (_whole(-1), "an iteration index"),
    "epochs_completed": (_whole(0), "a count of epochs"),
    "iteration": (_whole(0), "a count of batches"),
    "world_size": (_whole(1), "a count of processes"),
    "format_version": (_whole(0), "a format version"),
    "early_stop": (_flag, "a flag"),
    "train_history": (_history, "a dict of metric names to lists"),
    "train_history_per_rank": (_list_of(_history), "a list of training histories"),
    "rng": (_list_of(_is_dict), "a list of random states"),
    "epoch_start_rng": (_list_of(lambda item: item is None or isinstance(item, dict)), "a list of random states"),
    "epoch_loss_sum": (lambda value: isinstance(value, list), "a list of loss sums"),
    "epoch_loss_names": (lambda value: value is None or _list_of(lambda item: isinstance(item, str))(value),
                         "a list of loss names"),
    "train_loader_state": (lambda value: isinstance(value, list), "a list of loader states"),
    "precision": (_is_dict, "a precision state dict"),
    "callbacks": (lambda value: isinstance(value, dict) and all(isinstance(key, str) for key in value),
                  "a dict of callback states"),
    "rollbacks": (lambda value: value is None or isinstance(value, dict), "a rollback record"),
    "amp": (_is_dict, "a loss scaler state dict"),
}


def check_checkpoint_contents(checkpoint: Any, path: str, sharded: bool = False) -> dict:
    """``checkpoint`` (read from ``path``) when its entries are what aitoolbox writes.

    Args:
        checkpoint: what the file held.
        path: the file, for the error.
        sharded: the training state of a sharded checkpoint (its weights are not in it).

    Raises:
        CorruptCheckpointError: it is not a dict, lacks ``model_state_dict`` (unless ``sharded``), or an entry is
            not of its kind; the message names the entry.
    """
    if not isinstance(checkpoint, dict):
        raise CorruptCheckpointError(path, f"it holds a {type(checkpoint).__name__}, not an aitoolbox checkpoint "
                                           "(a dict with 'model_state_dict')")
    if not sharded and "model_state_dict" not in checkpoint:
        raise CorruptCheckpointError(path, "it is not an aitoolbox checkpoint (no 'model_state_dict' entry; it has "
                                           f"{sorted(map(str, checkpoint))[:20]})")
    for key, (check, kind) in _ENTRIES.items():
        if key in checkpoint and not check(checkpoint[key]):
            raise CorruptCheckpointError(path, f"its entry {key!r} is not {kind} (a "
                                               f"{type(checkpoint[key]).__name__})")
    return checkpoint
