"""A copy of a run's state in host memory that shares nothing with the live run: below the loop and the callbacks,
which both keep such copies (the loop's snapshots, SpikeRollback's point at a fit's start)."""
import collections
import copy
from typing import Any

import torch


def host_copy(value: Any) -> Any:
    """``value`` with every tensor copied to the CPU (containers copied recursively, other objects deep-copied):
    nothing in the copy shares memory with the live run, which goes on changing its tensors in place."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        copied = type(value)() if type(value) in (dict, collections.OrderedDict) else {}
        for key, item in value.items():
            copied[key] = host_copy(item)
        if hasattr(value, "_metadata"):  # a module's state dict: the versions load_state_dict reads
            copied._metadata = copy.deepcopy(value._metadata)
        return copied
    if isinstance(value, list):
        return [host_copy(item) for item in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(host_copy(item) for item in value)
    return copy.deepcopy(value)
