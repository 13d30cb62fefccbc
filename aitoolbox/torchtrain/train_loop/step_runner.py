"""The optimizer step of one batch: backward, the gradient hooks, step and ``zero_grad``, over one optimizer or several.

:class:`StepRunner` is the only code that calls the precision object's ``backward``, ``step`` and ``zero_grad``
during training. The loop hands it each batch's loss and whether the batch ends an accumulation window; it runs
the callbacks every optimizer step gets (``on_after_gradient_update`` before the step, a clipping callback unscales
and clips there; ``on_after_optimizer_step`` after it) and tells the run state when a batch is done, which is
where a ``fit`` stopped by an exception continues.

A step is a transaction: until an optimizer steps, an exception abandons it (the loop trains the window's batches
again from the last step). Once one has stepped it cannot be abandoned: optimizers stepped one after another (a
MultiLoss with one loss per optimizer), or a callback's ``on_after_optimizer_step`` raising after the step. The step
is then kept, with the gradients and precision state of what is left, and the next ``fit`` finishes it
(:meth:`StepRunner.finish_interrupted_step`) as the uninterrupted run would have: each callback's hook that had
returned is not called again for that step, the one that raised and those after it are.
"""
import dataclasses
from typing import Any, Callable, List, Optional, Tuple

import torch

from aitoolbox.torchtrain.multi_loss_optim import MultiLoss, MultiOptimizer
from aitoolbox.torchtrain.train_loop.loop_state import LoopState


@dataclasses.dataclass
class _PerOptimizerStep:
    """A batch's work over several optimizers in turn, as named actions ``(kind, optimizer_idx)`` done in order;
    ``position`` is the first action not done yet. (An ``optimizer_idx`` of -1: every optimizer, the rest of a step
    that stepped them together.)"""

    loss: Optional[MultiLoss]
    step_due: bool
    actions: List[Tuple[str, int]]
    position: int = 0
    skipped: List[bool] = dataclasses.field(default_factory=list)  # per optimizer that stepped, in order
    stepped_any: bool = False
    hooks_done: List[int] = dataclasses.field(default_factory=list)  # callbacks whose hook of the action returned
    per_optimizer: bool = True  # the optimizers step one after another (_per_optimizer), not together
    ends_batch: bool = True  # the batch's end (on_batch_end...) follows: not so for step_pending_gradients


