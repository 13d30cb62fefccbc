"""Compiling an optimizer's ``step``: torch's compiled-optimizer recipe applied to the user's own optimizer.

Two details make the recipe work inside a training loop:

* **The learning rate is a tensor during the compiled step** (and Adam's and AdamW's ``betas`` once a
  scheduler such as ``OneCycleLR`` changes them). A Python float is baked into the graph; a scheduler changing
  it every step would recompile every step. Each parameter group gets 0-dim float32 tensors (float64 ones
  make the fused update compute in float64: measurably slower) that take the group's current values just
  before the step; ``param_groups[i]['lr']`` holds the user's float again right after. Schedulers,
  callbacks and checkpoints never see a tensor, so a checkpoint of a compiled run is the same as an
  uncompiled one's. Another hyperparameter that keeps changing (SGD's ``momentum`` under a cycling
  scheduler: torch's SGD cannot take it as a tensor) would recompile at every change, so after a few changes
  that optimizer is stepped uncompiled, with a warning naming the hyperparameter.
* **The optimizer's class ``step`` is compiled**, called with the optimizer. ``optimizer.step`` may be an
  instance attribute put there by a torch LR scheduler (a wrapper recording that the optimizer stepped, in a
  file dynamo does not trace: with it nothing of the step would compile); we call the class's step and record
  the same thing. An optimizer whose ``step`` was replaced by anything else is stepped as it is, uncompiled.
"""
import logging
import warnings
from typing import Any, Callable, Dict, List, Optional

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

    # Changes of one untensorised hyperparameter after which the step runs uncompiled (each change recompiles).
    MAX_HYPERPARAMETER_CHANGES = 4

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
        self._tensor_slots: List[Dict[str, Any]] = []
        self._last_hyperparameters: Optional[list] = None
        self._hyperparameter_changes: Dict[str, int] = {}

    def __repr__(self) -> str:
        return f"CompiledOptimizerStep({self.name}, {'eager' if self.eager_only else 'compiled'})"

    def _tensor_slots_for(self, group: dict) -> Dict[str, Any]:
        """The group's hyperparameters that ride into the compiled step as tensors: ``{key: tensor(s)}``.

        Only the learning rate from the start (float32, as in torch's compiled-optimizer recipe: a float64 tensor
        makes the fused update compute in float64, measurably slower); Adam's ``betas`` once a scheduler has
        changed them (see :meth:`_hyperparameters_keep_changing`): as tensors they cost time in every step.
        """
        if not self._takes_tensors(group) or not isinstance(group.get("lr"), float):
            return {}
        return {"lr": torch.tensor(group["lr"], dtype=torch.float32)}

    def _takes_tensors(self, group: dict) -> bool:
        # torch's foreach implementations refuse tensor hyperparameters unless capturable.
        return not (group.get("foreach") and not group.get("capturable"))

    def _tensor_betas_for(self, group: dict) -> Optional[tuple]:
        betas = group.get("betas")
        if isinstance(self.optimizer, torch.optim.Adam) and self._takes_tensors(group) and isinstance(betas, tuple) \
                and len(betas) == 2 and all(isinstance(beta, float) for beta in betas):  # Adam, AdamW take them
            return tuple(torch.tensor(beta, dtype=torch.float32) for beta in betas)
        return None

    def __call__(self) -> None:
        optimizer = self.optimizer
        # Looked up at every step: a scheduler made after set-up (a callback's on_train_begin) wraps step then.
        instance_step = optimizer.__dict__.get("step")
        from_scheduler = instance_step is not None and getattr(instance_step, "_wrapped_by_lr_sched", False)
        replaced = instance_step is not None and not from_scheduler
        if self.eager_only or replaced or self._hyperparameters_keep_changing():
            self._log_replaced_step(instance_step)
            optimizer.step()
            return
        self.calls += 1
        self.stats.caller = self
        saved = self._swap_in_tensors()
        try:
            try:
                with self.stats:
                    self._compiled(optimizer)
            finally:
                for group, values in zip(optimizer.param_groups, saved):
                    group.update(values)
        except compile_failure_types() as failure:
            self._handle_failure(failure)
            optimizer.step()
            return
        if from_scheduler:
            # What the scheduler's step wrapper records (its check that optimizer.step ran before scheduler.step).
            optimizer._opt_called = True

    def _swap_in_tensors(self) -> List[dict]:
        """Put each group's tensor slots in place of its floats; returns the floats to put back."""
        groups = self.optimizer.param_groups
        if len(self._tensor_slots) != len(groups):  # at the first step, or add_param_group since
            self._tensor_slots = [self._tensor_slots_for(group) for group in groups]
        saved = []
        for group, slots in zip(groups, self._tensor_slots):
            values = {}
            for key, tensors in slots.items():
                value = group[key]
                if key == "betas" and isinstance(value, tuple) and all(isinstance(v, float) for v in value):
                    for tensor, beta in zip(tensors, value):
                        tensor.fill_(beta)
                elif isinstance(value, float) and key != "betas":
                    tensors.fill_(value)
                else:  # the user put something else there since: leave it
                    continue
                values[key] = value
                group[key] = tensors
            saved.append(values)
        return saved

    def _hyperparameters_keep_changing(self) -> bool:
        """True once a hyperparameter that is not a tensor slot changed too often (each change recompiles).

        Adam's ``betas`` become a tensor slot at their first change instead (one recompilation, then none).
        """
        groups = self.optimizer.param_groups
        slots_per_group = self._tensor_slots if len(self._tensor_slots) == len(groups) else [{}] * len(groups)
        current = [{key: value for key, value in group.items()
                    if key != "params" and key not in slots and isinstance(value, (float, int, tuple))}
                   for group, slots in zip(groups, slots_per_group)]
        previous, self._last_hyperparameters = self._last_hyperparameters, current
        if previous is None or len(previous) != len(current):
            return False
        for group, slots, old, new in zip(groups, slots_per_group, previous, current):
            for key in new:
                if key not in old or old[key] == new[key]:
                    continue
                if key == "betas" and self._tensor_betas_for(group) is not None:
                    slots["betas"] = self._tensor_betas_for(group)
                    continue
                self._hyperparameter_changes[key] = self._hyperparameter_changes.get(key, 0) + 1
                if self._hyperparameter_changes[key] >= self.MAX_HYPERPARAMETER_CHANGES:
                    warnings.warn(
                        f"{self.name}'s {key!r} changed at {self._hyperparameter_changes[key]} steps (a "
                        f"scheduler cycling it?): torch.compile would recompile {self.name}.step at every "
                        f"change, so it runs uncompiled from now on. Keep {key!r} constant (e.g. OneCycleLR("
                        f"cycle_momentum=False)) to keep the step compiled.", RuntimeWarning, stacklevel=4)
                    self.eager_only = True
                    return True
        return False

    def _log_replaced_step(self, instance_step) -> None:
        if instance_step is not None and not getattr(instance_step, "_wrapped_by_lr_sched", False) \
                and not self._replaced_step_logged:
            logger.info("%s.step was replaced on the optimizer object (%r): it is stepped as it is, uncompiled",
                        self.name, instance_step)
            self._replaced_step_logged = True

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
