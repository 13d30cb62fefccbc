"""stable_json: equal values give the same text in any process and in any key order; differing plain values
differ; what has no stable form is named."""
import json

import pytest
from hypothesis import given, settings, strategies as st

from aitoolbox.experiment.local_save.stable_value import UnstableValueError, stable_json

plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text(max_size=6), plain, max_size=6))
def test_plain_values_are_written_as_json_in_any_key_order(hyperparams):
    text = stable_json(hyperparams)
    assert text == json.dumps(hyperparams, sort_keys=True)  # the form earlier versions fingerprinted
    assert stable_json(dict(reversed(list(hyperparams.items())))) == text
    assert json.loads(text) == json.loads(json.dumps(hyperparams))


@settings(max_examples=150, deadline=None)
@given(plain, plain)
def test_differing_plain_values_give_differing_text(a, b):
    if json.dumps(a, sort_keys=True) != json.dumps(b, sort_keys=True):
        assert stable_json(a) != stable_json(b)


@settings(max_examples=100, deadline=None)
@given(st.sets(st.integers() | st.text(max_size=4), max_size=6))
def test_sets_do_not_depend_on_their_iteration_order(values):
    assert stable_json({"s": set(values)}) == stable_json({"s": frozenset(sorted(values, key=repr, reverse=True))})


def test_mixed_keys_that_json_cannot_sort_are_written_too():
    assert stable_json({1: "a", "1": "b"}) == stable_json({"1": "b", 1: "a"})
    assert stable_json({1: "a", "1": "b"}) != stable_json({1: "b", "1": "a"})


def test_objects_are_written_by_what_they_are_not_where_they_are():
    import torch
    from torch import nn
    assert stable_json({"m": nn.Linear(4, 2)}) == stable_json({"m": nn.Linear(4, 2)})
    assert stable_json({"m": nn.Linear(4, 2)}) != stable_json({"m": nn.Linear(4, 3)})
    assert stable_json({"f": torch.tanh}) != stable_json({"f": torch.sigmoid})
    assert stable_json({"t": torch.arange(3)}) != stable_json({"t": torch.arange(3.0)})
    assert "0x" not in stable_json({"f": torch.tanh, "c": nn.MSELoss, "o": nn.MSELoss()})


def test_a_part_without_a_stable_form_is_named():
    def local_function():
        return 1

    with pytest.raises(UnstableValueError) as error:
        stable_json({"a": [{"b": local_function}]})
    assert error.value.where == "hyperparams['a'][0]['b']"
    assert isinstance(error.value, TypeError)
