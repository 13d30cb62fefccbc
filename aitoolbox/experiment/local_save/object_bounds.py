"""Bounds on what a pickle from storage built, and the names a refused pickle gives (for its error).

:func:`check_shape` walks what :class:`~aitoolbox.experiment.local_save.restricted_pickle.RestrictedUnpickler`
built, without recursion: containers nested deeper than a bound, a container that contains itself, or a structure
whose walk would meet more objects than a bound (a few hundred bytes of pickle can reference one list from more
places than a program could ever visit) are refused with
:class:`~aitoolbox.experiment.local_save.restricted_pickle.Malformed`.
"""
import argparse
import collections
from typing import Any, Dict, List, Optional, Tuple

from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING

from aitoolbox.experiment.local_save.restricted_pickle import Malformed


def _children(value: Any) -> Optional[list]:
    kind = type(value)
    if kind in (list, tuple, set, frozenset):
        return list(value)
    if kind in (dict, collections.OrderedDict, collections.Counter):
        return [item for pair in value.items() for item in pair] + list(getattr(value, "__dict__", {}).values())
    if kind is argparse.Namespace:
        return list(vars(value).values())
    return None


def check_shape(value: Any, max_depth: int, max_visits: int) -> None:
    """Raise :class:`Malformed` when ``value`` (a loaded object) nests containers deeper than ``max_depth``, holds
    a container that contains itself, or when walking it, a shared container once per place it is referenced,
    would meet more than ``max_visits`` objects (a few hundred bytes of pickle can describe a DAG whose walk never
    ends)."""
    visits: Dict[int, int] = {}  # id -> objects a walk from it meets; absent: not done
    depth: Dict[int, int] = {}
    on_path = set()
    stack: List[Tuple[Any, bool]] = [(value, False)]
    while stack:
        node, done = stack.pop()
        children = _children(node)
        key = id(node)
        if children is None:
            continue
        if done:
            on_path.discard(key)
            inner = [child for child in children if _children(child) is not None]
            visits[key] = 1 + len(children) + sum(visits[id(child)] - 1 for child in inner)
            depth[key] = 1 + max((depth[id(child)] for child in inner), default=0)
            if depth[key] > max_depth:
                raise Malformed(f"containers nest {depth[key]} deep, more than {max_depth}")
            if visits[key] > max_visits:
                raise Malformed(f"walking it would meet over {max_visits} objects (containers referenced from "
                                "many places)")
            continue
        if key in visits:
            continue
        if key in on_path:
            raise Malformed("a container contains itself")
        on_path.add(key)
        stack.append((node, True))
        if len(on_path) > max_depth:
            raise Malformed(f"containers nest more than {max_depth} deep")
        for child in children:
            if _children(child) is not None:
                if id(child) in on_path:
                    raise Malformed("a container contains itself")
                if id(child) not in visits:
                    stack.append((child, False))


_MARK = object()
_UNKNOWN = object()


def refused_names(data: bytes) -> List[str]:
    """Every global a pickle names (best effort, without building anything): what a refusal lists.

    The pickle's stack is followed with placeholders, keeping only strings and the memo, so that a
    ``STACK_GLOBAL`` names exactly the two strings it takes (which may come from the memo), never a guess.
    """
    import pickletools

    names: List[str] = []
    stack: list = []
    memo: Dict[Any, Any] = {}
    try:
        for opcode, argument, _ in pickletools.genops(bytes(data)):
            name = opcode.name
            if name in ("GLOBAL", "INST"):
                module, _, attribute = str(argument).partition(" ")
                if (module, attribute) in NAME_MAPPING:  # Python 2's names, as the reader maps them
                    module, attribute = NAME_MAPPING[(module, attribute)]
                names.append(f"{IMPORT_MAPPING.get(module, module)}.{attribute}")
            elif name == "STACK_GLOBAL" and len(stack) >= 2 and all(type(item) is str for item in stack[-2:]):
                names.append(f"{stack[-2]}.{stack[-1]}")
            if name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
                memo[len(memo) if name == "MEMOIZE" else argument] = stack[-1]
                continue
            if name in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo.get(argument, _UNKNOWN))
                continue
            before = opcode.stack_before
            if pickletools.markobject in before:  # pops down to the mark, then what lies below it
                while stack.pop() is not _MARK:
                    pass
                del stack[len(stack) - before.index(pickletools.markobject):]
            elif before:
                del stack[len(stack) - len(before):]
            for kind in opcode.stack_after:
                if kind is pickletools.markobject:
                    stack.append(_MARK)
                else:
                    stack.append(argument if isinstance(argument, str) and kind is pickletools.pyunicode
                                 else _UNKNOWN)
    except Exception:  # noqa: BLE001 - a damaged tail: what was found before it is the answer
        pass
    return list(dict.fromkeys(names))
