"""dict_util: merging per-batch metadata, flattening nested dicts, and the flattened history export."""
import numpy as np
import pytest
import torch

from aitoolbox.utils.dict_util import (combine_dict_elements, combine_prediction_metadata_batches,
                                       flatten_combine_dict, flatten_dict)


def test_metadata_batches_concatenate_per_type_and_tolerate_missing_keys():
    batches = [
        {"ids": [1, 2], "emb": torch.ones(2, 3), "mask": np.zeros((2, 4)), "extra": ["a"]},
        {"ids": [3], "emb": torch.zeros(1, 3), "mask": np.ones((1, 4))},
    ]
    combined = combine_prediction_metadata_batches(batches)
    assert combined["ids"] == [1, 2, 3] and combined["extra"] == ["a"]
    assert isinstance(combined["emb"], torch.Tensor) and combined["emb"].shape == (3, 3)
    assert combined["emb"][2].sum() == 0
    assert isinstance(combined["mask"], np.ndarray) and combined["mask"].shape == (3, 4)


@pytest.mark.parametrize("bad", ["text", 3, 1.5, {"k": "v"}])
def test_metadata_of_an_unsupported_type_is_a_type_error(bad):
    with pytest.raises(TypeError, match="'bad'"):
        combine_prediction_metadata_batches([{"bad": bad}, {"bad": bad}])


def test_flatten_dict_joins_keys_of_every_level():
    nested = {"acc": 0.9, "f1": {"cat": 0.5, "dog": {"big": 0.1, "small": 0.2}}}
    assert flatten_dict(nested) == {"acc": 0.9, "f1_cat": 0.5, "f1_dog_big": 0.1, "f1_dog_small": 0.2}
    assert flatten_dict(nested, sep="/") == {"acc": 0.9, "f1/cat": 0.5, "f1/dog/big": 0.1, "f1/dog/small": 0.2}
    assert nested["f1"]["dog"] == {"big": 0.1, "small": 0.2}  # input untouched


def test_combine_dict_elements_groups_values_by_key_in_order():
    assert combine_dict_elements([{"a": 1, "b": 2}, {"b": 3}, {"a": 4, "c": 5}]) == {
        "a": [1, 4], "b": [2, 3], "c": [5]}


def test_flatten_combine_dict_splits_grouped_metrics_and_keeps_the_rest():
    history = {"loss": [1.0, 0.5], "accumulated_loss": [], "val_loss": [2, 1],
               "rouge": [{"r1": 0.1, "r2": {"p": 1}}, {"r1": 0.3, "r2": {"p": 2}, "new": 7}]}
    flat = flatten_combine_dict(history)
    assert flat == {"loss": [1.0, 0.5], "val_loss": [2, 1],  # no values yet: left out, as in 1.x
                    "rouge_r1": [0.1, 0.3], "rouge_r2_p": [1, 2], "rouge_new": [7]}
    flat["loss"].append(9)
    assert history["loss"] == [1.0, 0.5]  # the result is a copy
