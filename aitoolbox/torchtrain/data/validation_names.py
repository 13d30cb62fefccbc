"""The names several validation sets are recorded under (see :mod:`aitoolbox.torchtrain.train_loop.validation_sets`):
shared by the loop and the metric callbacks, below both."""
from collections.abc import Mapping
from typing import Any, List, Optional, Tuple


def validation_set_names(loader: Any) -> Optional[List[str]]:
    """The names of the validation sets, in order, for a dict of loaders; None for one loader (or none)."""
    return list(loader) if isinstance(loader, Mapping) else None


def history_prefix(name: Optional[str]) -> str:
    """The prefix of a validation set's history keys: ``'val_'`` for a single loader, ``'val_<name>_'``."""
    return "val_" if name is None else f"val_{name}_"


def history_prefixes(loader: Any) -> List[Tuple[Optional[str], List[str]]]:
    """``(set name, prefixes its values are recorded under)`` for every validation set, in order: the first set
    of a dict is recorded under ``'val_'`` too."""
    names = validation_set_names(loader)
    if names is None:
        return [(None, ["val_"])]
    return [(name, (["val_"] if index == 0 else []) + [history_prefix(name)]) for index, name in enumerate(names)]
