"""A text form of hyperparameter values that every process computes alike, for the run fingerprint.

``auto_resume`` compares the fingerprint of this job's hyperparameters with the one a run recorded, often written
by another process (a requeued job, a restarted script). A ``repr`` does not do: a function's or a plain
object's names its memory address, which differs in every process, so the run would never be recognised as the
same. :func:`stable_json` writes each value by what it is instead:

* JSON values as JSON (so the fingerprint of plain hyperparameters is unchanged from earlier versions);
* tuples as lists, sets sorted, enums by name, paths as text, dataclasses by their fields,
  ``functools.partial`` by its function and arguments;
* numbers and arrays of numpy and torch by dtype, shape and values;
* functions, classes and methods defined at module level by their import path (``package.module.name``);
* any other object by its ``repr`` when that holds no memory address (``nn.Linear(in_features=4, ...)``,
  ``torch.device('cpu')``, a ``datetime``).

What remains (a lambda, a function defined inside another, an object whose ``repr`` is the default
``<Foo object at 0x...>``) has no stable form: :class:`UnstableValueError` names it.
"""
import dataclasses
import enum
import functools
import json
import pathlib
import re
import types
from typing import Any

# A repr with a memory address in it: "<Foo object at 0x7f...>", "<function f at 0x...>".
_MEMORY_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{6,}\b")


class UnstableValueError(TypeError):
    """A hyperparameter value has no form that is the same in every process (see :func:`stable_json`).

    Attributes:
        where: the value's place in the hyperparameters (``hyperparams['optim']['fn']``).
    """

    def __init__(self, where: str, value: Any):
        self.where = where
        super().__init__(
            f"{where} = {_short_repr(value)} (a {type(value).__module__}.{type(value).__qualname__}) has no value that "
            "is the same in every process: its repr holds a memory address, or it is a lambda or a function defined "
            "inside another. auto_resume compares the hyperparameters of this job with those a run recorded in "
            "another process, so pass a plain value instead (a number, a string such as the function's or the "
            "class's name, or the object's settings as a dict), or give the class a __repr__ that shows its "
            "settings")


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def stable_json(value: Any, where: str = "hyperparams") -> str:
    """``value`` as JSON text (keys sorted) that is the same in every process for equal values.

    Raises:
        UnstableValueError: some part of ``value`` has no such form; the error names where it is.
    """
    return json.dumps(_stable(value, where), sort_keys=True)


def _stable(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value  # NaN and infinity too: json.dumps writes them as NaN and Infinity
    if isinstance(value, enum.Enum):
        return f"{_import_path(type(value))}.{value.name}"
    if isinstance(value, dict):
        # Keys all strings, or all numbers, stay as they are (json.dumps sorts them, as earlier versions did);
        # mixed keys, which it cannot sort, become their JSON text.
        plain_keys = all(isinstance(key, str) for key in value) or all(
            isinstance(key, (int, float)) and not isinstance(key, bool) for key in value)
        return {key if plain_keys else stable_json(key, f"{where} key {key!r}"): _stable(item, f"{where}[{key!r}]")
                for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_stable(item, f"{where}[{index}]") for index, item in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        return sorted(json.dumps(_stable(item, f"{where} item"), sort_keys=True) for item in value)
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"dataclass": _import_path(type(value)),
                "fields": {field.name: _stable(getattr(value, field.name), f"{where}.{field.name}")
                           for field in dataclasses.fields(value)}}
    if isinstance(value, functools.partial):
        return {"partial": _stable(value.func, f"{where}.func"), "args": _stable(value.args, f"{where}.args"),
                "keywords": _stable(value.keywords, f"{where}.keywords")}
    array = _array_form(value, where)
    if array is not None:
        return array
    if isinstance(value, (type, types.ModuleType)) or callable(value) and hasattr(value, "__qualname__"):
        path = _named_path(value)
        if path is None:
            raise UnstableValueError(where, value)
        return {"object": path}
    text = repr(value)
    if _MEMORY_ADDRESS.search(text):
        raise UnstableValueError(where, value)
    return {"repr": text, "type": _import_path(type(value))}


def _array_form(value: Any, where: str) -> Any:
    """numpy and torch numbers and arrays by dtype, shape and values (their reprs abbreviate large arrays)."""
    module = type(value).__module__ or ""
    if module.startswith("torch") and hasattr(value, "detach") and hasattr(value, "tolist"):
        return {"tensor": str(value.dtype), "shape": list(value.shape),
                "values": _stable(value.detach().cpu().tolist(), where)}
    if module.startswith("numpy") and hasattr(value, "tolist") and hasattr(value, "dtype"):
        return {"ndarray": str(value.dtype), "shape": list(getattr(value, "shape", ())),
                "values": _stable(value.tolist(), where)}
    return None


def _import_path(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def _named_path(value: Any) -> Any:
    """``module.qualname`` of a function, class, module or method reachable by name; None for one that is not
    (a lambda, a function defined inside another)."""
    if isinstance(value, types.ModuleType):
        return value.__name__
    if isinstance(value, (types.MethodType, types.BuiltinMethodType)) and not isinstance(
            getattr(value, "__self__", None), (type, types.ModuleType, type(None))):
        owner = value.__self__
        try:  # a bound method: the object it is bound to must have a stable form too
            return [_stable(owner, "method owner"), getattr(value, "__name__", "")]
        except UnstableValueError:
            return None
    qualname = getattr(value, "__qualname__", None)
    module = getattr(value, "__module__", None)
    if not isinstance(qualname, str) or "<lambda>" in qualname or "<locals>" in qualname:
        return None
    if module is None:
        owner = getattr(value, "__self__", None)  # a builtin method of a class, e.g. torch.tanh
        module = getattr(owner, "__name__", None) if isinstance(owner, types.ModuleType) else None
        if module is None:
            return None
    return f"{module}.{qualname}"

