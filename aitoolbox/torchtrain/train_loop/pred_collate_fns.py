"""How per-batch predictions are collected (``collate_batch_pred_fn``) and joined (``pred_transform_fn``)."""
from typing import Any, List

import torch


def append_predictions(batch_result: Any, collected: List[Any]) -> List[Any]:
    """Append one batch's output to the list of collected outputs."""
    collected.append(batch_result)
    return collected


def append_concat_predictions(batch_result: Any, collected: List[Any]) -> List[Any]:
    """Extend the collected list with a batch given as a list (e.g. of variable-length sequences)."""
    if isinstance(batch_result, list):
        collected.extend(batch_result)
    else:
        collected.append(batch_result)
    return collected


def torch_cat_transf(collected: List[Any]) -> Any:
    """Concatenate the per-batch tensors along the first dimension (and on the CPU)."""
    if len(collected) == 0:
        return torch.empty(0)
    if all(isinstance(item, torch.Tensor) for item in collected):
        return torch.cat([item.detach().cpu().reshape(-1) if item.dim() == 0 else item.detach().cpu()
                          for item in collected])
    return collected


def keep_list_transf(collected: List[Any]) -> List[Any]:
    """Leave the collected outputs as a list."""
    return collected
