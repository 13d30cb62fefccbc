"""TrainLoop(torch_compile=...): compiled training equals eager training, and compiles once.

The tests compile with ``backend='aot_eager'`` (dynamo and AOT autograd, no C++ compile: seconds); one test
compiles with inductor and is marked slow. Tolerances: aot_eager runs the same aten ops as eager, but AOT
autograd's decompositions may order a reduction differently, so compiled and eager parameters agree to float32
rounding accumulated over the run (rtol 1e-4 in float32); under bfloat16 autocast a rounding difference in one
activation can move a parameter by a bfloat16 step, so those runs agree to 2e-2. Compiling is counted with
``torch._dynamo.utils.counters`` as well as with ``tl.compile_stats``.
"""
import copy
import logging
import pickle

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.gradient import GradNormClip
from aitoolbox.torchtrain.model import ModelWrap
from aitoolbox.torchtrain.schedulers.basic import GeneralLRSchedulerCallback, LambdaLRScheduler
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import (
    MLP, ClassifierFeedDefinition, IN_FEATURES, NUM_CLASSES, SCALER_ARGS, classification_data, distinct_records,
    seeded_loader, single_torch_thread)
from tests.torchtrain.train_loop.resume_workflow import InjectOverflow

AOT_EAGER = {"backend": "aot_eager"}
SAMPLES = 30  # batches of 8: the last one has 6 samples

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts from empty dynamo caches: counts and recompile limits are then the test's own."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def frames_compiled() -> int:
    """Frames dynamo has compiled in this process since the test began."""
    return counters["frames"]["total"]


class CompileCountPerEpoch(AbstractCallback):
    """Records dynamo's compiled-frame count and the loop's compile count at every epoch end."""

    def __init__(self):
        super().__init__("compile counts")
        self.frames = []
        self.compiles = []

    def on_epoch_end(self):
        self.frames.append(frames_compiled())
        self.compiles.append(self.train_loop_obj.compile_stats.compiles)


def warmup_factor(step: int) -> float:
    """A per-step warm-up: the learning rate changes at every optimizer step of the first 20."""
    return min(1.0, (step + 1) / 20)


def build(torch_compile, use_amp=False, model=None, optimizer_class=torch.optim.AdamW, samples=SAMPLES, **kwargs):
    torch.manual_seed(0)
    model = model if model is not None else MLP(dropout=0.0)
    optimizer = optimizer_class((model.model if isinstance(model, ModelWrap) else model).parameters(), lr=1e-2)
    return TrainLoop(model, seeded_loader(classification_data(samples)), seeded_loader(classification_data(12, 3)),
                     None, optimizer, nn.CrossEntropyLoss(), use_amp=use_amp, torch_compile=torch_compile,
                     show_progress=False, **kwargs)


def assert_params_close(model_a: nn.Module, model_b: nn.Module, rtol: float, atol: float) -> None:
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    assert list(state_a) == list(state_b)
    for name in state_a:
        torch.testing.assert_close(state_a[name].float(), state_b[name].float(), rtol=rtol, atol=atol, msg=name)


USE_AMP_MODES = {
    "fp32": False,
    "use_amp=True": True,
    "O1": {"opt_level": "O1"},
    "O2": {"opt_level": "O2"},
    "O3": {"opt_level": "O3"},
    "O1-dynamic-scale": {"opt_level": "O1", "loss_scale": "dynamic"},
    "O1-float16": {"opt_level": "O1", "dtype": torch.float16},
    "GradScaler-dict": SCALER_ARGS,
}


