"""The callback base class: every hook TrainLoop calls, as plain methods to override."""
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # pragma: no cover
    from aitoolbox.torchtrain.train_loop.train_loop import TrainLoop


class AbstractCallback:
    """Base class of all callbacks. Override the hooks you need; the others are never called.

    The loop a callback is registered with is ``self.train_loop_obj``. Read it through its documented
    properties (``epoch``, ``iteration``, ``total_iteration_idx``, ``model``, ``optimizer``,
    ``train_history``, ``device``, ``is_main_process``, ``precision``) and stop training with
    ``self.train_loop_obj.stop_training(reason)``.

    Args:
        callback_name: a name for messages.
        execution_order: callbacks run in increasing order of this number (ties keep registration order).
        device_idx_execution: under distributed training, run only in the process of this global rank;
            None runs in every process.
    """

    def __init__(self, callback_name: str, execution_order: int = 0, device_idx_execution: Optional[int] = None):
        self.callback_name = callback_name
        self.execution_order = execution_order
        self.device_idx_execution = device_idx_execution
        self.train_loop_obj: Optional["TrainLoop"] = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(callback_name={self.callback_name!r}, execution_order={self.execution_order})"

    def register_train_loop_object(self, train_loop_obj: "TrainLoop") -> "AbstractCallback":
        """Attach the callback to a loop and run :meth:`on_train_loop_registration`."""
        self.train_loop_obj = train_loop_obj
        self.on_train_loop_registration()
        return self

    def on_train_loop_registration(self) -> None:
        """Right after the callback is attached to the loop: check settings, find what you need."""

    def on_multiprocess_start(self) -> None:
        """In each process of distributed training, once the process group is up and before training."""

    def on_train_begin(self) -> None:
        """Once, before the first epoch of a ``fit`` call."""

    def on_train_end(self) -> None:
        """Once, after the last epoch of a ``fit`` call (and after the final test-set evaluation)."""

    def on_epoch_begin(self) -> None:
        """At the start of every epoch."""

    def on_epoch_end(self) -> None:
        """At the end of every epoch, after the automatic loss evaluation."""

    def on_batch_begin(self) -> None:
        """Before the forward pass of every batch."""

    def on_batch_end(self) -> None:
        """After every batch, once the optimizer has stepped on update iterations."""

    def on_after_gradient_update(self, optimizer_idx: int) -> None:
        """After every backward pass (gradients may still be accumulating and scaled).

        Use ``self.train_loop_obj.optimizer_step_due`` to act only before an optimizer step, and
        ``self.train_loop_obj.unscale_gradients(optimizer)`` to get true gradient values first.
        """

    def on_after_optimizer_step(self) -> None:
        """After the optimizer step of an update iteration; ``optimizer_step_skipped`` tells an overflow skip."""

    def on_after_batch_prediction(self, y_pred_batch: Any, y_test_batch: Any, metadata_batch: Any,
                                  dataset_info: dict) -> None:
        """After each batch of a ``predict_on_*_set`` pass, with that batch's outputs.

        ``dataset_info`` holds ``{'type': 'train' | 'validation' | 'test'}``.
        """
