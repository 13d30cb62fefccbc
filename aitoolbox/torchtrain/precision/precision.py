"""The precision object: the one place where TrainLoop's numerics differ between fp32 and mixed precision.

TrainLoop calls it at fixed points of every iteration and never asks which precision is active::

    with precision.autocast():
        loss = model.get_loss(batch, criterion, device)
    precision.backward(loss, accumulating)  # scaled when a loss scaler is set
    precision.unscale_(optimizer)           # optional, e.g. before gradient clipping; once per step
    stepped = precision.step(optimizers)    # False when the step was skipped on inf/NaN gradients
    precision.zero_grad(optimizers)

Full precision is the same object with autocast and scaling disabled, so the code path is identical.
"""
import contextlib
from typing import ContextManager, List, Optional, Sequence

import torch

from aitoolbox.torchtrain.precision.loss_scaler import LossScaler
from aitoolbox.torchtrain.precision.master_weights import MasterWeights, optimizer_pairs, unscale_into


class Precision:
    """Autocast, loss scaling and the optimizer step of one training run.

    Args:
        device_type: ``"cpu"`` or ``"cuda"`` (the device the model runs on).
        autocast_dtype: low-precision dtype of the forward pass under autocast; None disables autocast.
        loss_scaler: scales the loss; a dynamic one also skips steps on overflow. None disables scaling.
        master_weights: float32 master copies held by the optimizers of a model cast to low precision.
        step_listener: called as ``step_listener(skipped, optimizers)`` after every step decision (amp uses it to
            keep ``amp.last_step_skipped`` true when the loop skips a step).

    Attributes:
        step_optimizer: ``fn(optimizer)`` that performs one optimizer's update once the step is decided:
            ``optimizer.step()`` by default; TrainLoop's ``torch_compile`` puts the compiled step here.
        agree_on_overflow: ``fn(found_inf) -> bool`` deciding the overflow verdict of all processes: the verdict
            itself by default (under DDP every rank unscales the same all-reduced gradients); under FSDP each rank
            checks only its gradient shards, and TrainLoop puts the strategy's ``any_process`` here.
        average_across_processes: ``fn(tensors)`` averaging tensors in place over the processes, or None (one
            process). Under DDP, gradient accumulation with master weights moves each accumulating micro-batch's
            gradients into the float32 masters, where DDP's all-reduce (of the model's ``.grad``) does not see
            them: the step averages them with this before adding the synchronised last micro-batch.
    """

    def __init__(self, device_type: str = "cpu", autocast_dtype: Optional[torch.dtype] = None,
                 loss_scaler: Optional[LossScaler] = None, master_weights: Optional[MasterWeights] = None,
                 step_listener=None):
        self.device_type = device_type
        self.autocast_dtype = autocast_dtype
        self.loss_scaler = loss_scaler
        self.master_weights = master_weights
        self.step_listener = step_listener
        self.step_optimizer = _eager_step
        self.agree_on_overflow = _own_verdict
        self.average_across_processes = None
        self.last_step_skipped = False
        self._no_autocast = contextlib.nullcontext()  # reusable, and cheaper than a new one every batch
        self._unscaled_optimizers: set = set()
        self._found_inf = False
        self._masters_hold_local_grads = False  # accumulated into the masters since the last step, unsynchronised
        self._skipped_since_update = False

    def __repr__(self) -> str:
        masters = ", master_weights" if self.master_weights is not None else ""
        return (f"{type(self).__name__}(device_type={self.device_type!r}, autocast_dtype={self.autocast_dtype}, "
                f"loss_scaler={self.loss_scaler}{masters})")

    def autocast(self) -> ContextManager:
        """Context for the forward pass and the loss (not for backward)."""
        if self.autocast_dtype is None:
            return self._no_autocast
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)

    def backward(self, loss: torch.Tensor, accumulating: bool = False, retain_graph: bool = False) -> None:
        """Backpropagate ``loss``, multiplied by the loss scale when scaling is on.

        Args:
            loss: the loss of one batch.
            accumulating: more backward passes follow before the next optimizer step (gradient accumulation).
                Under master weights their gradients are then summed in float32 (see below); the last
                backward of a window leaves that to the step, which unscales everything at once.
            retain_graph: keep the graph for a further backward pass (several losses sharing one forward).
        """
        if self.loss_scaler is not None:
            loss = self.loss_scaler.scale(loss)
        loss.backward(retain_graph=retain_graph)
        if accumulating and self.master_weights is not None:
            self._move_low_precision_grads_to_masters()

    def _move_low_precision_grads_to_masters(self) -> None:
        """Add this backward's low-precision gradients, unscaled, to the float32 masters' ``.grad``.

        Gradient accumulation then sums in float32 (as apex O2 did), not in the model's bfloat16/float16
        ``.grad``, whose 8 or 11 significant bits would round away the smaller micro-batch contributions.
        Float32 parameters keep their scaled gradients until the step unscales them once.
        """
        for optimizer in self.master_weights.optimizers:
            pairs = [(model, master) for model, master in self.master_weights.grad_pairs(optimizer)
                     if model is not master]
            self._found_inf |= unscale_into(pairs, self.loss_scaler)
        self._masters_hold_local_grads = True

    def _average_accumulated_master_grads(self) -> None:
        """Average what the accumulating micro-batches left in the masters' ``.grad`` over the processes (DDP
        synchronises only the model's ``.grad`` of the last micro-batch), once per step, before any unscaling.

        The overflow verdict of those micro-batches is then read from the averaged gradients, identical on every
        rank (an inf or NaN of any rank survives the average), so all ranks skip or step together.
        """
        self._masters_hold_local_grads = False
        grads = [master.grad for optimizer in self.master_weights.optimizers
                 for model, master in self.master_weights.grad_pairs(optimizer)
                 if model is not master and master.grad is not None]
        if not grads:
            return
        self.average_across_processes(grads)
        self._found_inf = not bool(torch.stack([grad.isfinite().all() for grad in grads]).all())

    @staticmethod
    def stepped_parameters(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
        """The parameters ``optimizer`` updates (float32 masters under master weights): clip these."""
        return [p for group in optimizer.param_groups for p in group["params"]]

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Turn the gradients of ``optimizer``'s parameters into true (unscaled) values.

        Safe to call more than once per step: only the first call divides by the scale.
        """
        if id(optimizer) in self._unscaled_optimizers:
            return
        if self._masters_hold_local_grads and self.average_across_processes is not None:
            self._average_accumulated_master_grads()
        if self.loss_scaler is not None or self.master_weights is not None:
            pairs = optimizer_pairs(optimizer, self.master_weights)
            self._found_inf |= unscale_into(pairs, self.loss_scaler)
        self._unscaled_optimizers.add(id(optimizer))

    def step(self, optimizers: Sequence[torch.optim.Optimizer], update_scale: bool = True) -> bool:
        """Step every optimizer unless the gradients overflowed; update the loss scale.

        Args:
            optimizers: the optimizers to step together.
            update_scale: update the loss scale now. Optimizers stepped one after another within one iteration
                (aitoolbox 1.x's MultiOptimizer) pass False and call :meth:`update_scale` once after the last,
                as ``torch.amp.GradScaler.update`` is called once per iteration.

        Returns:
            True if the optimizers stepped, False if the step was skipped.
        """
        if self.loss_scaler is None and self.master_weights is None:  # nothing to unscale or check (runs per step)
            for optimizer in optimizers:
                self.step_optimizer(optimizer)
            self._unscaled_optimizers.clear()
            self.last_step_skipped = False
            if self.step_listener is not None:
                self.step_listener(False, optimizers)
            return True
        for optimizer in optimizers:
            self.unscale_(optimizer)
        # A static scale never skips (apex semantics): inf/NaN gradients then reach the optimizer as they are.
        skip = self.loss_scaler is not None and self.loss_scaler.dynamic and self.agree_on_overflow(self._found_inf)
        if not skip:
            for optimizer in optimizers:
                self.step_optimizer(optimizer)
        self._skipped_since_update |= skip
        if update_scale:
            self.update_scale()
        self._unscaled_optimizers.clear()
        self._found_inf = False
        self._masters_hold_local_grads = False
        self.last_step_skipped = skip
        if self.step_listener is not None:
            self.step_listener(skip, optimizers)
        return not skip

    def reset(self) -> None:
        """Forget the per-step state of a step that was abandoned (an exception between ``unscale_`` and
        ``step``): which optimizers were unscaled and whether an overflow was found. The loop calls it whenever
        a step is abandoned and when training starts, so the next step unscales its own gradients."""
        self._unscaled_optimizers.clear()
        self._found_inf = False
        self._masters_hold_local_grads = False

    def update_scale(self) -> None:
        """Apply the dynamic-scaling rule once for the steps since the last update (backing off if any skipped)."""
        if self.loss_scaler is not None:
            self.loss_scaler.update(self._skipped_since_update)
        self._skipped_since_update = False

    def zero_grad(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Clear the gradients before the next accumulation window."""
        for optimizer in optimizers:
            optimizer.zero_grad()  # set_to_none=True, torch's default, without asking wrappers to take it
            if self.master_weights is not None and self.master_weights.manages(optimizer):
                # Not grad_pairs: it adopts a write of the model's weights into the masters, and between two fits
                # the model may hold weights that are not the training ones (WeightAveraging's average).
                for model_param in self.master_weights.model_parameters(optimizer):
                    model_param.grad = None

    def state_dict(self) -> dict:
        """State to checkpoint: the loss scaler's and the float32 master weights, where present."""
        return {"loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
                "master_weights": None if self.master_weights is None else self.master_weights.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (after the model and optimizer states are loaded)."""
        if state.get("loss_scaler") is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        if state.get("master_weights") is not None and self.master_weights is not None:
            self.master_weights.load_state_dict(state["master_weights"])


def _eager_step(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()


def _own_verdict(found_inf: bool) -> bool:
    return found_inf
