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


def test_a_forward_caster_survives_pickling_with_its_settings():
    """``torch.save(model)`` and spawned processes pickle a prepared model's hooks: the caster comes back with its
    dtypes and a fresh per-thread autocast stack, and casts as before."""
    import pickle
    from torch import nn
    from aitoolbox.torchtrain.precision.model_cast import ForwardCaster
    caster = pickle.loads(pickle.dumps(ForwardCaster(torch.bfloat16, torch.float32, "cpu", torch.bfloat16)))
    assert (caster.input_dtype, caster.output_dtype, caster.autocast_device_type, caster.autocast_dtype) == (
        torch.bfloat16, torch.float32, "cpu", torch.bfloat16)
    model = nn.Linear(3, 2).to(torch.bfloat16)
    caster.attach(model)
    output = model(torch.ones(1, 3))
    assert output.dtype == torch.float32 and caster._autocast_stack() == []
