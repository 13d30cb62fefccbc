"""Function introspection and list helpers."""
import dis
import functools
import types
from typing import Any, Callable, Iterable, List, Optional


def function_exists(object_to_check: Any, fn_name: str) -> bool:
    """Tell whether ``object_to_check`` has a callable attribute called ``fn_name``.

    Args:
        object_to_check: the object to look in.
        fn_name: the name of the method / function attribute.

    Returns:
        True when the attribute exists and is callable (a plain data attribute of that name gives False).
    """
    return callable(getattr(object_to_check, fn_name, None))


def copy_function(fn: Callable) -> types.FunctionType:
    """Make an independent copy of a function, e.g. to attach one object's method to another object.

    A bound method is copied as its underlying function, so the copy takes ``self`` as its first argument
    and can be called with any object that has the attributes the function uses.

    Args:
        fn: a function or a bound method.

    Returns:
        A new function object with the same code, globals, defaults, closure and metadata.
    """
    fn = getattr(fn, "__func__", fn)
    fn_copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    # update_wrapper copies __doc__, __qualname__, __module__ and __dict__ (and sets __wrapped__).
    fn_copy = functools.update_wrapper(fn_copy, fn)
    fn_copy.__kwdefaults__ = None if fn.__kwdefaults__ is None else dict(fn.__kwdefaults__)
    return fn_copy


# Opcodes that carry no behaviour: frame set-up and padding. RESUME exists from Python 3.11.
_NO_OP_OPCODES = {"RESUME", "NOP", "CACHE"}


def is_empty_function(fn: Callable) -> bool:
    """Tell whether a function does nothing: its body is only ``pass``, a docstring, or ``return None``.

    The check reads the bytecode, so it also works for lambdas and for functions whose source is unavailable.
    The callback handler uses it to skip hooks a callback did not really implement.

    Args:
        fn: a function, lambda or bound method.

    Returns:
        True if calling ``fn`` could do nothing but return None.
    """
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    instructions = [ins for ins in dis.get_instructions(code) if ins.opname not in _NO_OP_OPCODES]
    # Python 3.12+ compiles an empty body to RETURN_CONST None; older versions to LOAD_CONST None, RETURN_VALUE.
    if len(instructions) == 1:
        ins = instructions[0]
        return ins.opname == "RETURN_CONST" and ins.argval is None
    if len(instructions) == 2:
        load, ret = instructions
        return load.opname == "LOAD_CONST" and load.argval is None and ret.opname == "RETURN_VALUE"
    return False


def flatten_list_of_lists(nested_list: Optional[Iterable[Iterable[Any]]]) -> Optional[List[Any]]:
    """Concatenate the sub-lists of a list into one list (one level only).

    Args:
        nested_list: a list of lists, or None.

    Returns:
        The elements of all sub-lists in order, or None when ``nested_list`` is None.
    """
    if nested_list is None:
        return None
    return [element for sub_list in nested_list for element in sub_list]
