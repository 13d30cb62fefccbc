"""torch_compile on a CUDA GPU with inductor (Triton kernels): float16 with loss scaling, bfloat16, O2."""
import pytest
import torch
import torch._dynamo

from tests.torchtrain.compiling.test_train_loop_compile import (
    CompileCountPerEpoch, RecordSkippedSteps, assert_params_close, build)
from tests.torchtrain.train_loop.resume_workflow import InjectOverflow

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("use_amp", [True, {"opt_level": "O1", "dtype": torch.bfloat16}, {"opt_level": "O2"}],
                         ids=["float16-scaled", "bfloat16", "O2"])
def test_inductor_on_cuda_equals_eager_and_compiles_only_in_the_first_epoch(use_amp):
    eager = build(False, use_amp)
    eager.fit(num_epochs=3)
    tl = build(True, use_amp)
    counts = CompileCountPerEpoch()
    tl.fit(num_epochs=3, callbacks=[counts])
    assert tl.device.type == "cuda" and next(tl.model.parameters()).is_cuda
    assert_params_close(tl.model, eager.model, rtol=2e-2, atol=2e-2)
    assert counts.compiles == [counts.compiles[0]] * 3 and counts.compiles[0] > 0
    assert not tl._compiler.model_call.eager_only
    assert [step.eager_only for step in tl._compiler.optimizer_steps] == [False]


def test_float16_overflow_skips_the_compiled_step_on_cuda():
    results = []
    for torch_compile in (False, True):
        tl = build(torch_compile, {"opt_level": "O1", "dtype": torch.float16, "loss_scale": "dynamic"})
        skipped = RecordSkippedSteps()
        tl.fit(num_epochs=2, callbacks=[InjectOverflow(), skipped])
        results.append((tl, skipped.skipped))
    (eager, eager_skipped), (compiled, compiled_skipped) = results
    assert compiled_skipped == eager_skipped and compiled_skipped[2]
    assert compiled.precision.loss_scaler.state_dict() == eager.precision.loss_scaler.state_dict()
    assert_params_close(compiled.model, eager.model, rtol=2e-2, atol=2e-2)
