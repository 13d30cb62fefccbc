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
from typing import ContextManager, Dict, List, Optional, Sequence

import torch

from aitoolbox.torchtrain.precision.loss_scaler import LossScaler, values_of
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
        # The overflow verdict of each optimizer's gradients since its last step, by id(optimizer): optimizers
        # stepped one after another (a MultiLoss with several optimizers) each skip on their own verdict, as
        # torch.amp.GradScaler skips per optimizer.
        self._found_inf: Dict[int, bool] = {}
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

    def passes_through(self) -> bool:
        """Whether :meth:`backward`, :meth:`step` and :meth:`zero_grad` come down to torch's own calls
        (``loss.backward()``, each optimizer's ``step()`` and ``zero_grad()``): no loss scaling, no master weights,
        the eager step, no step listener, this class's own methods, and no step in progress (nothing unscaled, the
        last step not skipped). The step runner then makes those calls itself (see
        :meth:`~aitoolbox.torchtrain.train_loop.step_runner.StepRunner.step_directly`); the loop asks at the start of
        each epoch's batches, so a change of these attributes takes effect from the next epoch, or at once through a
        new precision (``tl.precision = ...``)."""
        own_methods = all(getattr(type(self), name) is getattr(Precision, name) and name not in vars(self)
                          for name in ("backward", "step", "zero_grad", "update_scale", "unscale_"))
        return (own_methods and self.loss_scaler is None and self.master_weights is None
                and self.step_optimizer is _eager_step and self.step_listener is None
                and not self._unscaled_optimizers and not self._found_inf and not self.last_step_skipped)

    def _move_low_precision_grads_to_masters(self) -> None:
        """Add this backward's low-precision gradients, unscaled, to the float32 masters' ``.grad``.

        Gradient accumulation then sums in float32 (as apex O2 did), not in the model's bfloat16/float16
        ``.grad``, whose 8 or 11 significant bits would round away the smaller micro-batch contributions.
        Float32 parameters keep their scaled gradients until the step unscales them once.
        """
        found_inf = self._found_inf
        for optimizer in self.master_weights.optimizers:
            pairs = [(model, master) for model, master in self.master_weights.grad_pairs(optimizer)
                     if model is not master]
            if unscale_into(pairs, self.loss_scaler):
                found_inf[id(optimizer)] = True
        self._masters_hold_local_grads = True

    def _average_accumulated_master_grads(self) -> None:
        """Average what the accumulating micro-batches left in the masters' ``.grad`` over the processes (DDP
        synchronises only the model's ``.grad`` of the last micro-batch), once per step, before any unscaling.

        The overflow verdict of those micro-batches is then read from the averaged gradients, identical on every
        rank (an inf or NaN of any rank survives the average), so all ranks skip or step together.
        """
        self._masters_hold_local_grads = False
        grads_by_optimizer = [(optimizer, [master.grad for model, master in self.master_weights.grad_pairs(optimizer)
                                           if model is not master and master.grad is not None])
                              for optimizer in self.master_weights.optimizers]
        grads = [grad for _, optimizer_grads in grads_by_optimizer for grad in optimizer_grads]
        if not grads:
            return
        self.average_across_processes(grads)
        finite = torch.stack([torch.stack([values_of(grad).isfinite().all() for grad in optimizer_grads]).all()
                              if optimizer_grads else torch.ones((), dtype=torch.bool, device=grads[0].device)
                              for _, optimizer_grads in grads_by_optimizer]).tolist()  # one host sync
        for (optimizer, _), optimizer_finite in zip(grads_by_optimizer, finite):
            self._found_inf[id(optimizer)] = not optimizer_finite

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
            if unscale_into(pairs, self.loss_scaler):
                self._found_inf[id(optimizer)] = True
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
            step_optimizer = self.step_optimizer
            for optimizer in optimizers:
                if step_optimizer is _eager_step:  # called directly: a call less per step
                    optimizer.step()
                else:
                    step_optimizer(optimizer)
            if self._unscaled_optimizers:
                self._unscaled_optimizers.clear()  # (unscale_ without scaling only records the call)
            self.last_step_skipped = False
            if self.step_listener is not None:
                self.step_listener(False, optimizers)
            return True
        for optimizer in optimizers:
            self.unscale_(optimizer)
        # Optimizers stepped together share one verdict (apex's scale_loss over several optimizers): any overflow
        # skips them all. A static scale never skips (apex semantics): inf/NaN gradients reach the optimizer.
        found_inf = any(self._found_inf.pop(id(optimizer), False) for optimizer in optimizers)
        skip = self.loss_scaler is not None and self.loss_scaler.dynamic and self.agree_on_overflow(found_inf)
        if not skip:
            for optimizer in optimizers:
                self.step_optimizer(optimizer)
        self._skipped_since_update |= skip
        if update_scale:
            self.update_scale()
        for optimizer in optimizers:
            self._unscaled_optimizers.discard(id(optimizer))  # another optimizer's unscale_ still stands
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
        self._found_inf.clear()
        self._masters_hold_local_grads = False

    def step_state(self) -> dict:
        """The state of the step in progress (which optimizers are unscaled, their overflow verdicts, whether a step
        skipped since the last scale update), for finishing it later: :meth:`load_step_state`."""
        return {"unscaled": set(self._unscaled_optimizers), "found_inf": dict(self._found_inf),
                "masters_hold_local_grads": self._masters_hold_local_grads,
                "skipped_since_update": self._skipped_since_update}

    def load_step_state(self, state: dict) -> None:
        """Put back what :meth:`step_state` returned (after anything else used the precision object meanwhile)."""
        self._unscaled_optimizers = set(state["unscaled"])
        self._found_inf = dict(state["found_inf"])
        self._masters_hold_local_grads = state["masters_hold_local_grads"]
        self._skipped_since_update = state["skipped_since_update"]

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
