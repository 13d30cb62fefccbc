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


def test_the_state_dict_of_a_cast_model_upcasts_only_its_low_precision_tensors():
    """A checkpoint of an O2/O3 model holds float32 for its bfloat16/float16 tensors and every other entry as the
    model has it: BatchNorm's step count stays an integer (``momentum=None`` averages by it, a float32 count rounds
    past 2**24), a float64 buffer keeps its bits. Written for the mutation run: the check's ``and`` turned ``or``
    made every tensor float32."""
    from torch import nn
    from aitoolbox.torchtrain.precision.model_cast import cast_model, register_upcast_state_dict

    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=None))
    cast_model(model, torch.bfloat16, keep_batchnorm_fp32=False)
    model.register_buffer("exact", torch.tensor([1.0 + 2.0 ** -40], dtype=torch.float64))  # (one added after)
    model[1].num_batches_tracked.fill_(2 ** 24 + 1)
    register_upcast_state_dict(model)
    state = model.state_dict()
    assert state["0.weight"].dtype == state["1.running_mean"].dtype == torch.float32
    assert torch.equal(state["0.weight"], model[0].weight.float())
    assert state["1.num_batches_tracked"].dtype == torch.int64
    assert state["1.num_batches_tracked"].item() == 2 ** 24 + 1
    assert state["exact"].dtype == torch.float64 and state["exact"].item() == 1.0 + 2.0 ** -40