@pytest.mark.parametrize("use_amp", list(USE_AMP_MODES.values()), ids=list(USE_AMP_MODES))
def test_compiled_training_equals_eager_and_compiles_only_in_the_first_epoch(use_amp):
    """Per-step warm-up scheduler (the learning rate changes every step), a smaller last batch, evaluation at
    every epoch end (train and eval mode, no_grad): everything compiles in the first epoch, nothing after."""
    def scheduler():
        return LambdaLRScheduler(warmup_factor, execute_epoch_end=False, execute_batch_end=True)

    eager = build(False, use_amp)
    eager.fit(num_epochs=4, callbacks=[scheduler()])
    tl = build(AOT_EAGER, use_amp)
    counts = CompileCountPerEpoch()
    tl.fit(num_epochs=4, callbacks=[scheduler(), counts])

    tolerance = 1e-4 if use_amp is False else 2e-2  # every other mode computes in bfloat16
    assert_params_close(tl.model, eager.model, rtol=tolerance, atol=tolerance)
    assert counts.frames[0] > 0
    assert counts.frames == [counts.frames[0]] * 4, "dynamo compiled frames after the first epoch"
    assert counts.compiles == [counts.compiles[0]] * 4
    assert tl.compile_stats.compiles_since(1) == []
    # The forward (train mode, its backward, eval mode under no_grad) and the optimizer step.
    assert tl.compile_stats.compiles >= 3 and tl.compile_stats.recompiles >= 1
    assert not tl._compiler.model_call.eager_only
    assert [step.eager_only for step in tl._compiler.optimizer_steps] == [False]
    # The learning rate the user, the scheduler and the checkpoints see stays a float.
    assert isinstance(tl.optimizer.param_groups[0]["lr"], float)
    assert tl.optimizer.param_groups[0]["lr"] == eager.optimizer.param_groups[0]["lr"]


def test_state_dict_keys_are_the_models_own():
    eager, compiled = build(False), build(AOT_EAGER)
    compiled.fit(num_epochs=1)
    assert list(compiled.model.state_dict()) == list(eager.model.state_dict())
    assert not any("_orig_mod" in key for key in compiled.model.state_dict())
    assert compiled.model is compiled.model_for_user


class RecordingBackend:
    """A torch.compile backend that keeps every graph it is given and runs it as it is."""

    def __init__(self):
        self.graphs = []

    def __call__(self, graph_module, example_inputs):
        self.graphs.append(graph_module)
        return graph_module.forward

    def targets(self) -> list:
        return [[str(node.target) for node in graph.graph.nodes if node.op in ("call_function", "call_method")]
                for graph in self.graphs]


def test_the_optimizer_step_is_compiled_even_with_a_torch_lr_scheduler_attached():
    """A torch LR scheduler wraps optimizer.step in a function dynamo does not trace: the class step is compiled."""
    backend = RecordingBackend()
    tl = build({"backend": backend})
    tl.fit(num_epochs=2, callbacks=[LambdaLRScheduler(warmup_factor, execute_epoch_end=False,
                                                      execute_batch_end=True)])
    graphs = backend.targets()
    assert any(any("linear" in target or "addmm" in target for target in graph) for graph in graphs)
    # AdamW's update (exp_avg.lerp_, addcdiv_) traced into a graph of its own.
    assert any(any("lerp" in target for target in graph) and any("addcdiv" in target for target in graph)
               for graph in graphs)


def one_cycle(**kwargs):
    return GeneralLRSchedulerCallback(torch.optim.lr_scheduler.OneCycleLR, max_lr=0.05, total_steps=20,
                                      step_per_optimizer_step=True, **kwargs)


def test_one_cycle_with_adamw_cycles_lr_and_betas_without_recompiling():
    eager, tl = build(False), build(AOT_EAGER)
    eager.fit(num_epochs=4, callbacks=[one_cycle()])
    counts = CompileCountPerEpoch()
    tl.fit(num_epochs=4, callbacks=[one_cycle(), counts])
    assert_params_close(tl.model, eager.model, rtol=1e-4, atol=1e-4)
    assert counts.frames == [counts.frames[0]] * 4
    assert tl.optimizer.param_groups[0]["betas"] == eager.optimizer.param_groups[0]["betas"]
    assert all(isinstance(beta, float) for beta in tl.optimizer.param_groups[0]["betas"])


