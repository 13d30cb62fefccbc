"""Several validation sets: ``TrainLoop(validation_loader={'in_domain': dl1, 'shifted': dl2})``.

A dict of named loaders is evaluated set by set. Each set's values go into the training history under its own
names: ``val_<name>_loss`` (``val_<name>_loss_<loss name>`` for a MultiLoss) and ``val_<name>_<metric>`` from
metric callbacks. The first set (in the dict's order) also fills the plain ``val_loss`` / ``val_<metric>``
names, so that presets, ``EarlyStopping(monitor='val_loss')`` and aitoolbox 1.x code work as with one loader.
The loop's 1.x methods (``evaluate_loss_on_validation_set``, ``predict_on_validation_set``) answer for the first
set, or for the set their ``name=`` keyword picks.

A single loader stays what it was: no name, the plain ``val_`` names only.
"""
import re
from collections.abc import Mapping
from typing import Any, Optional, Tuple

import torch

from aitoolbox.torchtrain.data.validation_names import (  # noqa: F401 (importable from here as before)
    history_prefix, history_prefixes, validation_set_names)
from aitoolbox.torchtrain.train_loop.validation import check_loader, is_batch_iterable

# Letters, digits, '_' and '-': such names are safe in file names (history plots), CSV columns and the keys of
# every tracker (MLflow, W&B, TensorBoard), and they cannot split a history key in unexpected places.
_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
_NAME_RULE = ("a validation set's name is made of letters, digits, '_' and '-' and starts with a letter or digit "
              "(e.g. 'in_domain', 'shifted-2023')")

# The dataset type of the loop's validation data, as in ``evaluate_loss_on_validation_set``.
VALIDATION = "validation"


def _check_name(name: Any, names_seen: dict) -> None:
    if not isinstance(name, str):
        raise TypeError(f"validation_loader is a dict of named validation sets, and its keys must be strings (the "
                        f"sets' names); got the key {name!r} of type {type(name).__name__}")
    if not _NAME_PATTERN.fullmatch(name):
        raise ValueError(f"validation set name {name!r} cannot name history keys (val_<name>_loss): {_NAME_RULE}")
    if name == "loss" or name.startswith("loss_"):
        # 'val_loss_...' are the first set's MultiLoss entries (val_loss_<loss name>): the keys would collide.
        raise ValueError(f"validation set name {name!r} would give keys such as 'val_{name}_loss' that read as the "
                         "loss entries of the plain val_loss (val_loss_<loss name>); choose a name that does not start "
                         "with 'loss'")
    folded = name.lower()
    if folded in names_seen:
        # History plots and CSV logs become files and columns: 'Shifted' and 'shifted' clash on many file systems.
        raise ValueError(f"validation set names {names_seen[folded]!r} and {name!r} differ only in case; their files "
                         "and tracker keys would clash. Rename one of them.")
    names_seen[folded] = name


def check_validation_loader(loader: Any) -> None:
    """Check ``validation_loader``: None, one loader, or a non-empty dict of named loaders.

    Raises:
        TypeError: a key that is not a string, a value that is not a loader, or a list of DataLoaders (the message
            shows the dict to write instead).
        ValueError: an empty dict, an empty loader (len 0), or a name that cannot name history keys.
    """
    if not isinstance(loader, Mapping):
        check_loader(loader, "validation_loader")
        return
    if len(loader) == 0:
        raise ValueError("validation_loader is an empty dict: give at least one named loader, e.g. "
                         "{'in_domain': loader}, or None for no validation")
    names_seen: dict = {}
    for name, value in loader.items():
        _check_name(name, names_seen)
        where = f"validation_loader[{name!r}]"
        if value is None:
            raise TypeError(f"{where} is None: leave a set without a loader out of the dict")
        if isinstance(value, (str, bytes, Mapping)) or not is_batch_iterable(value):
            hint = (" It looks like a Dataset: wrap it as DataLoader(dataset, batch_size=...)."
                    if hasattr(value, "__getitem__") and not isinstance(value, (str, bytes, Mapping)) else "")
            nested = " Nested dicts are not supported: give every set its own name at the top level." \
                if isinstance(value, Mapping) else ""
            raise TypeError(f"{where} must be an iterable of batches such as a DataLoader, got "
                            f"{type(value).__name__}.{hint}{nested}")
        if isinstance(value, torch.Tensor):
            raise TypeError(f"{where} is a tensor: wrap the data in a DataLoader")
        check_loader(value, where)  # e.g. an empty set, which would fail only after the first epoch's training


def select_validation_set(loader: Any, name: Optional[str]) -> Tuple[str, Optional[str], Any]:
    """``(dataset key, set name, loader)`` of the validation set ``name`` (None: the only loader, whose name is
    None, or the first set of a dict).

    The key names the set in the loop's caches and progress bars: ``'validation'`` for a single loader,
    ``'validation:<name>'`` for a named set.

    Raises:
        ValueError: there is no validation loader, ``name`` is not one of the sets, or a name is given for a
            single loader.
    """
    if loader is None:
        raise ValueError("this TrainLoop has no validation_loader: pass one to the constructor")
    names = validation_set_names(loader)
    if names is None:
        if name is not None:
            raise ValueError(f"name={name!r} picks one of several named validation sets, but validation_loader is a "
                             "single loader: leave name out, or pass validation_loader={'name': loader, ...}")
        return VALIDATION, None, loader
    if name is None:
        name = names[0]
    elif name not in loader:
        raise ValueError(f"there is no validation set named {name!r}; the validation sets are {names}")
    return f"{VALIDATION}:{name}", name, loader[name]
