"""Compiling an optimizer's ``step``: torch's compiled-optimizer recipe applied to the user's own optimizer.

Two details make the recipe work inside a training loop:

* **The learning rate is a tensor during the compiled step.** A Python float learning rate is baked into the
  graph (or made symbolic after one recompilation); a warm-up scheduler changing it every step would
  recompile. Each parameter group gets one 0-dim float64 tensor that takes the group's current learning rate
  just before the step; ``param_groups[i]['lr']`` holds the user's float again right after. Schedulers,
  callbacks and checkpoints never see a tensor, so a checkpoint of a compiled run is the same as an
  uncompiled one's.
* **The optimizer's class ``step`` is compiled**, called with the optimizer. ``optimizer.step`` may be an
  instance attribute put there by a torch LR scheduler (a wrapper recording that the optimizer stepped, in a
  file dynamo does not trace: with it nothing of the step would compile); we call the class's step and record
  the same thing. An optimizer whose ``step`` was replaced by anything else is stepped as it is, uncompiled.
"""
import logging
import warnings
from typing import Callable, List, Optional

import torch

from aitoolbox.torchtrain.compiling.model import compile_failure_types, first_line
from aitoolbox.torchtrain.compiling.options import CompileOptions
from aitoolbox.torchtrain.compiling.stats import CompileStats

logger = logging.getLogger(__name__)


class CompiledOptimizerStep:
    """``step()`` of one optimizer, compiled.

    Args:
        optimizer: the optimizer (any ``torch.optim.Optimizer``; under O2 the one holding the float32 masters).
        options: TrainLoop's compile options.
        stats: records the compilations.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, options: CompileOptions, stats: CompileStats):
        self.optimizer = optimizer
        self.options = options
        self.stats = stats
        self.eager_only = False
        self.calls = 0
        self.compiles = 0  # compilations while this step ran (CompileStats counts them here)
        self.name = type(optimizer).__name__
        self.label = f"{self.name}.step"
        self._replaced_step_logged = False
        self._compiled: Callable = torch.compile(type(optimizer).step, **options.optimizer_kwargs)
        self._tensor_lrs: List[Optional[torch.Tensor]] = [self._tensor_lr_for(group)
                                                          for group in optimizer.param_groups]

    def __repr__(self) -> str:
        return f"CompiledOptimizerStep({self.name}, {'eager' if self.eager_only else 'compiled'})"

    @staticmethod
    def _tensor_lr_for(group: dict) -> Optional[torch.Tensor]:
        # torch's foreach implementations refuse a tensor lr unless capturable: such a group keeps its float (dynamo
        # then makes it symbolic after one recompilation).
        if not isinstance(group.get("lr"), float) or (group.get("foreach") and not group.get("capturable")):
            return None
        return torch.tensor(group["lr"], dtype=torch.float64)

    def __call__(self) -> None:
        optimizer = self.optimizer
        # Looked up at every step: a scheduler made after set-up (a callback's on_train_begin) wraps step then.
        instance_step = optimizer.__dict__.get("step")
        from_scheduler = instance_step is not None and getattr(instance_step, "_wrapped_by_lr_sched", False)
        if self.eager_only or (instance_step is not None and not from_scheduler):
            self._log_replaced_step(instance_step)
            optimizer.step()
            return
        if len(self._tensor_lrs) != len(optimizer.param_groups):  # add_param_group since: new groups too
            self._tensor_lrs = [self._tensor_lr_for(group) for group in optimizer.param_groups]
        float_lrs = []
        for group, tensor_lr in zip(optimizer.param_groups, self._tensor_lrs):
            float_lrs.append(group["lr"])
            if tensor_lr is not None and isinstance(group["lr"], float):
                tensor_lr.fill_(group["lr"])
                group["lr"] = tensor_lr
        self.calls += 1
        self.stats.caller = self
        try:
            try:
                with self.stats:
                    self._compiled(optimizer)
            finally:
                self._restore_lrs(float_lrs)
        except compile_failure_types() as failure:
            self._handle_failure(failure)
            optimizer.step()
            return
        if from_scheduler:
            # What the scheduler's step wrapper records (its check that optimizer.step ran before scheduler.step).
            optimizer._opt_called = True

    def _log_replaced_step(self, instance_step) -> None:
        if instance_step is not None and not self._replaced_step_logged:
            logger.info("%s.step was replaced on the optimizer object (%r): it is stepped as it is, uncompiled",
                        self.name, instance_step)
            self._replaced_step_logged = True

    def _restore_lrs(self, float_lrs: list) -> None:
        for group, lr in zip(self.optimizer.param_groups, float_lrs):
            group["lr"] = lr

    def _handle_failure(self, failure: Exception) -> None:
        reason = first_line(failure)
        if self.options.fallback != "eager":
            raise RuntimeError(
                f"torch.compile could not compile {self.name}.step (TrainLoop torch_compile="
                f"{self.options.torch_kwargs or True}): {reason}\nPass torch_compile={{'optimizer_step': False}} to "
                f"compile only the model, or {{'fallback': 'eager'}} to run what fails uncompiled.") from failure
        warnings.warn(f"torch.compile could not compile {self.name}.step: {reason}. It runs uncompiled "
                      f"(torch_compile 'fallback': 'eager').", RuntimeWarning, stacklevel=2)
        self.eager_only = True
