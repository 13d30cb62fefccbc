"""aitoolbox 1.x's TrainLoop methods that the loop itself does not need: the optimizer-update and scheduler
queries of 1.x callbacks, and 1.x's MultiLoss + MultiOptimizer training order."""
from aitoolbox.torchtrain.multi_loss_optim import MultiLoss, MultiOptimizer
from aitoolbox.torchtrain.schedulers.basic import AbstractScheduler
from aitoolbox.torchtrain.train_loop.evaluation import loader_length


class CompatMethods:
    """A mixin of :class:`~aitoolbox.torchtrain.train_loop.train_loop.TrainLoop` (it uses the loop's state,
    optimizers, precision and callbacks)."""

    def should_execute_optimizer_update(self) -> bool:
        """True when the current batch ends with an optimizer step: every ``grad_accumulation`` batches, at the
        epoch's last batch, and at the last batch of a ``num_iterations`` run."""
        num_batches = loader_length(self.train_loader)
        return self.optimizer_step_due or (self.iteration + 1) % self.grad_accumulation == 0 \
            or (num_batches is not None and self.iteration == num_batches - 1)

    def get_schedulers(self) -> list:
        """The registered LR scheduler callbacks (instances of ``AbstractScheduler``), in execution order."""
        return [callback for callback in self.callbacks if isinstance(callback, AbstractScheduler)]

    def get_num_training_steps(self) -> int:
        """Optimizer steps the current ``fit`` takes over the whole run (``num_epochs`` / ``num_iterations`` are
        totals), for warm-up and decay schedules: exactly the steps the loop takes.

        The loop steps every ``grad_accumulation`` batches, at the last batch of every epoch (a window that does
        not divide the epoch) and at the last batch of a ``num_iterations`` run, so an epoch of ``n`` batches
        takes ``ceil(n / grad_accumulation)`` steps (aitoolbox 1.x floored, and undercounted). Training by epochs
        needs a sized train loader; by iterations without one, epochs are taken to be longer than the run.
        """
        accumulation = self.grad_accumulation
        num_batches = loader_length(self.train_loader)
        if self.num_iterations > 0:
            if not num_batches:
                return -(-self.num_iterations // accumulation)
            full_epochs, remainder = divmod(self.num_iterations, num_batches)
            return full_epochs * -(-num_batches // accumulation) + -(-remainder // accumulation)
        if num_batches is None:
            raise ValueError("get_num_training_steps() needs len(train_loader) when training by num_epochs; the "
                             "loader has no length: train by num_iterations instead")
        return -(-num_batches // accumulation) * self.num_epochs

    def _backward_and_step_per_optimizer(self, loss: MultiLoss) -> None:
        """aitoolbox 1.x's MultiLoss + MultiOptimizer order: for each optimizer in turn, the backward pass of
        the loss mapped to it (``MultiLoss.optimizer_loss_map``), then, on update iterations, its step; the loss
        scale is updated once after the last. A MultiLoss or MultiOptimizer subclass's own ``backward``,
        ``step`` or ``zero_grad`` is called instead, with ``amp_scaler``, as in 1.x.

        In a distributed run all the backward passes come first: DDP and FSDP synchronise the gradients of one
        forward once every loss was back-propagated, so an optimizer stepping in between would step on this
        process's own gradients. The result is 1.x's wherever 1.x's order is well defined (each loss trains
        only its own optimizer's parameters). The batch is the unit of progress: an exception before the last
        optimizer stepped trains the whole batch again.
        """
        if self.grad_accumulation > 1:
            loss = loss / self.grad_accumulation
        own_step = isinstance(self.optimizer, MultiOptimizer) and (
            type(self.optimizer).step is not MultiOptimizer.step
            or type(self.optimizer).zero_grad is not MultiOptimizer.zero_grad)
        backwards_first = self.strategy.is_distributed
        if backwards_first:
            for optimizer_idx in range(self.num_optimizers):
                self._backward_for_optimizer(loss, optimizer_idx)
        skipped = False
        for optimizer_idx, optimizer in enumerate(self.optimizers):
            if not backwards_first:
                self._backward_for_optimizer(loss, optimizer_idx)
            self.callbacks_handler.on_after_gradient_update(optimizer_idx)
            if not self.optimizer_step_due:
                continue
            if own_step:
                self.optimizer.step(optimizer_idx, self.iteration, self.amp_scaler)
                self.optimizer_step_skipped = self.precision.last_step_skipped
                self.callbacks_handler.on_after_optimizer_step()
                self.optimizer.zero_grad(optimizer_idx, self.iteration)
            else:
                self._step_optimizers([optimizer], update_scale=False, batch_done=False)
            skipped |= self.optimizer_step_skipped
        if self.optimizer_step_due:
            self.precision.update_scale()
            self.optimizer_step_skipped = skipped
            self._mark_step_point()  # every optimizer stepped: the batch is done

    def _backward_for_optimizer(self, loss: MultiLoss, optimizer_idx: int) -> None:
        if type(loss).backward is not MultiLoss.backward:  # a subclass's own backward, as 1.x called it
            loss.backward(optimizer_idx, self.iteration, self.amp_scaler)
            return
        if optimizer_idx not in loss.optimizer_loss_map:
            raise ValueError(f"the MultiLoss maps no loss to optimizer {optimizer_idx} (it maps "
                             f"{loss.optimizer_loss_map}); give one loss per optimizer, or loss_optimizer_map")
        retain = loss.retain_graph_until_last and optimizer_idx < self.num_optimizers - 1
        self.precision.backward(loss[loss.optimizer_loss_map[optimizer_idx]],
                                accumulating=not self.optimizer_step_due, retain_graph=retain)
