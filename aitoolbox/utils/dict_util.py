"""Reshaping dicts: merge per-batch prediction metadata, flatten nested dicts, group values by key."""
import copy
from collections.abc import Mapping
from typing import Any, Dict, Hashable, Iterable, List

import numpy as np
import torch

from aitoolbox.utils.util import flatten_list_of_lists


def combine_prediction_metadata_batches(metadata_list: Iterable[Dict[str, Any]]) -> Dict[str, Any]:
    """Merge per-batch metadata dicts into one dict, concatenating the values of each key along the batch.

    Keys need not appear in every batch: a key's value is the concatenation of the batches that have it.

    Args:
        metadata_list: one dict per batch; every value is a list, a ``torch.Tensor`` or a ``numpy.ndarray``
            (the type of a key's first value decides how that key is concatenated).

    Returns:
        ``{key: concatenated values}``: lists are joined, tensors and arrays concatenated on dimension 0.

    Raises:
        TypeError: a value is of another type.
    """
    per_key: Dict[str, List[Any]] = {}
    for batch_metadata in metadata_list:
        for key, value in batch_metadata.items():
            per_key.setdefault(key, []).append(value)

    combined = {}
    for key, values in per_key.items():
        first = values[0]
        if isinstance(first, list):
            combined[key] = flatten_list_of_lists(values)
        elif isinstance(first, torch.Tensor):
            combined[key] = torch.cat(values, dim=0)
        elif isinstance(first, np.ndarray):
            combined[key] = np.concatenate(values, axis=0)
        else:
            raise TypeError(f"Metadata '{key}' is a {type(first).__name__}; batches can only be combined when "
                            f"the values are lists, torch.Tensors or numpy arrays")
    return combined


def flatten_dict(nested_dict: Mapping, parent_key: str = "", sep: str = "_") -> Dict[Hashable, Any]:
    """Flatten nested dicts into one level, joining the keys on the path with ``sep``.

    For example ``{'f1': {'cat': 0.5, 'dog': {'big': 0.1}}, 'acc': 0.9}`` becomes
    ``{'f1_cat': 0.5, 'f1_dog_big': 0.1, 'acc': 0.9}``.

    Args:
        nested_dict: the dict to flatten (not modified).
        parent_key: prefix put in front of every key (used by the recursion).
        sep: the separator between the keys of the levels.

    Returns:
        A new, single-level dict.
    """
    flat: Dict[Hashable, Any] = {}
    for key, value in nested_dict.items():
        full_key = f"{parent_key}{sep}{key}" if parent_key else key
        if isinstance(value, Mapping):
            flat.update(flatten_dict(value, full_key, sep=sep))
        else:
            flat[full_key] = value
    return flat


def combine_dict_elements(list_of_dicts: Iterable[Mapping]) -> Dict[Hashable, List[Any]]:
    """Group the values of several dicts by key.

    Args:
        list_of_dicts: dicts whose keys may or may not match.

    Returns:
        ``{key: [value from each dict that has the key, in order]}``.
    """
    combined: Dict[Hashable, List[Any]] = {}
    for single_dict in list_of_dicts:
        for key, value in single_dict.items():
            combined.setdefault(key, []).append(value)
    return combined


def flatten_combine_dict(train_history: Mapping) -> Dict[str, List[Any]]:
    """Turn a history whose values are lists of (nested) dicts into plain ``{name: [values]}`` lists.

    A metric recorded as ``'f1': [{'cat': 0.1}, {'cat': 0.3}]`` becomes ``'f1_cat': [0.1, 0.3]``; metrics
    with plain values are kept as they are. As in aitoolbox 1.x, a metric with no values yet (an empty list)
    is left out: there is nothing to flatten or report for it. The input is not modified.

    Args:
        train_history: ``{metric name: [values per epoch]}``.

    Returns:
        A new dict with every grouped metric split into one list per leaf key.
    """
    history = copy.deepcopy(dict(train_history))
    flat_history: Dict[str, List[Any]] = {}
    for name, values in history.items():
        if isinstance(values, (list, tuple)) and len(values) == 0:
            continue
        if isinstance(values, (list, tuple)) and all(isinstance(value, Mapping) for value in values):
            grouped = combine_dict_elements(flatten_dict(value) for value in values)
            for leaf_key, leaf_values in grouped.items():
                flat_history[f"{name}_{leaf_key}"] = leaf_values
        else:
            flat_history[name] = values
    return flat_history
