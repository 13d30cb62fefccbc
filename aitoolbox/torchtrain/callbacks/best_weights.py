"""Putting other weights into a TrainLoop's model: a saved checkpoint's (``ModelCheckpoint.load_best_model()``,
``ModelCheckpoint.best_weights()``) or a copy kept in memory (``EarlyStopping(restore_best_weights=True)``).

What is put in is the model's state dict (parameters and buffers, e.g. BatchNorm's running statistics) and, under
amp O2, the float32 master weights the optimizer steps, so that predicting, evaluating and a later ``fit`` all see
the same weights. The loop's cached evaluations, computed with the weights replaced, are dropped.
"""
import contextlib
import math
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

import torch

if TYPE_CHECKING:  # pragma: no cover
    from aitoolbox.torchtrain.train_loop.train_loop import TrainLoop


def best_of(scored: List[Tuple[float, str]], higher_is_better: bool) -> Optional[Tuple[float, str]]:
    """The best ``(score, path)`` of ``scored``; NaN scores (an epoch without a value, a diverged metric) never are.
    Of equal scores the earliest wins, as the ranking that pruned the others kept it."""
    ranked = [entry for entry in scored if not math.isnan(entry[0])]
    if not ranked:
        return None
    return max(ranked, key=lambda entry: entry[0]) if higher_is_better else min(ranked, key=lambda entry: entry[0])


def _precision_of(tl: "TrainLoop") -> Any:
    """The loop's precision once it is set up, else None (nothing of it to keep in step with the weights)."""
    try:
        return tl.precision
    except RuntimeError:
        return None


def _forget_cached_evaluations(tl: "TrainLoop") -> None:
    # Results cached for the current training iteration were computed with the weights just replaced. (Where the
    # cache is keyed on the weights' versions, load_state_dict's in-place copies make this redundant.)
    clear_cache = getattr(getattr(tl, "_evaluator", None), "clear_cache", None)
    if clear_cache is not None:
        clear_cache()


def _check_whole_model(tl: "TrainLoop", what: str) -> None:
    if getattr(tl, "shards_parameters", False):
        raise ValueError(f"{what} needs the whole model, and under gpu_mode='fsdp' each process holds shards of it: "
                         "call it after fit_distributed returns, in the launching process (whose model is whole), or "
                         "read a sharded checkpoint's weights with aitoolbox.experiment.local_save.sharded_checkpoints."
                         "read_full_model_state_dict(path)")


def capture_weights(tl: "TrainLoop") -> Dict[str, Any]:
    """A copy, in host memory, of the model's state dict and (amp O2) of the float32 master weights."""
    model_state = {name: value.detach().to("cpu", copy=True) for name, value in tl.model.state_dict().items()}
    precision = _precision_of(tl)
    masters = precision.master_weights if precision is not None else None
    return {"model": model_state,
            "master_weights": [[tensor.cpu() for tensor in group] for group in masters.state_dict()]
            if masters is not None else None}


def restore_weights(tl: "TrainLoop", weights: Dict[str, Any]) -> None:
    """Put weights :func:`capture_weights` took (or read from a checkpoint) into the loop's model."""
    _check_whole_model(tl, "putting other weights into the model")
    tl.model.load_state_dict(weights["model"])  # the user's module: a parallel wrapper shares its parameters
    precision = _precision_of(tl)
    masters = precision.master_weights if precision is not None else None
    if masters is not None and weights.get("master_weights") is not None:
        # The exact float32 values (also copied into the model). Without them the masters take the loaded model's
        # values at its next step, as after any load_state_dict (see MasterWeights).
        masters.load_state_dict(weights["master_weights"])
    _forget_cached_evaluations(tl)


def holds_weights(tl: "TrainLoop", weights: Dict[str, Any]) -> bool:
    """Whether the loop's model holds exactly ``weights``'s model state (parameters and buffers)."""
    current = tl.model.state_dict()
    expected = weights["model"]
    if current.keys() != expected.keys():
        return False
    return all(torch.equal(current[name].detach().cpu(), expected[name].cpu()) for name in expected)


def checkpoint_weights(path: str) -> Dict[str, Any]:
    """The model state dict (and amp O2's master weights) of the checkpoint ``path``: a file, read without running
    code from it, or a sharded checkpoint's folder (its full model state dict)."""
    from aitoolbox.experiment.local_save.checkpoints import MODEL_KEY, load_checkpoint_file
    from aitoolbox.experiment.local_save.sharded_checkpoints import is_sharded_checkpoint, read_full_model_state_dict
    if is_sharded_checkpoint(path):
        return {"model": read_full_model_state_dict(path), "master_weights": None}
    checkpoint = load_checkpoint_file(path)
    precision_state = checkpoint.get("precision") or {}
    return {"model": checkpoint[MODEL_KEY], "master_weights": precision_state.get("master_weights")}


@contextlib.contextmanager
def weights_swapped_in(tl: "TrainLoop", weights: Dict[str, Any]) -> Iterator[None]:
    """Within the block the model has ``weights``; afterwards (also after an exception) the weights it had."""
    _check_whole_model(tl, "putting other weights into the model")
    kept = capture_weights(tl)
    restore_weights(tl, weights)
    try:
        yield
    finally:
        restore_weights(tl, kept)
