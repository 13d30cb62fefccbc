"""O3/O2's cast of a forward's inputs touches floating-point tensors only (token ids, labels and masks pass as they
are). Written for the mutation run (tests/mutation/): this mutant survived the rest of its selection."""
import collections

import torch

from aitoolbox.torchtrain.precision.model_cast import cast_floating

Batch = collections.namedtuple("Batch", "ids features")


def test_only_floating_point_tensors_are_cast_in_nested_inputs():
    ids = torch.tensor([[3, 1, 4]])
    mask = torch.tensor([True, False])
    already = torch.ones(2, dtype=torch.bfloat16)
    value = {"batch": Batch(ids, torch.ones(2, 3)), "rest": [mask, (already, 7)]}
    cast = cast_floating(value, torch.bfloat16)
    assert cast["batch"].ids is ids and cast["batch"].features.dtype == torch.bfloat16
    assert isinstance(cast["batch"], Batch)
    assert cast["rest"][0] is mask and cast["rest"][1][0] is already and cast["rest"][1][1] == 7
