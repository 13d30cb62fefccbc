"""What a callback may read and call on the loop it is registered with, in one place.

A callback reaches its loop as ``self.train_loop_obj``. :class:`TrainLoopView` lists that loop's surface for
callbacks: the attributes to read, the few to write, and the methods to call. :class:`~aitoolbox.torchtrain.
train_loop.train_loop.TrainLoop` satisfies it (a test checks), and the package's own callbacks use nothing
else (a test checks that too). Anything else on the loop is an implementation detail that may change.
"""
from typing import Any, Dict, List, Optional, Protocol, Tuple, Union, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class TrainLoopView(Protocol):
    """The loop as a callback sees it.

    Read at any time:

    - ``model``: the user's module; ``optimizer`` / ``optimizers``: as passed, and as a list.
    - ``train_loader``, ``validation_loader``, ``test_loader``: the data. A callback that replaces one (as
      ``DataSubsetTestRun`` does) assigns it; the loop prepares a replaced evaluation loader anew.
      ``validation_loader`` may be a dict of named loaders; ``validation_set_names`` lists them (None for one).
    - ``train_history``: the metrics so far; add to it with :meth:`insert_metric_result_into_history`.
    - ``device``, ``is_main_process`` (truthy, and callable as in aitoolbox 1.x), ``experiment_timestamp``,
      ``run_folder`` (where the run's files go: a preset's experiment folder, or a plain loop's default one),
      :meth:`claim_run_folder` (the same, for a callback that will write into it) and :meth:`cloud_uploads` (the
      background uploads of the files a callback writes, for one with a bucket).
    - ``state`` and its views ``epoch``, ``epochs_completed``, ``iteration``, ``total_iteration_idx``,
      ``num_epochs``, ``num_iterations``, ``grad_accumulation``, ``optimizer_step_due``,
      ``optimizer_step_skipped``, ``stepped_optimizers``, ``early_stop``; ``last_batch_loss`` (the detached loss of the current batch),
      ``last_batch_loss_names`` (a MultiLoss's names) and ``epoch_loss_sum`` (the epoch's losses so far).
    - ``current_batch``: the batch being trained, from ``on_batch_begin`` to ``on_batch_end`` (None outside one).
    - ``finishes_interrupted_step``: the ``fit`` starting now first finishes a step an exception interrupted after
      it was committed (a callback keeps its per-step state for it in ``on_train_begin`` and ``on_epoch_begin``).
    - ``callbacks``: the registered callbacks, in execution order.
    - ``compile_stats``: with ``torch_compile``, the :class:`~aitoolbox.torchtrain.compiling.CompileStats` so far
      (compilations, recompilations, seconds); None without.

    Read once training is set up (from ``on_train_begin`` on): ``precision`` (autocast, loss scaling) and
    ``amp_scaler`` (aitoolbox 1.x's GradScaler-like view of it). ``shards_parameters``: whether checkpoints are
    sharded (written by every process with :meth:`save_sharded_checkpoint`).

    For a callback that changes the run's course (``SpikeRollback``): ``run_state`` (the run's progress, see
    ``train_loop/run_state.py``), ``rollbacks`` (the rollbacks so far), ``epoch_start_rng_state`` (the RNG state the
    current epoch's data order was drawn from), ``experiment_folder`` (a preset's run folder, else None),
    :meth:`take_snapshot`, :meth:`apply_pending_restore`, :meth:`batch_indices` and :meth:`all_reduce_sum`; such a
    callback returns the run to a kept point by raising
    :class:`~aitoolbox.torchtrain.callbacks.rollback_request.RollBack`.

    Write: ``grad_cb_used`` (aitoolbox 1.x's flag, accepted and ignored: every overridden hook is called),
    ``pending_restore`` (read and cleared by checkpoint-loading callbacks before training).
    """

    model: nn.Module
    optimizer: Any
    optimizers: List[torch.optim.Optimizer]
    train_loader: Any
    validation_loader: Any
    validation_set_names: Optional[List[str]]
    test_loader: Any
    train_history: Any
    state: Any
    epoch: int
    epochs_completed: int
    iteration: int
    total_iteration_idx: int
    num_epochs: int
    num_iterations: int
    grad_accumulation: int
    optimizer_step_due: bool
    optimizer_step_skipped: bool
    stepped_optimizers: Tuple[int, ...]
    early_stop: bool
    last_batch_loss: Optional[torch.Tensor]
    callbacks: List[Any]
    message_service: Any  # aitoolbox.torchtrain.callbacks.messages.MessageService
    grad_cb_used: bool
    pending_restore: Optional[dict]
    run_state: Any  # aitoolbox.torchtrain.train_loop.run_state.RunState
    experiment_folder: Any  # a preset's ExperimentFolder, else None

    @property
    def device(self) -> torch.device:
        """The device this process trains on."""

    @property
    def is_main_process(self) -> Any:
        """True in the process that prints and writes files; also callable."""

    @property
    def experiment_timestamp(self) -> str:
        """The run's timestamp."""

    @property
    def run_folder(self) -> Any:
        """The run's ExperimentFolder: a preset's, or ``./aitoolbox_runs/run_<timestamp>/`` of a plain loop."""

    @property
    def epoch_loss_sum(self) -> torch.Tensor:
        """The sum of the current epoch's batch losses so far, batches trained before a resume included."""

    @property
    def last_batch_loss_names(self) -> Optional[List[str]]:
        """The names of the last batch's losses for a MultiLoss, else None."""

    @property
    def current_batch(self) -> Any:
        """The batch being trained, as the training loader yielded it; None outside a training batch."""

    @property
    def finishes_interrupted_step(self) -> bool:
        """The ``fit`` starting now first finishes an optimizer step an exception interrupted after it was
        committed."""

    @property
    def rollbacks(self) -> List[dict]:
        """The rollbacks of the run so far (SpikeRollback), oldest first."""

    @property
    def epoch_start_rng_state(self) -> Optional[dict]:
        """The RNG state the current epoch's data order was drawn from."""

    @property
    def precision(self) -> Any:
        """The loop's :class:`~aitoolbox.torchtrain.precision.Precision`, once set up."""

    @property
    def compile_stats(self) -> Any:
        """With ``torch_compile``: the compilations so far; else None."""

    @property
    def amp_scaler(self) -> Any:
        """``torch.amp.GradScaler``'s methods over the precision (aitoolbox 1.x)."""

    @property
    def shards_parameters(self) -> bool:
        """True under ``gpu_mode='fsdp'``: checkpoints are written by every process (sharded)."""

    def claim_run_folder(self) -> Any:
        """:attr:`run_folder` for a callback that writes into it: a default folder's name is decided now."""

    def cloud_uploads(self) -> Any:
        """The loop's :class:`~aitoolbox.torchtrain.callbacks.cloud_upload.CloudUploads`, registered now if needed
        (for a callback with a bucket to upload its files to)."""

    def take_snapshot(self, mid_epoch: bool = True) -> Any:
        """The run as it is now in host memory (a :class:`~aitoolbox.torchtrain.train_loop.run_snapshot.RunSnapshot`;
        its ``restore(tl)`` puts it back)."""

    def apply_pending_restore(self) -> Any:
        """Inside ``fit``: apply a checkpoint just loaded with :meth:`load_checkpoint`, as ``fit``'s start would."""

    def batch_indices(self, epoch: int, epoch_start_rng: Optional[dict], positions: List[int]) -> Optional[List[int]]:
        """The dataset indices of the training batches at ``positions`` of ``epoch``, drawn again (None: unknown)."""

    def all_gather_objects(self, obj: Any) -> List[Any]:
        """Every process's value of ``obj``, ordered by rank (a collective: every process calls it)."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of ``tensor`` over the processes (a collective: every process calls it)."""

    def broadcast_object(self, obj: Any) -> Any:
        """The main process's value of ``obj`` in every process (a collective: every process calls it)."""

    def save_sharded_checkpoint(self, folder_path: str, mid_epoch: bool = False, hyperparams: Optional[dict] = None,
                                async_save: bool = False, process_group: Any = None) -> Any:
        """Write a sharded (DCP) checkpoint folder; every process calls it with the same path."""

    def stop_training(self, reason: str = "") -> None:
        """Stop after the current batch (at the epoch end under distributed training)."""

    def insert_metric_result_into_history(self, metric_name: str, metric_result: Any) -> None:
        """Append a value to ``train_history[metric_name]``."""

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Make the optimizer's gradients true values before reading or clipping them."""

    def should_execute_optimizer_update(self) -> bool:
        """True when the current batch ends with an optimizer step."""

    def get_schedulers(self) -> list:
        """The registered LR scheduler callbacks."""

    def get_num_training_steps(self) -> int:
        """Optimizer steps the current ``fit`` makes in all."""

    def checkpoint_state(self, mid_epoch: Optional[bool] = None, hyperparams: Optional[dict] = None,
                         include_weights: bool = True) -> dict:
        """Everything needed to continue the run exactly (call it in every process)."""

    def load_checkpoint(self, checkpoint: Union[str, dict], *, weights_only: bool = True,
                        source: Optional[str] = None, continue_run_folder: bool = False) -> dict:
        """Continue from a checkpoint at the start of the next ``fit``."""

    def evaluate_loss_on_train_set(self, force_prediction: bool = False, float_dict_format: bool = False) -> Any:
        """Mean loss per sample over the training set (cached per iteration)."""

    def evaluate_loss_on_validation_set(self, force_prediction: bool = False,
                                        float_dict_format: bool = False, name: Optional[str] = None) -> Any:
        """Mean loss per sample over the validation set (cached per iteration); ``name`` picks one of several
        named validation sets (None: the first)."""

    def evaluate_loss_on_test_set(self, force_prediction: bool = False, float_dict_format: bool = False) -> Any:
        """Mean loss per sample over the test set (cached per iteration)."""

    def predict_on_train_set(self, force_prediction: bool = False, execute_callbacks: bool = False) -> Any:
        """``(y_pred, y_true, metadata)`` over the training set."""

    def predict_on_validation_set(self, force_prediction: bool = False, execute_callbacks: bool = False,
                                  name: Optional[str] = None) -> Any:
        """``(y_pred, y_true, metadata)`` over the validation set (``name``: one of several named sets)."""

    def predict_on_test_set(self, force_prediction: bool = False, execute_callbacks: bool = False) -> Any:
        """``(y_pred, y_true, metadata)`` over the test set."""

    def evaluate_model_loss(self, data_loader: Any, move_to_cpu: bool = False,
                            dataset_info: Optional[Dict] = None) -> Any:
        """Mean loss per sample over any loader (not cached)."""

    def predict_with_model(self, data_loader: Any, execute_callbacks: bool = False, move_to_cpu: bool = False,
                           dataset_info: Optional[Dict] = None) -> Any:
        """``(y_pred, y_true, metadata)`` over any loader (not cached)."""


#: The names a callback may use on its loop (the members of :class:`TrainLoopView`).
TRAIN_LOOP_VIEW_MEMBERS = frozenset(
    list(TrainLoopView.__annotations__)
    + [name for name, value in vars(TrainLoopView).items()
       if not name.startswith("_") and (callable(value) or isinstance(value, property))])
