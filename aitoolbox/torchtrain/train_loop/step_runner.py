"""The optimizer step of one batch: backward, the gradient hooks, step and ``zero_grad``, over one optimizer or several.

:class:`StepRunner` is the only code that calls the precision object's ``backward``, ``step`` and ``zero_grad``
during training. The loop hands it each batch's loss and whether the batch ends an accumulation window; it runs
the callbacks every optimizer step gets (``on_after_gradient_update`` before the step, a clipping callback unscales
and clips there; ``on_after_optimizer_step`` after it) and tells the run state when a batch is done, which is
where a ``fit`` stopped by an exception continues.
"""
from typing import Any, Callable, List, Optional

import torch

from aitoolbox.torchtrain.multi_loss_optim import MultiLoss, MultiOptimizer
from aitoolbox.torchtrain.train_loop.loop_state import LoopState


class StepRunner:
    """Backward and optimizer steps for a TrainLoop (built when the loop sets up its model and precision).

    Args:
        precision: the loop's :class:`~aitoolbox.torchtrain.precision.Precision`.
        optimizers: the optimizers, in order.
        user_optimizer: the ``optimizer`` the user passed (a :class:`MultiOptimizer` subclass may bring its own
            ``step``/``zero_grad``, which 1.x called with ``amp_scaler``).
        hooks: the loop's callbacks handler.
        counters: the loop's counters (``grad_accumulation``, ``optimizer_step_due``, ...).
        backwards_first: with several optimizers, every loss's backward pass comes before the first step (a
            distributed model synchronises the gradients once all are back-propagated; a compiled model's backward
            is one graph that needs the forward's parameters unchanged by a step).
        sync_skipped_gradients: all-reduces gradients whose synchronisation was skipped (an unsized epoch that ended
            inside an accumulation window).
        batch_done: called once every optimizer stepped for the batch (the run's resume point moves there).
        amp_scaler: the loop's 1.x ``amp_scaler`` view, handed to a MultiLoss/MultiOptimizer subclass's methods.
    """

    def __init__(self, precision: Any, optimizers: List[torch.optim.Optimizer], user_optimizer: Any, hooks: Any,
                 counters: LoopState, backwards_first: bool, sync_skipped_gradients: Callable[[], None],
                 batch_done: Callable[[], None], amp_scaler: Any):
        self.precision = precision
        self.optimizers = optimizers
        self.user_optimizer = user_optimizer
        self.hooks = hooks
        self.counters = counters
        self.backwards_first = backwards_first
        self.sync_skipped_gradients = sync_skipped_gradients
        self.batch_done = batch_done
        self.amp_scaler = amp_scaler

    def start(self) -> None:
        """Before training: no per-step state left from outside ``fit`` (an unscale a user did by hand), no
        gradients."""
        self.precision.reset()
        self.precision.zero_grad(self.optimizers)

    def abandon(self) -> None:
        """The step in progress will not be finished (an exception): forget what it unscaled and found."""
        self.precision.reset()

    def backward_and_step(self, loss: Any, loss_names: Optional[List[str]], step_due: bool) -> None:
        """Back-propagate a batch's loss (divided by ``grad_accumulation``) and, when ``step_due``, step.

        A MultiLoss with several optimizers goes through :meth:`_per_optimizer`; with one optimizer it steps on
        the sum of its losses.
        """
        if loss_names is not None and len(self.optimizers) > 1:
            self._per_optimizer(loss, step_due)
            return
        if loss_names is not None:
            loss = sum(loss[name] for name in loss_names)
        if self.counters.grad_accumulation > 1:
            loss = loss / self.counters.grad_accumulation
        self.precision.backward(loss, accumulating=not step_due)
        if self.hooks.has_batch_hooks:
            for optimizer_idx in range(len(self.optimizers)):
                self.hooks.on_after_gradient_update(optimizer_idx)
        if step_due:
            self.step(self.optimizers)

    def step(self, optimizers: List[torch.optim.Optimizer], update_scale: bool = True,
             batch_done: bool = True) -> None:
        """Step ``optimizers`` (skipped on a loss-scale overflow), then ``on_after_optimizer_step`` and
        ``zero_grad``; ``batch_done`` marks the batch done (the other optimizers of the batch stepped too)."""
        self.counters.optimizer_step_skipped = not self.precision.step(optimizers, update_scale)
        if batch_done:
            self.batch_done()
        if self.hooks.has_batch_hooks:
            self.hooks.on_after_optimizer_step()
        self.precision.zero_grad(optimizers)

    def step_pending_gradients(self) -> bool:
        """At the end of an epoch whose length was not known (a loader without ``len``): step on the gradients
        accumulated since the last step, with the hooks every step gets; True if there were any."""
        counters = self.counters
        if (counters.iteration + 1) % counters.grad_accumulation == 0:
            return False
        self.sync_skipped_gradients()
        counters.optimizer_step_due = True
        # A clipping callback clips these gradients now: its call for the batch saw optimizer_step_due False, as
        # the loader's end was not known yet.
        if self.hooks.has_batch_hooks:
            for optimizer_idx in range(len(self.optimizers)):
                self.hooks.on_after_gradient_update(optimizer_idx)
        self.step(self.optimizers)
        counters.optimizer_step_due = False
        return True

    def _per_optimizer(self, loss: MultiLoss, step_due: bool) -> None:
        """aitoolbox 1.x's MultiLoss + MultiOptimizer order: for each optimizer in turn, the backward pass of
        the loss mapped to it (``MultiLoss.optimizer_loss_map``), then, on update iterations, its step; the loss
        scale is updated once after the last. A MultiLoss or MultiOptimizer subclass's own ``backward``,
        ``step`` or ``zero_grad`` is called instead, with ``amp_scaler``, as in 1.x.

        In a distributed run all the backward passes come first: DDP and FSDP synchronise the gradients of one
        forward once every loss was back-propagated, so an optimizer stepping in between would step on this
        process's own gradients. So they do under torch_compile: the compiled backward of the forward is one graph,
        which needs every parameter as the forward saw it, also the ones an earlier step changed. The result is 1.x's wherever 1.x's order is well defined (each loss trains
        only its own optimizer's parameters). The batch is the unit of progress: an exception before the last
        optimizer stepped trains the whole batch again.
        """
        counters = self.counters
        if counters.grad_accumulation > 1:
            loss = loss / counters.grad_accumulation
        user_optimizer = self.user_optimizer
        own_step = isinstance(user_optimizer, MultiOptimizer) and (
            type(user_optimizer).step is not MultiOptimizer.step
            or type(user_optimizer).zero_grad is not MultiOptimizer.zero_grad)
        if self.backwards_first:
            for optimizer_idx in range(len(self.optimizers)):
                self._backward_for(loss, optimizer_idx, step_due)
        skipped = False
        for optimizer_idx, optimizer in enumerate(self.optimizers):
            if not self.backwards_first:
                self._backward_for(loss, optimizer_idx, step_due)
            self.hooks.on_after_gradient_update(optimizer_idx)
            if not step_due:
                continue
            if own_step:
                user_optimizer.step(optimizer_idx, counters.iteration, self.amp_scaler)
                counters.optimizer_step_skipped = self.precision.last_step_skipped
                self.hooks.on_after_optimizer_step()
                user_optimizer.zero_grad(optimizer_idx, counters.iteration)
            else:
                self.step([optimizer], update_scale=False, batch_done=False)
            skipped |= counters.optimizer_step_skipped
        if step_due:
            self.precision.update_scale()
            counters.optimizer_step_skipped = skipped
            self.batch_done()

    def _backward_for(self, loss: MultiLoss, optimizer_idx: int, step_due: bool) -> None:
        if type(loss).backward is not MultiLoss.backward:  # a subclass's own backward, as 1.x called it
            loss.backward(optimizer_idx, self.counters.iteration, self.amp_scaler)
            return
        if optimizer_idx not in loss.optimizer_loss_map:
            raise ValueError(f"the MultiLoss maps no loss to optimizer {optimizer_idx} (it maps "
                             f"{loss.optimizer_loss_map}); give one loss per optimizer, or loss_optimizer_map")
        retain = loss.retain_graph_until_last and optimizer_idx < len(self.optimizers) - 1
        self.precision.backward(loss[loss.optimizer_loss_map[optimizer_idx]], accumulating=not step_due,
                                retain_graph=retain)
