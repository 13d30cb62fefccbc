"""The compiler of one TrainLoop: what ``torch_compile`` compiles, and the optimizer step the loop calls."""
import contextlib
import logging
import time
from typing import Any, Callable, ContextManager, Dict, List, Optional

import torch
from torch import nn

from aitoolbox.torchtrain.compiling.model import CompiledModelCall, compile_in_place
from aitoolbox.torchtrain.compiling.optimizer import CompiledOptimizerStep
from aitoolbox.torchtrain.compiling.options import CompileOptions
from aitoolbox.torchtrain.compiling.stats import CompileStats
from aitoolbox.torchtrain.compiling.verify import verify_compiled_gradients
from aitoolbox.torchtrain.precision.precision import Precision

logger = logging.getLogger(__name__)


class Compiler:
    """Compiles a TrainLoop's model forward (in place) and its optimizers' steps.

    What runs compiled is what ``get_loss`` and ``get_predictions`` call: ``self(...)`` on the model (or the
    ``ModelWrap``-ed module) goes through the compiled graph, for training and evaluation alike. Dynamo keeps
    one graph per mode (train, eval, no_grad), so switching between them recompiles nothing after each has run
    once. A smaller last batch makes dynamo recompile the forward once with a dynamic batch dimension (torch's
    automatic dynamic shapes); from the second epoch on nothing recompiles.

    Args:
        options: what to compile and how (from ``TrainLoop(torch_compile=...)``).
        position: returns the loop's ``(epoch, iteration)`` for :class:`CompileStats`.
        keeps_graph: a batch's graph serves several backward passes (``retain_graph``: a MultiLoss with several
            optimizers), so training runs without AOTAutograd's donated buffers, which forbid that.
    """

    def __init__(self, options: CompileOptions, position: Callable[[], tuple], keeps_graph: bool = False):
        self.options = options
        self.stats = CompileStats(position)
        self.model_call: Optional[CompiledModelCall] = None
        self._optimizer_steps: Dict[int, CompiledOptimizerStep] = {}
        self._unused_forward_warned = False
        self._verified = False  # the compiled gradients were compared with eager ones (once per process)
        self.keeps_graph = keeps_graph

    def __getstate__(self) -> dict:
        # Sent to the processes of fit_distributed: compiled functions do not pickle; each process compiles anew.
        state = self.__dict__.copy()
        state["model_call"] = None
        state["_optimizer_steps"] = {}
        return state

    def __repr__(self) -> str:
        return f"Compiler({self.options}, {self.stats})"

    def prepare(self, module: nn.Module, precision: Precision, batch_size: Optional[int] = None) -> None:
        """Compile ``module``'s forward in place (see :func:`~.model.compile_in_place`) and make ``precision`` step
        the optimizers compiled. Idempotent: TrainLoop calls it whenever it sets up (a copy of the TrainLoop that
        was pickled, e.g. in a process of ``fit_distributed``, compiles again there).

        ``batch_size`` (the training loader's) says which inputs are batch-first: their dimension 0 is compiled
        dynamic from the first call, so one graph serves the smaller last batch too. None (unknown) leaves the
        shapes to torch's automatic dynamic shapes."""
        self.stats.listen()
        self.model_call = compile_in_place(module, self.options, self.stats)
        self.model_call.batch_size = batch_size
        precision.step_optimizer = self.step

    def training(self) -> ContextManager:
        """The context of training with the compiled model: compilations are recorded as this loop's (a backward
        compiled lazily runs outside the compiled calls) and, when a batch's graph serves several backward passes,
        AOTAutograd's donated buffers are off. Both the compile and each backward read that setting: a graph
        compiled with them refuses ``retain_graph``."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.stats)
        config = torch._functorch.config
        if self.keeps_graph and hasattr(config, "donated_buffer"):  # (torch < 2.6 has no donated buffers)
            stack.enter_context(config.patch(donated_buffer=False))
        return stack

    @property
    def verification_due(self) -> bool:
        """Whether the next training batch should first check the compiled gradients (see :mod:`.verify`)."""
        return (self.options.verify and not self._verified and self.model_call is not None
                and not self.model_call.eager_only and not self.options.torch_kwargs.get("disable", False))

    def verify(self, module: nn.Module, compute_loss: Callable[[], Any], autocast_dtype: Any) -> None:
        """Compare the compiled gradients of one batch with eager ones (raises when they differ); once."""
        started = time.perf_counter()
        compared = verify_compiled_gradients(module, compute_loss, autocast_dtype)
        self._verified = True
        if compared:
            logger.info("torch_compile: the compiled gradients of the first batch match eager ones (checked in %.1f s; "
                        "torch_compile={'verify': False} skips the check)", time.perf_counter() - started)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step ``optimizer`` (compiled when ``optimizer_step`` is on); the Precision object calls this."""
        compiled = self._optimizer_steps.get(id(optimizer))
        if compiled is None or compiled.optimizer is not optimizer:
            if not self.options.optimizer_step:
                optimizer.step()
                return
            compiled = self._optimizer_steps[id(optimizer)] = CompiledOptimizerStep(optimizer, self.options,
                                                                                   self.stats)
        compiled()

    def check_after_epoch(self) -> None:
        """Warn once about what an epoch revealed: dynamo's recompile limit reached (something then runs uncompiled),
        or a ``get_loss`` that never calls ``self(...)`` (only submodules): then no forward is compiled."""
        compiled_calls = [self.model_call] if self.model_call is not None else []
        compiled_calls += self.optimizer_steps
        never_compiled = [call.label for call in compiled_calls
                          if call.calls > 0 and call.compiles == 0 and not call.eager_only]
        if not self.options.torch_kwargs.get("disable", False):
            self.stats.check_recompile_limit(never_compiled)
        if self.model_call is not None and self.model_call.calls == 0 and not self._unused_forward_warned:
            self._unused_forward_warned = True
            logger.warning("torch_compile: get_loss never called the model itself (self(...)), so no forward was "
                           "compiled; only the optimizer step is. Call self(...) in get_loss, or compile the "
                           "submodules it calls yourself with submodule.compile().")

    @property
    def optimizer_steps(self) -> List[CompiledOptimizerStep]:
        """The compiled steps, one per optimizer stepped so far."""
        return list(self._optimizer_steps.values())
