"""util: function introspection (exists, copy, is-empty) and list flattening."""
import pytest

from aitoolbox.utils.util import copy_function, flatten_list_of_lists, function_exists, is_empty_function


class _Source:
    scale = 2

    def double(self, x, *, offset=0):
        return x * self.scale + offset


class _Target:
    scale = 10


def test_function_exists_needs_a_callable_attribute():
    obj = _Source()
    assert function_exists(obj, "double")
    assert not function_exists(obj, "scale") and not function_exists(obj, "missing")


def test_copied_method_runs_against_another_object():
    copied = copy_function(_Source().double)
    assert copied is not _Source.double and copied.__name__ == "double"
    assert copied(_Target(), 3) == 30 and copied(_Target(), 3, offset=1) == 31


def _empty():
    pass


def _empty_documented():
    """Only a docstring."""


def _returns_value():
    return "value"


def _prints():
    print("x")


class _Hooks:
    def hook(self):
        pass

    def real_hook(self):
        return self


@pytest.mark.parametrize("fn, expected", [
    (_empty, True), (_empty_documented, True), (lambda: None, True), (_Hooks().hook, True),
    (_returns_value, False), (_prints, False), (lambda a: a, False), (_Hooks().real_hook, False),
])
def test_is_empty_function(fn, expected):
    assert is_empty_function(fn) is expected


def test_flatten_list_of_lists_goes_one_level_deep():
    assert flatten_list_of_lists([[1, 2], [], [[3]]]) == [1, 2, [3]]
    assert flatten_list_of_lists(None) is None