def test_a_cycling_sgd_momentum_makes_the_step_run_uncompiled_with_a_warning():
    """torch's SGD cannot take its momentum as a tensor: every change would recompile the step."""
    eager = build(False, optimizer_class=torch.optim.SGD)
    eager.fit(num_epochs=3, callbacks=[one_cycle()])
    tl = build(AOT_EAGER, optimizer_class=torch.optim.SGD)
    with pytest.warns(RuntimeWarning, match="SGD's 'momentum' changed at 4 steps.*cycle_momentum=False"):
        tl.fit(num_epochs=3, callbacks=[one_cycle()])
    assert tl._compiler.optimizer_steps[0].eager_only
    assert_params_close(tl.model, eager.model, rtol=1e-4, atol=1e-4)
    assert not tl.compile_stats.recompile_limit_reached


def test_a_modelwrap_around_nn_sequential_is_compiled():
    """nn.Module.compile() compiles nothing for a module whose forward is torch's own; TrainLoop's does."""
    torch.manual_seed(0)
    network = nn.Sequential(nn.Linear(IN_FEATURES, 16), nn.ReLU(), nn.Linear(16, NUM_CLASSES))
    backend = RecordingBackend()
    tl = build({"backend": backend, "optimizer_step": False},
               model=ModelWrap(network, ClassifierFeedDefinition()))
    tl.fit(num_epochs=1)
    assert any(sum("linear" in target or "addmm" in target for target in graph) == 2 for graph in backend.targets())
    assert tl.model is network and list(network.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_fit_again_compiles_nothing_new():
    tl = build(AOT_EAGER)
    tl.fit(num_epochs=2)
    frames, compiles = frames_compiled(), tl.compile_stats.compiles
    tl.fit(num_epochs=4)
    assert (frames_compiled(), tl.compile_stats.compiles) == (frames, compiles)


def test_evaluation_after_training_uses_the_compiled_graphs_and_matches_eager():
    eager, tl = build(False), build(AOT_EAGER)
    eager.fit(num_epochs=2)
    tl.fit(num_epochs=2)
    frames = frames_compiled()
    assert float(tl.evaluate_loss_on_validation_set()) == pytest.approx(
        float(eager.evaluate_loss_on_validation_set()), rel=1e-4)
    predicted, targets, _ = tl.predict_on_validation_set()
    assert torch.equal(predicted, eager.predict_on_validation_set()[0])
    assert frames_compiled() == frames


def test_grad_accumulation_and_gradient_clipping_equal_eager():
    eager, tl = build(False), build(AOT_EAGER)
    eager.fit(num_epochs=3, grad_accumulation=2, callbacks=[GradNormClip(0.5)])
    tl.fit(num_epochs=3, grad_accumulation=2, callbacks=[GradNormClip(0.5)])
    assert_params_close(tl.model, eager.model, rtol=1e-4, atol=1e-4)
    assert tl.compile_stats.compiles_since(1) == []


def test_several_optimizers_and_sgd_with_momentum():
    torch.manual_seed(0)
    model = MLP(dropout=0.0)
    optimizers = [torch.optim.SGD(model.fc1.parameters(), lr=0.05, momentum=0.9),
                  torch.optim.Adam(model.fc2.parameters(), lr=1e-2)]
    eager_model = copy.deepcopy(model)
    eager_optimizers = [torch.optim.SGD(eager_model.fc1.parameters(), lr=0.05, momentum=0.9),
                        torch.optim.Adam(eager_model.fc2.parameters(), lr=1e-2)]
    loader = seeded_loader(classification_data(SAMPLES))
    tl = TrainLoop(model, loader, None, None, optimizers, nn.CrossEntropyLoss(), torch_compile=AOT_EAGER,
                   show_progress=False)
    eager = TrainLoop(eager_model, seeded_loader(classification_data(SAMPLES)), None, None, eager_optimizers,
                      nn.CrossEntropyLoss(), show_progress=False)
    tl.fit(num_epochs=3)
    eager.fit(num_epochs=3)
    assert_params_close(model, eager_model, rtol=1e-4, atol=1e-4)
    assert [step.name for step in tl._compiler.optimizer_steps] == ["SGD", "Adam"]
    assert tl.compile_stats.compiles_since(1) == []


class RecordSkippedSteps(AbstractCallback):
    def __init__(self):
        super().__init__("record skipped steps")
        self.skipped = []

    def on_after_optimizer_step(self):
        self.skipped.append(self.train_loop_obj.optimizer_step_skipped)


@pytest.mark.parametrize("use_amp", [{"opt_level": "O1", "loss_scale": "dynamic"},
                                     {"opt_level": "O2", "loss_scale": "dynamic"}], ids=["O1", "O2"])
def test_a_step_with_overflowing_gradients_is_skipped_as_in_eager_training(use_amp):
    """Batch 2's gradients are made inf: the (compiled) step is skipped and the loss scale halves, as in eager."""
    results = []
    for torch_compile in (False, AOT_EAGER):
        tl = build(torch_compile, use_amp)
        skipped = RecordSkippedSteps()
        tl.fit(num_epochs=2, callbacks=[InjectOverflow(), skipped])
        results.append((tl, skipped.skipped))
    (eager, eager_skipped), (compiled, compiled_skipped) = results
    assert compiled_skipped == eager_skipped and compiled_skipped[2] and sum(compiled_skipped) == 1
    assert compiled.precision.loss_scaler.state_dict() == eager.precision.loss_scaler.state_dict()
    assert_params_close(compiled.model, eager.model, rtol=2e-2, atol=2e-2)


# --- checkpoints ---------------------------------------------------------------------------------------------
def test_a_compiled_runs_checkpoint_loads_into_an_uncompiled_loop_and_the_other_way_round():
    compiled = build(AOT_EAGER)
    compiled.fit(num_epochs=2)
    checkpoint = compiled.checkpoint_state()

    uncompiled = build(False)
    uncompiled.load_checkpoint(copy.deepcopy(checkpoint))
    uncompiled.fit(num_epochs=3)  # the loaded weights train on uncompiled
    assert uncompiled.epochs_completed == 3

    plain = MLP(dropout=0.0)
    plain.load_state_dict(checkpoint["model_state_dict"])  # strict: same keys
    for name, value in compiled.model.state_dict().items():
        assert torch.equal(plain.state_dict()[name], value)

    eager = build(False)
    eager.fit(num_epochs=2)
    recompiled = build(AOT_EAGER)
    recompiled.load_checkpoint(eager.checkpoint_state())
    for name, value in eager.model.state_dict().items():
        assert torch.equal(recompiled.model.state_dict()[name], value)
    recompiled.fit(num_epochs=3)
    assert recompiled.compile_stats.compiles > 0 and recompiled.epochs_completed == 3


def test_a_compiled_model_pickles_uncompiled():
    """fit_distributed sends the model to new processes by pickling: the compiled call is not sent along."""
    tl = build(AOT_EAGER)
    tl.fit(num_epochs=1)
    copied = pickle.loads(pickle.dumps(tl.model))
    assert copied._compiled_call_impl is None
    x = torch.randn(4, IN_FEATURES)
    torch.testing.assert_close(copied(x), tl.model(x), rtol=1e-5, atol=1e-6)
    # A pickled TrainLoop (as fit_distributed sends it) compiles again when it trains on.
    copied_loop = pickle.loads(pickle.dumps(tl))
    assert copied_loop.model._compiled_call_impl is None and copied_loop._compiler.model_call is None
    compiles_before = copied_loop.compile_stats.compiles
    copied_loop.fit(num_epochs=2)
    assert copied_loop._compiler.model_call.compiles > 0
    assert copied_loop.compile_stats.compiles > compiles_before
    assert not copied_loop.compile_stats.recompile_limit_reached


# --- failures ------------------------------------------------------------------------------------------------
class GraphBreakingMLP(MLP):
    def forward(self, x):
        hidden = torch.relu(self.fc1(x))
        torch._dynamo.graph_break()
        return self.fc2(hidden)


def test_a_graph_break_under_fullgraph_is_an_error_naming_the_module():
    tl = build({"backend": "aot_eager", "fullgraph": True}, model=GraphBreakingMLP(dropout=0.0))
    weights = copy.deepcopy(tl.model.state_dict())
    with pytest.raises(RuntimeError, match=r"(?s)could not compile the forward of GraphBreakingMLP.*graph_break.*"
                                           r"torch_compile=\{'fallback': 'eager'\}") as raised:
        tl.fit(num_epochs=1)
    assert raised.value.__cause__ is not None  # dynamo's own error, with its details
    for name, value in tl.model.state_dict().items():  # nothing was trained or changed
        assert torch.equal(value, weights[name])


def test_the_eager_fallback_warns_and_trains_as_eager_does():
    eager = build(False, model=GraphBreakingMLP(dropout=0.0))
    eager.fit(num_epochs=2)
    tl = build({"backend": "aot_eager", "fullgraph": True, "fallback": "eager", "optimizer_step": False},
               model=GraphBreakingMLP(dropout=0.0))
    with pytest.warns(RuntimeWarning, match="could not compile the forward of GraphBreakingMLP.*runs uncompiled"):
        tl.fit(num_epochs=2)
    assert tl._compiler.model_call.eager_only
    for name, value in eager.model.state_dict().items():
        assert torch.equal(tl.model.state_dict()[name], value)


def failing_backend(graph_module, example_inputs):
    raise NotImplementedError("this backend cannot compile anything")


def test_a_failing_backend_is_an_error_naming_the_module():
    tl = build({"backend": failing_backend})
    with pytest.raises(RuntimeError,
                       match="could not compile the forward of MLP.*NotImplementedError: this backend cannot compile"):
        tl.fit(num_epochs=1)


def test_a_failing_backend_with_the_eager_fallback_trains_uncompiled():
    eager = build(False)
    eager.fit(num_epochs=2)
    tl = build({"backend": failing_backend, "fallback": "eager"})
    with pytest.warns(RuntimeWarning) as warned:
        tl.fit(num_epochs=2)
    messages = [str(warning.message) for warning in warned]
    assert any("forward of MLP" in message for message in messages)
    assert any("AdamW.step" in message for message in messages)
    for name, value in eager.model.state_dict().items():
        assert torch.equal(tl.model.state_dict()[name], value)


class SubmoduleOnlyModel(MLP):
    """get_loss calls the layers directly, never the model itself: no forward to compile."""

    def get_loss(self, batch_data, criterion, device):
        x, y = batch_data
        return criterion(self.fc2(torch.relu(self.fc1(x.to(device)))), y.to(device))


def test_a_get_loss_that_never_calls_the_model_gets_a_warning(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)  # the package logger keeps to itself
    tl = build(AOT_EAGER, model=SubmoduleOnlyModel(dropout=0.0))
    with caplog.at_level(logging.WARNING, logger="aitoolbox.torchtrain.compiling.compiler"):
        tl.fit(num_epochs=2)
    warnings = [record for record in distinct_records(caplog) if "never called the model itself" in record.getMessage()]
    assert len(warnings) == 1


# --- many TrainLoops in one process (a notebook) ---------------------------------------------------------------
@pytest.mark.parametrize("use_amp", [False, {"opt_level": "O2"}], ids=["fp32", "O2"])
def test_each_model_has_its_own_compile_budget(use_amp):
    """Dynamo counts the graphs of freed models against recompile_limit per code object; every TrainLoop's model
    compiles anew (amp's forward hooks make each model need graphs of its own) and is never refused."""
    # verify off: its dropout-free check graph would count against this deliberately tiny limit.
    with torch._dynamo.config.patch(recompile_limit=2):
        for _ in range(4):
            tl = build({"backend": "aot_eager", "optimizer_step": False, "verify": False}, use_amp)
            tl.fit(num_epochs=1)
            assert tl._compiler.model_call.compiles > 0
            assert not tl.compile_stats.recompile_limit_reached


def test_reaching_the_recompile_limit_is_reported_once(caplog, monkeypatch):
    """torch keeps the graphs of freed optimizers and counts them against the limit of its shared step code."""
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    reached = []
    with torch._dynamo.config.patch(recompile_limit=2), \
            caplog.at_level(logging.WARNING, logger="aitoolbox.torchtrain.compiling.stats"):
        for _ in range(4):
            tl = build(dict(AOT_EAGER, verify=False))  # its check graph would count against the tiny limit
            tl.fit(num_epochs=2)
            reached.append(tl.compile_stats.recompile_limit_reached)
    assert reached[0] is False and reached[-1] is True
    warnings = [record.getMessage() for record in distinct_records(caplog)  # ours, not torch's own warning
                if record.name == "aitoolbox.torchtrain.compiling.stats" and "recompile_limit" in record.getMessage()]
    assert len(warnings) == sum(reached)  # once per TrainLoop that hit it, not once per epoch
    assert "AdamW.step" in warnings[-1] and "torch._dynamo.reset()" in warnings[-1]


# --- statistics ----------------------------------------------------------------------------------------------
def test_compile_stats_record_each_compilation_and_log_it_at_debug_level(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    tl = build(AOT_EAGER)
    with caplog.at_level(logging.DEBUG, logger="aitoolbox.torchtrain.compiling.stats"):
        tl.fit(num_epochs=2)
    stats = tl.compile_stats
    assert stats.compiles == len(stats.events) > 0
    assert stats.compile_time_s == pytest.approx(sum(event.seconds for event in stats.events))
    assert all(event.epoch == 0 and event.seconds > 0 for event in stats.events)
    logged = [record.getMessage() for record in distinct_records(caplog)
              if record.getMessage().startswith("torch.compile:")]
    assert len(logged) == stats.compiles
    assert "CompileStats(compiles=" in repr(stats)


def test_a_smaller_last_batch_compiles_nothing_new():
    """The batch dimension is dynamic from the first call: 30 samples (a last batch of 6) compile as many graphs as
    32 samples (four batches of 8)."""
    compiles = []
    for samples in (32, 30):
        torch._dynamo.reset()
        tl = build(AOT_EAGER, samples=samples)
        tl.fit(num_epochs=2)
        compiles.append(tl.compile_stats.compiles)
    assert compiles[0] == compiles[1]


def test_compile_stats_do_not_count_compilations_of_other_code():
    tl = build(AOT_EAGER)
    tl.fit(num_epochs=1)
    compiles = tl.compile_stats.compiles
    other = torch.compile(lambda x: torch.sin(x) + 1, backend="aot_eager")
    other(torch.randn(3))
    assert tl.compile_stats.compiles == compiles


# --- inductor ------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.extended
def test_inductor_training_equals_eager_and_compiles_only_in_the_first_epoch():
    eager = build(False, use_amp=True)
    eager.fit(num_epochs=3)
    tl = build(True, use_amp=True)
    counts = CompileCountPerEpoch()
    tl.fit(num_epochs=3, callbacks=[counts])
    assert_params_close(tl.model, eager.model, rtol=2e-2, atol=2e-2)
    assert counts.frames == [counts.frames[0]] * 3 and counts.frames[0] > 0
    assert tl.compile_stats.compiles_since(1) == []