@dataclasses.dataclass
class _UnfinishedStep:
    """A per-optimizer step an exception interrupted after an optimizer had stepped, kept for the next ``fit``."""

    work: _PerOptimizerStep
    gradients: List[Tuple[torch.Tensor, Optional[torch.Tensor]]]
    precision_state: dict


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
        sync_skipped_gradients: all-reduces gradients whose synchronisation was skipped (an epoch that ended
            inside an accumulation window without the loop knowing beforehand).
        batch_done: called once every optimizer stepped for the batch (the run's resume point moves there).
        amp_scaler: the loop's 1.x ``amp_scaler`` view, handed to a MultiLoss/MultiOptimizer subclass's methods.
    """

    def __init__(self, precision: Any, optimizers: List[torch.optim.Optimizer], user_optimizer: Any, hooks: Any,
                 counters: LoopState, backwards_first: bool, sync_skipped_gradients: Callable[[], None],
                 batch_done: Callable[[], None], amp_scaler: Any):
        self.precision = precision
        self.optimizers = optimizers
        self._every_optimizer = tuple(range(len(optimizers)))  # stepped_optimizers of a step of all of them
        self.user_optimizer = user_optimizer
        self.hooks = hooks
        self.counters = counters
        self.backwards_first = backwards_first
        self.sync_skipped_gradients = sync_skipped_gradients
        self.batch_done = batch_done
        self.amp_scaler = amp_scaler
        self.pending_batches = 0  # batches back-propagated since the last step: their gradients wait for one
        # The last batch that left its gradients pending stepped its optimizers one after another (read only while
        # gradients are pending: every backward that leaves them so sets it, a batch that steps need not).
        self._per_optimizer_last = False
        self._work: Optional[_PerOptimizerStep] = None
        self._unfinished: Optional[_UnfinishedStep] = None

    def start(self) -> None:
        """Before training: no per-step state left from outside ``fit`` (an unscale a user did by hand), no
        gradients (an interrupted step keeps its own, see :meth:`abandon`)."""
        self.precision.reset()
        self.precision.zero_grad(self.optimizers)
        self.pending_batches = 0
        self._work = None

    @property
    def has_interrupted_step(self) -> bool:
        """An exception interrupted a step after some optimizer had stepped: :meth:`finish_interrupted_step`."""
        return self._unfinished is not None

    @property
    def optimizers_stepped_so_far(self) -> Optional[int]:
        """Inside a step of several optimizers in turn, once one of them has stepped and before the step is done
        (``on_after_optimizer_step`` runs after each): how many have stepped. None anywhere else."""
        work = self._work
        return len(work.skipped) if work is not None and work.stepped_any else None

    @property
    def interrupted_step_ends_batch(self) -> bool:
        """The interrupted step is a batch's (its ``on_batch_end`` follows), not one :meth:`step_pending_gradients`
        took after the batches."""
        return self._unfinished is not None and self._unfinished.work.ends_batch

    def abandon(self) -> bool:
        """The step in progress is not finished now (an exception). Until an optimizer has stepped, its precision
        state is forgotten: the window's batches are trained again. Once one has (optimizers stepped one after
        another), it is kept with the gradients and precision state the others step on, for
        :meth:`finish_interrupted_step`. Returns whether a step is kept for the next ``fit``."""
        work, self._work = self._work, None
        self.pending_batches = 0
        if work is not None and work.stepped_any and work.position < len(work.actions):
            self._unfinished = _UnfinishedStep(work, self._held_gradients(), self.precision.step_state())
        if self._unfinished is not None:  # kept (also one whose finishing has not begun yet)
            return True
        self.precision.reset()
        return False

    def discard_interrupted_step(self) -> None:
        """Forget an interrupted step (the run goes on from elsewhere: a loaded checkpoint, a rollback)."""
        self._unfinished = None

    def finish_interrupted_step(self) -> None:
        """Do what an interrupted step had left (the gradient hooks, steps and ``zero_grad`` of the optimizers that
        had not stepped, the loss-scale update), on the gradients and precision state it had: the batch ends as in
        the uninterrupted run."""
        unfinished, self._unfinished = self._unfinished, None
        for tensor, grad in unfinished.gradients:  # anything since (zero_grad, lr_find) cleared or replaced them
            tensor.grad = grad
        self.precision.load_step_state(unfinished.precision_state)
        self._per_optimizer_last = unfinished.work.per_optimizer
        self._run(unfinished.work)

    def _held_gradients(self) -> List[Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """Every stepped tensor's gradient (and, under master weights, the model parameter's), by reference."""
        tensors = [param for optimizer in self.optimizers for group in optimizer.param_groups
                   for param in group["params"]]
        masters = getattr(self.precision, "master_weights", None)
        if masters is not None:
            stepped = {id(tensor) for tensor in tensors}
            tensors += [model for optimizer in self.optimizers if masters.manages(optimizer)
                        for model in masters.model_parameters(optimizer) if id(model) not in stepped]
        return [(tensor, tensor.grad) for tensor in tensors]

    def backward_and_step(self, loss: Any, loss_names: Optional[List[str]], step_due: bool) -> None:
        """Back-propagate a batch's loss (divided by ``grad_accumulation``) and, when ``step_due``, step.

        A MultiLoss with several optimizers goes through :meth:`_per_optimizer`; with one optimizer it steps on
        the sum of its losses.
        """
        if loss_names is not None and len(self.optimizers) > 1:
            self._per_optimizer(loss, step_due)
            return
        self._per_optimizer_last = False
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
        else:
            self.pending_batches += 1

    def can_step_directly(self) -> bool:
        """Whether :meth:`step_directly` may take a batch's step: one step of every optimizer together on a plain
        precision (:meth:`~aitoolbox.torchtrain.precision.Precision.passes_through`), nothing pending or
        interrupted."""
        return (self.precision.passes_through() and self.pending_batches == 0 and self._work is None
                and self._unfinished is None)

    def step_directly(self, loss: torch.Tensor) -> bool:
        """:meth:`backward_and_step` of a batch that steps, for one loss tensor, where :meth:`can_step_directly`
        and no callback has a batch hook: the same calls in the same order (backward, every optimizer's step, the
        batch done, ``zero_grad``) without the layers the other cases need (a few microseconds a batch).

        Returns False where a callback with a batch hook was registered meanwhile (by a tensor hook in the backward,
        by an optimizer's step): the step went on as :meth:`backward_and_step` takes it from there, with that
        callback's hooks, and the batch's end must run them too (``TrainLoop._end_batch``). So also where a
        precision was assigned in the backward: the step is the new precision's."""
        precision = self.precision
        loss.backward()
        hooks = self.hooks
        if hooks.has_batch_hooks or self.precision is not precision:
            if hooks.has_batch_hooks:
                for optimizer_idx in range(len(self.optimizers)):
                    hooks.on_after_gradient_update(optimizer_idx)
            self.step(self.optimizers)
            return False
        optimizers = self.optimizers
        for optimizer in optimizers:
            optimizer.step()
        if hooks.has_batch_hooks:
            self._commit_step(optimizers, skipped=False, ends_batch=True)
            return False
        counters = self.counters
        counters.optimizer_step_skipped = False
        counters.stepped_optimizers = self._every_optimizer
        self.batch_done()
        for optimizer in optimizers:
            optimizer.zero_grad()
        return True

    def step(self, optimizers: List[torch.optim.Optimizer], ends_batch: bool = True) -> None:
        """Step every optimizer (``optimizers``; skipped on a loss-scale overflow) and mark the batch done, then
        ``on_after_optimizer_step`` and ``zero_grad``. ``ends_batch``: the batch's end follows (see
        :attr:`interrupted_step_ends_batch`)."""
        self._commit_step(optimizers, skipped=not self.precision.step(optimizers), ends_batch=ends_batch)

    def _commit_step(self, optimizers: List[torch.optim.Optimizer], skipped: bool, ends_batch: bool) -> None:
        """After the optimizers stepped (or skipped): the batch done, ``on_after_optimizer_step``, ``zero_grad``."""
        self.counters.optimizer_step_skipped = skipped
        self.counters.stepped_optimizers = self._every_optimizer
        self.pending_batches = 0
        self.batch_done()
        if self.hooks.has_batch_hooks:
            done: List[int] = []
            try:
                self.hooks.on_after_optimizer_step(done)
            except BaseException:
                # The step is committed: what is left of it (the hooks from the one that raised, zero_grad) is
                # kept for the next fit (see abandon), which must not drop it nor repeat the hooks that returned.
                self._work = _PerOptimizerStep(None, True, [("after_step", -1), ("zero_grad", -1)],
                                               skipped=[skipped], stepped_any=True, hooks_done=done,
                                               per_optimizer=False, ends_batch=ends_batch)
                raise
        self.precision.zero_grad(optimizers)

    def _batch_done(self) -> None:
        self.pending_batches = 0
        self.batch_done()

    def step_pending_gradients(self) -> bool:
        """At the end of an epoch the loop found only when the loader was exhausted (a loader without ``len``, or
        one whose ``len`` overstated), or at a stop requested mid-window: step on the gradients of the batches since
        the last step, with the hooks every step gets; True if there were any."""
        if self.pending_batches == 0:
            return False
        counters = self.counters
        self.sync_skipped_gradients()
        counters.optimizer_step_due = True
        # A clipping callback clips these gradients now: its call for the batch saw optimizer_step_due False, as
        # the window's end was not known yet.
        if self._per_optimizer_last:
            self._run(_PerOptimizerStep(None, True, self._step_actions(with_backward=False), ends_batch=False))
        else:
            if self.hooks.has_batch_hooks:
                for optimizer_idx in range(len(self.optimizers)):
                    self.hooks.on_after_gradient_update(optimizer_idx)
            self.step(self.optimizers, ends_batch=False)
        counters.optimizer_step_due = False
        return True

    # --- several optimizers, one after another -------------------------------------------------------------------
    def _per_optimizer(self, loss: MultiLoss, step_due: bool) -> None:
        """aitoolbox 1.x's MultiLoss + MultiOptimizer order: for each optimizer in turn, the backward pass of
        the loss mapped to it (``MultiLoss.optimizer_loss_map``), then, on update iterations, its step; the loss
        scale is updated once after the last. A MultiLoss or MultiOptimizer subclass's own ``backward``,
        ``step`` or ``zero_grad`` is called instead, with ``amp_scaler``, as in 1.x.

        In a distributed run all the backward passes come first: DDP and FSDP synchronise the gradients of one
        forward once every loss was back-propagated, so an optimizer stepping in between would step on this
        process's own gradients. So they do under torch_compile: the compiled backward of the forward is one graph,
        which needs every parameter as the forward saw it, also the ones an earlier step changed. The result is
        1.x's wherever 1.x's order is well defined (each loss trains only its own optimizer's parameters).
        """
        if self.counters.grad_accumulation > 1:
            loss = loss / self.counters.grad_accumulation
        self._per_optimizer_last = True
        self._run(_PerOptimizerStep(loss, step_due, self._step_actions(with_backward=True, step_due=step_due)))
        if not step_due:
            self.pending_batches += 1

    def _step_actions(self, with_backward: bool, step_due: bool = True) -> List[Tuple[str, int]]:
        count = len(self.optimizers)
        backwards = [("backward", idx) for idx in range(count)] if with_backward else []
        actions: List[Tuple[str, int]] = list(backwards) if self.backwards_first else []
        for idx in range(count):
            if with_backward and not self.backwards_first:
                actions.append(backwards[idx])
            actions.append(("gradient_hooks", idx))
            if step_due:
                actions += [("step", idx), ("after_step", idx), ("zero_grad", idx)]
        return actions + ([("batch_done", -1)] if step_due else [])

    def _run(self, work: _PerOptimizerStep) -> None:
        """The actions of ``work`` from its position on; an exception leaves the position at the failed action."""
        self._work = work
        while work.position < len(work.actions):
            kind, idx = work.actions[work.position]
            getattr(self, f"_do_{kind}")(work, idx)
            work.position += 1
            work.hooks_done.clear()  # the record is the current action's
        self._work = None

    def _own_step(self) -> bool:
        user_optimizer = self.user_optimizer
        return isinstance(user_optimizer, MultiOptimizer) and (
            type(user_optimizer).step is not MultiOptimizer.step
            or type(user_optimizer).zero_grad is not MultiOptimizer.zero_grad)

    def _do_backward(self, work: _PerOptimizerStep, optimizer_idx: int) -> None:
        loss = work.loss
        if type(loss).backward is not MultiLoss.backward:  # a subclass's own backward, as 1.x called it
            loss.backward(optimizer_idx, self.counters.iteration, self.amp_scaler)
            return
        if optimizer_idx not in loss.optimizer_loss_map:
            raise ValueError(f"the MultiLoss maps no loss to optimizer {optimizer_idx} (it maps "
                             f"{loss.optimizer_loss_map}); give one loss per optimizer, or loss_optimizer_map")
        name = loss.optimizer_loss_map[optimizer_idx]
        if not loss[name].requires_grad:
            raise ValueError(f"get_loss's MultiLoss entry {name!r} (the loss of optimizer {optimizer_idx}) does not "
                             "require grad: it has no autograd graph back to the parameters that optimizer steps "
                             "(detached, computed under torch.no_grad(), or from frozen parameters only)")
        retain = loss.retain_graph_until_last and optimizer_idx < len(self.optimizers) - 1
        self.precision.backward(loss[name], accumulating=not work.step_due, retain_graph=retain)

    def _do_gradient_hooks(self, work: _PerOptimizerStep, optimizer_idx: int) -> None:
        if self.hooks.has_batch_hooks:  # a clipping callback that returned must not clip again when continued
            self.hooks.on_after_gradient_update(optimizer_idx, work.hooks_done)

    def _do_step(self, work: _PerOptimizerStep, optimizer_idx: int) -> None:
        if self._own_step():
            self.user_optimizer.step(optimizer_idx, self.counters.iteration, self.amp_scaler)
            skipped = self.precision.last_step_skipped
        else:
            skipped = not self.precision.step([self.optimizers[optimizer_idx]], update_scale=False)
        work.stepped_any = True
        work.skipped.append(skipped)

    def _do_after_step(self, work: _PerOptimizerStep, optimizer_idx: int) -> None:
        self.counters.optimizer_step_skipped = work.skipped[-1]
        # The hook runs once per optimizer here: per-step callbacks (a scheduler per optimizer) act on this one.
        self.counters.stepped_optimizers = \
            (optimizer_idx,) if optimizer_idx >= 0 else tuple(range(len(self.optimizers)))
        if self.hooks.has_batch_hooks:
            self.hooks.on_after_optimizer_step(work.hooks_done)

    def _do_zero_grad(self, work: _PerOptimizerStep, optimizer_idx: int) -> None:
        if optimizer_idx < 0:  # the rest of step(): every optimizer stepped together
            self.precision.zero_grad(self.optimizers)
        elif self._own_step():
            self.user_optimizer.zero_grad(optimizer_idx, self.counters.iteration)
        else:
            self.precision.zero_grad([self.optimizers[optimizer_idx]])

    def _do_batch_done(self, work: _PerOptimizerStep, optimizer_idx: int) -> None:
        self.precision.update_scale()
        self.counters.optimizer_step_skipped = any(work.skipped)
        self._batch_done()
