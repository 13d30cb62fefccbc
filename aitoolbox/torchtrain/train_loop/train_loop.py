"""TrainLoop: the training loop. ``fit`` -> ``_run_epoch`` -> ``_run_batch``; everything else is delegated.

Precision (autocast, loss scaling, the optimizer step) lives in :mod:`aitoolbox.torchtrain.precision`,
device placement and multi-process communication in :mod:`aitoolbox.torchtrain.distributed`, whole-set
evaluation in :mod:`.evaluation`, and user code in callbacks (:mod:`aitoolbox.torchtrain.callbacks`).
"""
import contextlib
import logging
import math
import os
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.activation_checkpointing import (
    apply_activation_checkpointing, check_module_classes, checkpointed_modules)
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.cloud_upload import CloudUploads
from aitoolbox.torchtrain.callbacks.handler import CallbacksHandler
from aitoolbox.torchtrain.callbacks.messages import MessageService
from aitoolbox.torchtrain.compiling import CompileOptions, CompileStats, Compiler
from aitoolbox.torchtrain.distributed.strategy import create_strategy
from aitoolbox.torchtrain.model import ModelWrap, TTModel
from aitoolbox.torchtrain.multi_loss_optim import MultiLoss
from aitoolbox.torchtrain.precision.precision import Precision
from aitoolbox.torchtrain.schedulers.basic import AbstractScheduler
from aitoolbox.torchtrain.train_loop import validation
from aitoolbox.torchtrain.train_loop.distributed_fit import DistributedFitOptions, fit_distributed
from aitoolbox.torchtrain.train_loop.evaluation import Evaluator, loader_length
from aitoolbox.experiment.local_save.experiment_folder import ExperimentFolder, default_run_folder, timestamp_now
from aitoolbox.experiment.local_save.train_end_marker import record_beside, record_train_end_done, train_end_lost
from aitoolbox.torchtrain.train_loop.compat import GradScalerView, MainProcessFlag
from aitoolbox.torchtrain.train_loop.compat import num_training_steps, optimizer_update_due
from aitoolbox.torchtrain.train_loop.epoch_report import EpochReport
from aitoolbox.torchtrain.train_loop.history import TrainingHistory
from aitoolbox.torchtrain.train_loop.interrupts import InterruptGuard
from aitoolbox.torchtrain.train_loop.loop_state import LoopState, LoopStateField
from aitoolbox.torchtrain.train_loop.module_modes import FrozenModules
from aitoolbox.torchtrain.train_loop.losses import EpochLossSum, checked_batch_loss, history_entries, loss_postfix
from aitoolbox.torchtrain.train_loop.losses import LossResult
from aitoolbox.torchtrain.train_loop.lr_suggestion import LRFinderResult
from aitoolbox.torchtrain.train_loop.pred_collate_fns import append_predictions, torch_cat_transf
from aitoolbox.torchtrain.train_loop.progress import ProgressBar
from aitoolbox.torchtrain.train_loop.batch_indices import batch_indices
from aitoolbox.torchtrain.train_loop.rollback import RollBack, roll_back
from aitoolbox.torchtrain.train_loop.run_folders import (
    RunFolderAnnouncement, claim_default_run_folder, continued_run_folder)
from aitoolbox.torchtrain.train_loop.run_snapshot import RunSnapshot
from aitoolbox.torchtrain.train_loop.run_state import RunState
from aitoolbox.torchtrain.train_loop.step_runner import StepRunner
from aitoolbox.torchtrain.train_loop.trained_parameters import check_optimizers_step_the_model
from aitoolbox.torchtrain.train_loop.train_state import (
    MidEpochResume, apply_pending_states, history_lengths, load_pending_sharded_weights, truncate_history,
    warn_unresumable_epoch_start)
from aitoolbox.torchtrain.train_loop.validation_sets import check_validation_loader, validation_set_names
from aitoolbox.torchtrain.train_loop.use_amp import (
    check_use_amp, create_precision, create_sharded_precision, describe_precision, initial_loss_scaler)

logger = logging.getLogger(__name__)


class TrainLoop:
    """Trains a :class:`~aitoolbox.torchtrain.model.TTModel` (or a :class:`~aitoolbox.torchtrain.model.ModelWrap`).

    Args:
        model: the model; a TTModel, or ``ModelWrap(module, feed_definition)`` for a plain ``nn.Module``.
        train_loader: batches to train on.
        validation_loader: batches for ``val_loss`` and validation metrics, or None; or a dict of named loaders
            (``{'in_domain': dl1, 'shifted': dl2}``), each recorded as ``val_<name>_loss``, ``val_<name>_<metric>``,
            the first also as ``val_loss``, ``val_<metric>`` (see :mod:`.validation_sets`).
        test_loader: batches for the final test evaluation, or None.
        optimizer: a ``torch.optim.Optimizer`` or a list of them (all step together).
        criterion: handed to ``get_loss`` as it is (a loss function, a dict of them...); None when the model
            computes its own loss. An ``nn.Module`` criterion is moved to the training device.
        collate_batch_pred_fn: ``fn(batch_output, collected) -> collected`` collecting predictions per batch.
        pred_transform_fn: ``fn(collected)`` joining the collected predictions (default: ``torch.cat``).
        end_auto_eval: at each epoch end record the train-set ``loss`` and ``val_loss`` (True), never
            (False), or every N epochs (an int); with a test loader also ``train_end_test_loss`` at the end.
        lazy_experiment_save: for the experiment-tracking presets: create the experiment folder only when the
            first file is written.
        print_callbacks: log the registered callbacks at the start of training.
        gpu_mode: ``'single'`` (one GPU, or the CPU), ``'dp'`` (DataParallel over local GPUs), ``'ddp'``
            (one process per device, see :meth:`fit_distributed`) or ``'fsdp'`` (one process per device, each
            holding a shard of the parameters, gradients and optimizer state: FSDP2).
        cuda_device_idx: the GPU to train on in single mode; None picks the current one (or the CPU).
        use_amp: mixed precision: False, True (autocast in the device's default low-precision dtype with
            dynamic loss scaling where needed; float32, with a warning, on a CPU without native bfloat16, where
            bfloat16 is emulated and slower), or a dict of ``amp.initialize`` keyword arguments (honoured as given).
        show_progress: show tqdm progress bars.
        torch_compile: compile the model's forward (in place: ``state_dict`` keys are unchanged) and the optimizers'
            steps with ``torch.compile``: False, True (torch's defaults, except that dimension 0 of an input whose
            size is the training loader's ``batch_size`` is compiled dynamic from the first batch, so the smaller
            last batch needs no second graph; an explicit ``'dynamic'`` turns that off), or a dict of
            ``torch.compile`` options (``backend``, ``mode``, ``fullgraph``, ``dynamic``, ``options``) plus
            ``'fallback': 'eager'`` (warn and run uncompiled what cannot be compiled, instead of an error),
            ``'optimizer_step': False`` (compile only the model) and ``'verify': False`` (skip the check of the
            compiled gradients against eager ones on the first batch, which stops a miscompiled model before it
            trains wrong). See :mod:`aitoolbox.torchtrain.compiling` and the "Faster training" docs page.
        activation_checkpointing: ``nn.Module`` classes (e.g. ``[nn.TransformerEncoderLayer]``) whose instances in
            the model recompute their activations in backward instead of keeping them (less memory, about one
            more forward of them); see :mod:`aitoolbox.torchtrain.activation_checkpointing`.
        epoch_line_metrics: the history entries the epoch's summary line shows, as names or ``fnmatch`` patterns
            (``["accumulated_loss", "val_*loss", "val_*F1"]``); None (the default) shows every entry the epoch
            recorded. Settable later as ``tl.epoch_line_metrics``. The history and the trackers keep everything.
    """

    def __init__(self, model: Union[TTModel, ModelWrap], train_loader: DataLoader,
                 validation_loader: Union[DataLoader, Mapping[str, DataLoader], None],
                 test_loader: Optional[DataLoader],
                 optimizer: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]],
                 criterion: Optional[Callable],
                 collate_batch_pred_fn: Callable = append_predictions, pred_transform_fn: Callable = torch_cat_transf,
                 end_auto_eval: Union[bool, int] = True, lazy_experiment_save: bool = False,
                 print_callbacks: bool = False, gpu_mode: str = "single", cuda_device_idx: Optional[int] = None,
                 use_amp: Union[bool, dict] = False, show_progress: bool = True,
                 torch_compile: Union[bool, dict] = False,
                 activation_checkpointing: Optional[Sequence[type]] = None,
                 epoch_line_metrics: Optional[Sequence[str]] = None):
        # The TTModel the loop calls (an adapter for a ModelWrap); ``model`` is the user's own module, as in 1.x.
        self.loop_model = validation.resolve_model(model)
        self.model: nn.Module = model.model if isinstance(model, ModelWrap) else model
        self.batch_model_feed_def = model.batch_model_feed_def if isinstance(model, ModelWrap) else None
        validation.check_loader(train_loader, "train_loader")
        check_validation_loader(validation_loader)
        validation.check_loader(test_loader, "test_loader")
        self.optimizers: List[torch.optim.Optimizer] = validation.as_optimizer_list(optimizer)
        validation.check_criterion(criterion)
        validation.check_end_auto_eval(end_auto_eval)
        self.train_loader = train_loader
        self.validation_loader = validation_loader
        self.test_loader = test_loader
        self.optimizer = optimizer
        self.num_optimizers = len(self.optimizers)
        self.criterion = criterion
        self.collate_batch_pred_fn = collate_batch_pred_fn
        self.pred_transform_fn = pred_transform_fn
        self.end_auto_eval = end_auto_eval
        self.lazy_experiment_save = lazy_experiment_save
        self.print_callbacks = print_callbacks
        self.gpu_mode = gpu_mode
        self.cuda_device_idx = cuda_device_idx
        self.show_progress_bars = show_progress
        self.strategy = create_strategy(gpu_mode, cuda_device_idx)
        check_use_amp(use_amp, self.strategy.device)
        self.use_amp = use_amp
        self._precision: Optional[Precision] = None
        self._precision_chosen_by_user = False  # tl.precision assigned before fit: kept for every strategy
        self._precision_announced = False
        compile_options = CompileOptions.from_argument(torch_compile)
        if compile_options is not None and gpu_mode == "dp":
            raise ValueError("torch_compile does not work with gpu_mode='dp': DataParallel copies the model to every "
                             "GPU at every forward, and the copies would call the compiled original. Use "
                             "gpu_mode='ddp' (one process per GPU), which compiles in every process.")
        self.torch_compile = torch_compile
        self.activation_checkpointing = check_module_classes(activation_checkpointing)
        if self.activation_checkpointing:
            checkpointed_modules(self.model, self.activation_checkpointing)  # none selected: an error now
        # With several optimizers a MultiLoss keeps the graph for the next loss's backward (StepRunner).
        self._compiler = Compiler(compile_options, self._loop_position, keeps_graph=len(self.optimizers) > 1) \
            if compile_options else None
        self.amp_scaler = GradScalerView(self._current_precision, self._initial_loss_scaler)

        self.run_state = RunState(LoopState())  # the one place a run's progress lives (see run_state.py)
        self.state = self.run_state.counters
        self.last_batch_loss: Optional[torch.Tensor] = None
        self._current_batch: Any = None  # the batch _run_batch is training, for callbacks (current_batch)
        self._interrupted_batch: Any = None  # the batch whose step an exception interrupted (_finish_interrupted_step)
        # The callbacks (ids) that a fit registered and whose on_train_begin is still to come while it finishes the
        # last fit's train end: an exception there is no concern of theirs (no on_exception).
        self._waiting_for_train_begin: set = set()
        self._batch_end_done: Optional[List[int]] = None  # a committed batch's on_batch_end in progress (_end_batch)
        self._plain_batches = False  # set per fit: neither the strategy nor the precision has a context for a batch
        self.grad_cb_used = False  # aitoolbox 1.x's flag for gradient hooks: every overridden hook runs here anyway
        self.train_history = TrainingHistory(has_validation=validation_loader is not None)
        self.message_service = MessageService()  # before any callback registers: they keep a reference
        self.callbacks_handler = CallbacksHandler(self)
        self.callbacks: List[AbstractCallback] = self.callbacks_handler.callbacks
        # Set by the experiment-tracking presets (TrainLoopCheckpoint, ...): where files of this run go.
        self.experiment_folder = None
        self._timestamp = timestamp_now()
        # A plain loop's run folder for callbacks given no experiment details; nothing is created on disk before a
        # callback claims it (claim_run_folder) and writes the first file.
        self._default_run_folder = default_run_folder(self._timestamp)
        self._launches_processes = False  # fit_distributed was called: processes and this one share folder names
        self._run_folders = RunFolderAnnouncement()
        self._model_runner = None
        self._step_runner: Optional[StepRunner] = None  # with the model runner and precision, by set_up
        self._loss_names: Optional[List[str]] = None  # the names of the last batch's MultiLoss, if it was one
        self._evaluator = Evaluator(self)
        self._epoch_report = EpochReport()
        self.epoch_line_metrics = epoch_line_metrics
        self._stop_reasons: Optional[List[str]] = None  # while an epoch runs: its stop messages, logged after its line
        # In a process other than the main one: its stop requests' reasons, which the main process logs once the
        # processes agree to stop (only the main process logs them).
        self._stop_requests_here: List[str] = []
        # The record of a loaded checkpoint whose lost train end this fit runs (see _lost_train_end), until written.
        self._lost_end_record: Optional[str] = None
        self._stop_reasons_logged: List[str] = []  # the main process's reasons logged outside an epoch, not agreed yet
        self._interrupts = InterruptGuard()  # Ctrl-C waits for the end of the batch
        # Submodules the user put in eval mode before fit (a frozen BatchNorm) stay in eval mode while training.
        self.frozen_modules = FrozenModules()

    # The loop's counters and flags live in ``self.state``; these are the names callbacks and 1.x code use.
    epochs_completed = LoopStateField()
    iteration = LoopStateField()
    total_iteration_idx = LoopStateField()  # index of the last batch trained (aitoolbox 1.x): -1 before training
    num_epochs = LoopStateField()
    num_iterations = LoopStateField()
    grad_accumulation = LoopStateField()
    optimizer_step_due = LoopStateField()
    optimizer_step_skipped = LoopStateField()
    stepped_optimizers = LoopStateField()
    early_stop = LoopStateField()

    # --- the documented surface callbacks use -------------------------------------------------------------
    @property
    def validation_loader(self) -> Union[DataLoader, Mapping[str, DataLoader], None]:
        """The validation data: None, one loader, or a dict of named loaders (checked when assigned)."""
        return self._validation_loader

    @validation_loader.setter
    def validation_loader(self, loader: Union[DataLoader, Mapping[str, DataLoader], None]) -> None:
        check_validation_loader(loader)  # also a loader replaced later (InMultiProcessDataLoad, DataSubsetTestRun)
        self._validation_loader = loader

    @property
    def validation_set_names(self) -> Optional[List[str]]:
        """The names of the validation sets, in order, when ``validation_loader`` is a dict; else None."""
        return validation_set_names(self._validation_loader)

    @property
    def device(self) -> torch.device:
        """The device this process trains on."""
        return self.strategy.device

    @property
    def is_main_process(self) -> MainProcessFlag:
        """True in the process that prints and writes files (global rank 0); also callable, as in 1.x."""
        return MainProcessFlag(self._is_main_process)

    def _is_main_process(self) -> bool:
        return self.strategy.is_main_process

    @property
    def show_progress(self) -> bool:
        return self.show_progress_bars and self.strategy.is_main_process

    @property
    def epoch(self) -> int:
        """The index of the current epoch (of the last one, after ``fit``)."""
        return self.state.epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        # aitoolbox 1.x users continue training by setting tl.epoch before fit: the next epoch trained is this one.
        self.state.epoch = epoch
        self.state.epochs_completed = epoch

    @property
    def experiment_timestamp(self) -> str:
        """The run's timestamp: its run folder's (a preset's, or the default one: the time the TrainLoop was built,
        suffixed ``_1`` when another run of that second claimed the name first)."""
        return self.run_folder.timestamp

    @property
    def run_folder(self) -> ExperimentFolder:
        """Where this run's files go: a preset's experiment folder, or for a plain TrainLoop the default
        ``<working directory>/aitoolbox_runs/run_<timestamp>/`` that file-writing callbacks given no experiment
        details share. Reading it creates nothing; see :meth:`claim_run_folder`."""
        return self.experiment_folder if self.experiment_folder is not None else self._default_run_folder

    def claim_run_folder(self) -> ExperimentFolder:
        """:attr:`run_folder`, for a callback that will write into it (called when it is registered). A plain
        loop's default folder gets its name decided now in a training of one process (creating ``aitoolbox_runs/``
        and the name's claim file, not the run folder): a run started within the same second as another writes
        into ``run_<timestamp>_1``, and the paths callbacks derive from the folder now stay true. Under several
        processes every process (and the launching one) names it by the timestamp alone."""
        folder = self.run_folder
        if folder is self._default_run_folder:
            in_one_process = not (self._launches_processes or self.strategy.is_distributed
                                  or self.gpu_mode in ("ddp", "fsdp"))
            claim_default_run_folder(folder, reserve=in_one_process)
        return folder

    def cloud_uploads(self) -> CloudUploads:
        """The loop's background cloud uploads (a callback run after all others), registered now if it has none
        yet: a callback with a bucket to write to hands its files to it."""
        return CloudUploads.of(self)

    def take_snapshot(self, mid_epoch: bool = True) -> RunSnapshot:
        """The run as it is now, copied into host memory (set up first, as ``fit`` would); ``snapshot.restore(tl)``
        puts it back. ``mid_epoch``: taken inside an epoch, to continue it at the same batch.

        Raises:
            ValueError: the model is sharded (FSDP): keep a checkpoint instead.
        """
        return RunSnapshot.take(self, mid_epoch=mid_epoch)

    def apply_pending_restore(self) -> Optional[MidEpochResume]:
        """Inside ``fit``: apply the checkpoint :meth:`load_checkpoint` loaded now (precision, callbacks', scheduler
        and random states) as the start of ``fit`` would; returns where its epoch continues (None: at an epoch's
        start)."""
        return apply_pending_states(self)

    def batch_indices(self, epoch: int, epoch_start_rng: Optional[dict], positions: List[int]) -> Optional[List[int]]:
        """The dataset indices of the training batches at ``positions`` of epoch ``epoch``, whose data order was
        drawn from ``epoch_start_rng`` (:attr:`epoch_start_rng_state` during that epoch), drawn again without
        loading anything; None where the loader cannot tell (an iterable dataset) or the state is unknown. Every
        random state is as before afterwards."""
        return batch_indices(self.train_loader, epoch, epoch_start_rng, positions)

    @property
    def epoch_loss_sum(self) -> torch.Tensor:
        """The sum of the current epoch's batch losses so far (``accumulated_loss`` is its mean)."""
        return self.run_state.epoch_loss.total()

    @property
    def current_batch(self) -> Any:
        """The batch being trained, as the training loader yielded it (after the strategy moved it, where it does),
        from ``on_batch_begin`` to ``on_batch_end``; None outside a training batch. Read it, do not change it."""
        return self._current_batch

    @property
    def finishes_interrupted_step(self) -> bool:
        """True when the next ``fit`` starts by finishing an optimizer step an exception interrupted after it was
        committed (in a callback's hook after the step, or between optimizers): the hooks that had not returned
        for it run then. A callback keeps its per-step state for that step in ``on_train_begin`` while this holds."""
        return self._batch_end_done is not None or (
            self._step_runner is not None and self._step_runner.has_interrupted_step)

    @property
    def pending_restore(self) -> Optional[dict]:
        """A loaded checkpoint whose precision, callback and RNG states ``fit`` applies when it starts."""
        return self.run_state.pending_checkpoint

    @pending_restore.setter
    def pending_restore(self, checkpoint: Optional[dict]) -> None:
        self.run_state.pending_checkpoint = checkpoint
        self.run_state.pending_source = None  # a file's name comes with run_state.load, after this

    @property
    def epoch_start_rng_state(self) -> Optional[dict]:
        """The RNG state the current epoch's data order was drawn from (mid-epoch checkpoints store it)."""
        return self.run_state.epoch_start_rng

    @property
    def last_batch_loss_names(self) -> Optional[List[str]]:
        """The names of the last batch's losses when ``get_loss`` returned a MultiLoss, else None."""
        return self._loss_names

    @property
    def iterations_done(self) -> int:
        """Batches trained over the life of this TrainLoop."""
        return self.state.iterations_done

    @property
    def compile_stats(self) -> Optional[CompileStats]:
        """With ``torch_compile``: the compilations so far (count, recompilations, seconds, when); else None."""
        return self._compiler.stats if self._compiler is not None else None

    @property
    def shards_parameters(self) -> bool:
        """True under ``gpu_mode='fsdp'``: each process holds only its shards of the weights and optimizer state,
        and checkpoints are sharded (see :meth:`save_sharded_checkpoint`)."""
        return bool(self.strategy.shards_parameters)

    def all_gather_objects(self, obj: Any) -> List[Any]:
        """Every process's value of ``obj`` (picklable), ordered by rank (``[obj]`` in a single process); a collective
        in a distributed run: every process calls it at the same point."""
        return self.strategy.all_gather_objects(obj)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of ``tensor`` over the processes (``tensor`` itself in a single process); a collective in a
        distributed run: every process calls it at the same point."""
        return self.strategy.all_reduce_sum(tensor)

    def broadcast_object(self, obj: Any) -> Any:
        """The main process's value of ``obj`` (picklable), in every process; a collective in a distributed run:
        every process calls it at the same point."""
        return self.strategy.broadcast_object(obj)

    def save_sharded_checkpoint(self, folder_path: str, mid_epoch: bool = False, hyperparams: Optional[dict] = None,
                                async_save: bool = False, process_group: Any = None) -> Any:
        """Write a sharded checkpoint of this run into the folder ``folder_path`` (a collective: every process
        calls it with the same path): each process writes its shards of the model and optimizer states with
        torch's DCP, and the rest of :meth:`checkpoint_state` beside them. :meth:`load_checkpoint` continues from
        the folder with any number of processes. See :mod:`aitoolbox.experiment.local_save.sharded_checkpoints`.

        Args:
            folder_path: the checkpoint folder, e.g. ``checkpoint_model/model_<experiment>_<timestamp>_E<epoch>``.
            mid_epoch: True inside an epoch (after an optimizer step), False at its end.
            hyperparams: stored with the checkpoint.
            async_save: return once the state is copied to host memory; DCP writes it in the background.
            process_group: the group DCP's collectives run in (for ``async_save``, one of their own:
                :func:`~aitoolbox.experiment.local_save.sharded_checkpoints.checkpoint_process_group`).

        Returns:
            A :class:`~aitoolbox.experiment.local_save.sharded_checkpoints.ShardedCheckpointSave`: its ``wait()``
            returns the path once the checkpoint is complete (raising what the save met).
        """
        from aitoolbox.experiment.local_save.sharded_checkpoints import save_sharded_checkpoint
        extra_state = self.checkpoint_state(mid_epoch=mid_epoch, hyperparams=hyperparams, include_weights=False)
        return save_sharded_checkpoint(folder_path, self.loop_model, self.optimizers, extra_state,
                                       async_save=async_save, process_group=process_group)

    def _loop_position(self) -> tuple:
        return self.state.epoch, self.state.iteration

    @property
    def model_runner(self) -> Any:
        """What the loop calls ``get_loss``/``get_predictions`` on: the model as set up by the strategy (the model
        itself, or a parallel wrapper around it). It exists once ``fit``, an evaluation or a prediction started."""
        if self._model_runner is None:
            raise RuntimeError("tl.model_runner is set up when fit, an evaluation or a prediction starts (the model "
                               "is placed on its device and prepared for mixed precision then): read it from a "
                               "callback hook or after fit")
        return self._model_runner

    @property
    def precision(self) -> Precision:
        """Autocast, loss scaling and the optimizer step (see :mod:`aitoolbox.torchtrain.precision`). It exists once
        ``fit``, an evaluation or a prediction started; assign one before to choose it yourself."""
        if self._precision is None:
            raise RuntimeError("tl.precision is created from use_amp when fit, an evaluation or a prediction starts "
                               "(amp.initialize needs the model on its device): read it from a callback hook or "
                               "after fit, or assign tl.precision = Precision(...) before fit to choose it")
        return self._precision

    @precision.setter
    def precision(self, precision: Precision) -> None:
        self._precision = precision
        self._precision_chosen_by_user = precision is not None
        self._plain_batches = False  # its autocast is entered from the next batch on
        if self._step_runner is not None:
            self._step_runner.precision = precision

    def _current_precision(self) -> Optional[Precision]:
        return self._precision

    def _initial_loss_scaler(self) -> Any:
        return initial_loss_scaler(self.use_amp, self.loop_model, self.optimizers, self.device)

    def set_up(self) -> None:
        """Apply activation checkpointing, place the model on its device, prepare mixed precision
        (``amp.initialize``), then wrap it for parallel training (FSDP: shard it), once per strategy; with
        ``torch_compile``, compile the model in place. ``fit``, the evaluation and prediction methods and
        :meth:`checkpoint_state` call it first: call it yourself only to inspect the prepared model."""
        if self._model_runner is None:
            if self.activation_checkpointing:  # before any wrap: sharding and compiling see the checkpointed forwards
                apply_activation_checkpointing(self.model, self.activation_checkpointing)
            self.strategy.place_model(self.loop_model)
            for optimizer in self.optimizers:
                if _state_on_another_device(optimizer) and callable(getattr(optimizer, "load_state_dict", None)):
                    # A checkpoint loaded before the model was placed: its state follows the parameters
                    # (load_state_dict puts each state tensor where its parameter is).
                    optimizer.load_state_dict(optimizer.state_dict())
            if not self.strategy.shards_parameters:  # a sharded checkpoint read whole, before amp copies the weights
                load_pending_sharded_weights(self)
            self.criterion = self.strategy.setup_criterion(self.criterion)
            policy = None
            if self._precision is None and self.strategy.shards_parameters:
                self._precision, policy = create_sharded_precision(self.use_amp, self.loop_model, self.optimizers,
                                                                   self.device)
                self.strategy.set_mixed_precision(policy)
                self._precision.agree_on_overflow = self.strategy.any_process  # each rank sees only its shards
            elif self._precision is None:
                self._precision = create_precision(self.use_amp, self.loop_model, self.optimizers, self.device)
            if self.use_amp and not self._precision_announced and self.strategy.is_main_process:
                self._precision_announced = True  # once, as Lightning says which precision it uses
                logger.info("Mixed precision (use_amp=%r): %s", self.use_amp,
                            describe_precision(self._precision, self.loop_model, policy))
            self.amp_scaler.hand_over(self._precision)
            if self.strategy.is_distributed and not self.strategy.shards_parameters:
                # Gradients accumulated into float32 masters bypass DDP's all-reduce (see Precision).
                self._precision.average_across_processes = self.strategy.average_tensors
            for optimizer in self.optimizers:
                if _state_unlike_parameters(optimizer) and callable(getattr(optimizer, "load_state_dict", None)):
                    # A checkpoint loaded before amp cast the model (O3: bfloat16 parameters): load_state_dict
                    # gives the state its parameter's dtype again, as a straight run has it.
                    optimizer.load_state_dict(optimizer.state_dict())
            self._model_runner = self.strategy.wrap_model_and_optimizers(self.loop_model, self.optimizers)
            load_pending_sharded_weights(self)  # under FSDP: each process reads its own shards
            self._step_runner = StepRunner(
                self._precision, self.optimizers, self.optimizer, self.callbacks_handler, self.state,
                backwards_first=self.strategy.is_distributed or self._compiler is not None,
                sync_skipped_gradients=self.strategy.sync_skipped_gradients,
                batch_done=self.run_state.mark_batch_done, amp_scaler=self.amp_scaler)
        if self._compiler is not None:  # in place, so also under a parallel wrapper (it calls the model)
            self._compiler.prepare(self.model, self._precision, getattr(self.train_loader, "batch_size", None))

    def use_strategy(self, strategy: Any, use_amp: Union[bool, dict, None] = None) -> None:
        """Train with another distribution strategy from now on (a process of a distributed job does this): the
        model is set up again for it, and evaluation loaders are prepared afresh.

        Args:
            strategy: the new strategy (see :mod:`aitoolbox.torchtrain.distributed`).
            use_amp: replaces ``use_amp`` when not None (``fit_distributed``'s ``amp_init_args``).
        """
        if use_amp is not None:
            check_use_amp(use_amp, strategy.device)
            self.use_amp = use_amp
        if self._precision_chosen_by_user:
            validation.check_user_precision(self._precision, strategy.shards_parameters, strategy.device, use_amp)
        self.strategy = strategy
        self._model_runner = self._step_runner = None
        if not self._precision_chosen_by_user:
            self._precision = None
        self._evaluator.clear_cache()

    @property
    def epoch_line_metrics(self) -> Optional[List[str]]:
        """The names or ``fnmatch`` patterns of the history entries the epoch's summary line shows (None: all)."""
        return self._epoch_report.shown

    @epoch_line_metrics.setter
    def epoch_line_metrics(self, patterns: Optional[Sequence[str]]) -> None:
        self._epoch_report.show_only(patterns)

    def stop_training(self, reason: str = "") -> None:
        """Ask the loop to stop after the current batch (early stopping, NaN loss, ...).

        In distributed training the stop takes effect at the epoch's end, once the processes agree; a reason given
        in a process other than the main one is logged by the main process then, naming the process's rank.
        """
        self.early_stop = True
        if not self.strategy.is_main_process:
            if reason not in self._stop_requests_here:  # a callback may ask again at every batch until the stop
                self._stop_requests_here.append(reason)
        elif reason:
            self._log_stop_reason(reason)

    def _log_stop_reason(self, reason: str) -> None:
        if self._stop_reasons is not None:  # after the epoch's line, as Keras prints it
            if reason not in self._stop_reasons:  # asked again at each batch until the epoch's end (distributed)
                self._stop_reasons.append(reason)
        else:
            logger.info("Stopping training: %s", reason)
            if self.strategy.is_distributed:  # outside an epoch (on_train_begin): agreed on right after
                self._stop_reasons_logged.append(reason)

    def _log_stop_reasons(self) -> None:
        for reason in self._stop_reasons or ():
            logger.info("Stopping training: %s", reason)
        self._stop_reasons = None

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer``'s gradients true values (undo loss scaling); idempotent within a step."""
        self.precision.unscale_(optimizer)

    def insert_metric_result_into_history(self, metric_name: str, metric_result: Any) -> None:
        """Append a value to ``train_history[metric_name]``."""
        self.train_history.insert_single_result_into_history(metric_name, metric_result)

    check_loss = staticmethod(validation.check_loss)

    # --- aitoolbox 1.x's queries for callbacks ------------------------------------------------------------
    def should_execute_optimizer_update(self) -> bool:
        """True when the current batch ends with an optimizer step: every ``grad_accumulation`` batches, at the
        epoch's last batch, and at the last batch of a ``num_iterations`` run."""
        return optimizer_update_due(self.state, self.run_state.window_end_length(self.train_loader))

    def get_schedulers(self) -> list:
        """The registered LR scheduler callbacks (instances of ``AbstractScheduler``), in execution order."""
        return [callback for callback in self.callbacks if isinstance(callback, AbstractScheduler)]

    def get_num_training_steps(self) -> int:
        """Optimizer steps the current ``fit`` takes over the whole run (``num_epochs`` / ``num_iterations`` are
        totals), for warm-up and decay schedules: exactly the steps the loop takes (see
        :func:`~aitoolbox.torchtrain.train_loop.compat.num_training_steps`)."""
        return num_training_steps(self.state, loader_length(self.train_loader))

    # --- evaluation and prediction over whole data sets (see :class:`.evaluation.Evaluator`) ----------------
    @property
    def auto_eval_due(self) -> bool:
        """True when the loop records ``loss``/``val_loss`` at the end of the current epoch (``end_auto_eval``)."""
        if self.end_auto_eval is True or self.end_auto_eval is False:
            return self.end_auto_eval
        return (self.epoch + 1) % self.end_auto_eval == 0

    def evaluate_loss_on_train_set(self, force_prediction: bool = False, float_dict_format: bool = False):
        """Mean loss per sample over the training set, in eval mode (cached within one training iteration).

        Args:
            force_prediction: evaluate again even if this iteration's value is cached.
            float_dict_format: return a float (a ``{name: float}`` dict for a MultiLoss) instead of a 0-dim
                float64 tensor (a MultiLoss of them).
        """
        return self._evaluator.loss_on("train", force_prediction, float_dict_format)

    def evaluate_loss_on_validation_set(self, force_prediction: bool = False, float_dict_format: bool = False,
                                        name: Optional[str] = None):
        """Mean loss per sample over the validation set; arguments as :meth:`evaluate_loss_on_train_set`.

        With several validation sets (a dict ``validation_loader``) it answers for the set ``name``, by default the
        first one (the set ``val_loss`` is recorded from)."""
        return self._evaluator.loss_on("validation", force_prediction, float_dict_format, name=name)

    def evaluate_loss_on_test_set(self, force_prediction: bool = False, float_dict_format: bool = False):
        """Mean loss per sample over the test set; arguments as :meth:`evaluate_loss_on_train_set`."""
        return self._evaluator.loss_on("test", force_prediction, float_dict_format)

    def evaluate_model_loss(self, data_loader: DataLoader, move_to_cpu: bool = False,
                            dataset_info: Optional[dict] = None) -> LossResult:
        """Mean loss per sample over any loader (not cached): a 0-dim float64 tensor, or a MultiLoss of them.

        Args:
            data_loader: the batches to evaluate on.
            move_to_cpu: return the value on the CPU rather than on the training device.
            dataset_info: e.g. ``{'type': 'validation'}``, shown in the progress bar.
        """
        dataset_type = (dataset_info or {}).get("type", "data")
        loss = self._evaluator.evaluate_loss(data_loader, dataset_type, force=True, cache=False)
        return loss.cpu() if move_to_cpu else loss.to(self.device)

    def predict_on_train_set(self, force_prediction: bool = False, execute_callbacks: bool = False):
        """``(y_pred, y_true, metadata)`` over the training set (cached within one training iteration).

        Args:
            force_prediction: predict again even if this iteration's predictions are cached.
            execute_callbacks: call the callbacks' ``on_after_batch_prediction`` after each batch.
        """
        return self._evaluator.predictions_on("train", force_prediction, execute_callbacks)

    def predict_on_validation_set(self, force_prediction: bool = False, execute_callbacks: bool = False,
                                  name: Optional[str] = None):
        """``(y_pred, y_true, metadata)`` over the validation set; arguments as :meth:`predict_on_train_set`.

        With several validation sets (a dict ``validation_loader``) it predicts on the set ``name``, by default the
        first one."""
        return self._evaluator.predictions_on("validation", force_prediction, execute_callbacks, name=name)

    def predict_on_test_set(self, force_prediction: bool = False, execute_callbacks: bool = False):
        """``(y_pred, y_true, metadata)`` over the test set; arguments as :meth:`predict_on_train_set`."""
        return self._evaluator.predictions_on("test", force_prediction, execute_callbacks)

    def predict_with_model(self, data_loader: DataLoader, execute_callbacks: bool = False, move_to_cpu: bool = False,
                           dataset_info: Optional[dict] = None):
        """``(y_pred, y_true, metadata)`` over any loader (not cached).

        Args:
            data_loader: the batches to predict on.
            execute_callbacks: call the callbacks' ``on_after_batch_prediction`` after each batch.
            move_to_cpu: accepted for 1.x compatibility; the collate functions decide where outputs live.
            dataset_info: e.g. ``{'type': 'test'}``, handed to the callbacks and shown in the progress bar.
        """
        dataset_type = (dataset_info or {}).get("type", "data")
        return self._evaluator.predict(data_loader, dataset_type, execute_callbacks=execute_callbacks, force=True,
                                       cache=False, dataset_info=dataset_info)

    def checkpoint_state(self, mid_epoch: Optional[bool] = None, hyperparams: Optional[dict] = None,
                         include_weights: bool = True) -> dict:
        """Everything needed to continue this run exactly (see :mod:`.train_state`); call it in every process.

        ``include_weights=False`` leaves out the model and optimizer states (a sharded checkpoint writes those
        with DCP and stores this dict beside them). The dict's weight and optimizer tensors are the live run's (no
        copy is made): save it, or copy it (``copy.deepcopy``), to keep this moment while training goes on.

        A mid-epoch checkpoint (``mid_epoch=True``) records a step point: taken in ``on_batch_end`` of a batch whose
        optimizer stepped, that step; taken after ``fit`` raised inside an epoch, the last optimizer step, where the
        next ``fit`` continues. An epoch-end checkpoint (``mid_epoch=False``) records the run at the end of an
        epoch. Where the run stands at an epoch boundary (before the first ``fit``, after a ``fit`` that ended with
        an epoch, in ``on_epoch_begin`` before the epoch's first batch, in the epoch's end) there is no position
        inside an epoch to record, and a mid-epoch checkpoint is the epoch-end one: it continues from the next
        epoch's first batch. The default (None) takes the run where it stands: a mid-epoch checkpoint where it stands
        inside an epoch, an epoch-end one otherwise. Inside an epoch means between its batches, and also at a point
        the run continues from before the epoch's batches start again: after a ``fit`` that an exception or a stop
        signal ended between them (and in ``on_epoch_begin`` of the ``fit`` that continues), at a loaded mid-epoch
        checkpoint's position (before ``fit``, in its ``on_train_begin`` and ``on_epoch_begin``), and in the
        ``on_epoch_begin`` that starts the replay of a rollback (``SpikeRollback``), at the point it returned to.

        Raises:
            RuntimeError: after a ``fit`` that an exception stopped in an epoch's end before its evaluation, or in
                its train end (``fit`` finishes that end first).
                In the train end before ``on_train_end`` (``on_before_train_end``, the test-set evaluation): a
                checkpoint holds no train end, so a resume would skip it; take it in ``on_train_end``.
                In an epoch's end before its evaluation (``on_epoch_train_end``, the evaluation itself): the end's
                remaining steps (evaluation, ``on_epoch_end``) cannot be held by a checkpoint, so a resume would
                skip them; take it in ``on_epoch_end``.
                ``mid_epoch=True`` (or the default) away from a step point: inside an accumulation window
                (gradients of batches not stepped yet, which a checkpoint does not hold), inside a batch before its
                optimizer step (``on_batch_begin``, a gradient hook: a checkpoint would skip the batch), between the
                steps of several optimizers stepping in turn (``on_after_optimizer_step`` of a MultiOptimizer's
                step), or with an optimizer step an exception interrupted between two optimizers (``fit`` finishes it
                first).
                ``mid_epoch=False`` where the run stands inside an epoch (see above): the checkpoint would start
                that epoch again on weights already trained on some of its batches, which a resume would train again.
        """
        run_state = self.run_state
        if run_state.interrupted_in_train_end:
            # (Review 48l F2.) A checkpoint holds no train end: a resume from it would say "Nothing to train".
            raise RuntimeError(
                "checkpoint_state was called after fit stopped in its train end (an exception in a callback's "
                "on_before_train_end or on_train_end, or in the test-set evaluation): a checkpoint cannot hold the "
                "steps of that end still to run (the test-set loss, the callbacks' on_train_end: final saves, "
                "uploads), so a resume would skip them. Call fit to finish the train end first (with the same "
                "num_epochs / num_iterations it trains nothing more), then take the checkpoint")
        if run_state.in_train_end_before_on_train_end:
            # As in an epoch's end before its evaluation: a checkpoint holds no train end.
            raise RuntimeError(
                "checkpoint_state was called in its train end before the callbacks' on_train_end (in "
                "on_before_train_end, or during the test-set evaluation): a checkpoint cannot hold the steps of that "
                "end still to run (the test-set loss, every on_train_end: final saves, uploads), so a resume from it "
                "would report nothing to train and skip them. Take the checkpoint in on_train_end, from a callback "
                "that runs after the others (a high execution_order), or in on_epoch_end")
        if run_state.interrupted_before_epoch_evaluation:
            # (After the evaluation, in on_epoch_end, the checkpoint callbacks run last: what a failed save leaves
            # for the user to take is the epoch's state, which its error message says to save elsewhere.)
            raise RuntimeError(
                f"checkpoint_state was called after fit stopped in the end of epoch {self.epoch} before the epoch was "
                "evaluated (an exception in on_epoch_train_end or the evaluation): a checkpoint cannot hold the steps "
                "of that end still to run (the evaluation, the callbacks' on_epoch_end), so a resume would skip them. "
                "Call fit to finish the epoch's end first, then take the checkpoint")
        if run_state.in_epoch_end_before_evaluation:
            # (Review 45b.) The end's steps still to run are named by the identity of this loop's callbacks, and
            # those of the hook in progress are partly done: no checkpoint can say which a resume must run.
            raise RuntimeError(
                f"checkpoint_state was called in the end of epoch {self.epoch} before its evaluation (in "
                "on_epoch_train_end, or during the end-of-epoch evaluation): the epoch's batches are trained, but the "
                "rest of its end has not run (the callbacks' on_epoch_train_end after this one, the evaluation into "
                "the history, every on_epoch_end: LR schedulers, early stopping). A checkpoint cannot hold which of "
                "those steps are still to run, so a resume from it would skip them (the epoch's loss/val_loss missing "
                "from the history, a scheduler step missing). Take the epoch-end checkpoint in on_epoch_end, from a "
                "callback that runs after the others (a high execution_order, as ModelCheckpoint's 100), or a "
                "mid-epoch one in on_batch_end of a batch whose optimizer stepped")
        # None at an epoch boundary, also where the epoch starts again from its first batch (stopped before its
        # first step).
        position = run_state.position_in_epoch()
        if mid_epoch is None:
            mid_epoch = position is not None
        elif not mid_epoch and position is not None:
            raise RuntimeError(_inside_epoch_message(self.epoch, *position))
        if mid_epoch:
            self._check_at_step_point()
        self.set_up()
        checkpoint = self.run_state.capture(self, mid_epoch, hyperparams, include_weights)
        warn_unresumable_epoch_start(self, checkpoint)
        return checkpoint

    def _check_at_step_point(self) -> None:
        """Refuse a mid-epoch checkpoint where the run is not at a step point: resuming it would skip batches."""
        runner = self._step_runner
        stepped = runner.optimizers_stepped_so_far if runner is not None else None
        if stepped is not None:  # (the window's earlier batches are pending too: not what matters here)
            raise RuntimeError(
                f"checkpoint_state(mid_epoch=True) was called between the optimizer steps of batch {self.iteration} "
                f"of epoch {self.epoch}: {stepped} of its {len(self.optimizers)} optimizers have stepped (they step "
                "one after another, on_after_optimizer_step after each), and the batch's step is complete only after "
                "the last one: a checkpoint cannot hold a step half done, so resuming it would repeat or skip some "
                "optimizer's step. Take it in on_batch_end of the batch (when optimizer_step_due was True for it, as "
                "ModelCheckpoint does), or after fit")
        if runner is not None and runner.pending_batches > 0:
            raise RuntimeError(
                f"checkpoint_state(mid_epoch=True) was called inside an accumulation window (batch {self.iteration} "
                f"of epoch {self.epoch}, {runner.pending_batches} batch(es) since the last optimizer step with "
                f"grad_accumulation={self.grad_accumulation}): their gradients are not in a checkpoint, so resuming "
                "it would skip them. Take it where the optimizer steps: in on_batch_end when "
                "optimizer_step_due was True for the batch (as ModelCheckpoint does), or after fit")
        point = self.run_state.continuation_point  # (also once a continuing fit has taken it, until it is finished)
        if (runner is not None and runner.has_interrupted_step) or (point is not None and point.finish_step):
            raise RuntimeError(
                "a mid-epoch checkpoint (checkpoint_state with mid_epoch=True, or its default after fit stopped inside "
                f"an epoch) was asked for while the optimizer step of batch {self.iteration} of "
                f"epoch {self.epoch} is half done (an exception came after some optimizers had stepped, or in a "
                "callback's hook after the step): a checkpoint cannot hold that step. Call fit to finish it, then "
                "take the checkpoint")
        if self._current_batch is not None and self.run_state.batches_committed <= self.iteration:
            # on_batch_begin, a gradient hook: the batch has begun, its step is not done (the batches before it were
            # committed, but tl.iteration already names it).
            raise RuntimeError(
                f"a mid-epoch checkpoint (checkpoint_state with mid_epoch=True, or its default) was asked for inside "
                f"batch {self.iteration} of epoch {self.epoch}, before its optimizer step: it would record the batch "
                "as trained, and resuming it would skip the batch. Take it where the optimizer steps: in "
                "on_batch_end when optimizer_step_due was True for the batch (as ModelCheckpoint does), or after fit")

    def load_checkpoint(self, checkpoint: Union[str, dict], *, weights_only: bool = True,
                        source: Optional[str] = None, continue_run_folder: bool = False) -> dict:
        """Continue from a checkpoint (a dict, a ``.pth`` file, a sharded checkpoint's folder, or an experiment
        folder: its newest checkpoint).

        Call it before ``fit``; ``fit`` then trains on from the saved epoch and iteration, bitwise as if the
        run had not stopped (same model, data loaders and callbacks given). Returns the checkpoint dict.

        Args:
            checkpoint: the checkpoint dict, or where to read it.
            weights_only: True (the default) reads only tensors and plain data: a file holding anything else is
                refused with an error naming it. False unpickles the file in full, which runs whatever code it
                names: only for files you trust (see the Security page of the docs).
            source: for a dict read from a file, that file: named in the errors of loading it, now and when ``fit``
                applies its callback, precision and random states.
            continue_run_folder: a plain TrainLoop's callbacks given no experiment details write into the run folder
                that holds the checkpoint (``./aitoolbox_runs/run_<timestamp>/``) instead of a new one. Refused
                (ValueError) when that folder holds later checkpoints or a finished run's final model, which the
                continued run would overwrite, for a preset (``auto_resume=True`` continues a preset's folder),
                and once this loop's default run folder is in use.

        Raises:
            CheckpointLoadError: see the Security page; what does not fit this loop is a CheckpointMismatchError,
                content no checkpoint holds a CorruptCheckpointError, each naming the file (also when found at
                ``fit``).
        """
        from aitoolbox.experiment.local_save.checkpoints import failures_named, load_checkpoint_file
        path = source if isinstance(checkpoint, dict) else checkpoint
        folder = self._run_folder_to_continue(path) if continue_run_folder else None
        if not isinstance(checkpoint, dict):
            checkpoint = load_checkpoint_file(path, weights_only=weights_only)
        with failures_named(path):  # what does not fit names the file (CheckpointMismatchError)
            self.run_state.load(self, checkpoint, source=path)
            if self._step_runner is not None:  # the checkpoint says where to continue, not an interrupted fit
                self._step_runner.discard_interrupted_step()
            self._interrupted_batch = self._batch_end_done = None
            if self._model_runner is not None or self.gpu_mode != "fsdp":
                # A sharded checkpoint's weights are read now, whole, unless the model is yet to be sharded: then
                # each process reads its own shards when fit sets it up.
                load_pending_sharded_weights(self)
        if folder is not None:
            self._default_run_folder = folder
        return checkpoint

    def _run_folder_to_continue(self, path: Optional[str]) -> ExperimentFolder:
        if self.experiment_folder is not None:
            raise ValueError("continue_run_folder=True is for a plain TrainLoop: a preset continues in its run folder "
                             "with auto_resume=True (see the checkpointing docs)")
        if not isinstance(path, str):
            raise ValueError("continue_run_folder=True needs the checkpoint's path (a dict: pass source=<its file>)")
        current = self._default_run_folder
        if current.reserved or self._run_folders.announced(current):
            raise ValueError(f"continue_run_folder=True: this TrainLoop already writes into {current.path}; "
                             "continue in another run's folder with a new TrainLoop")
        return continued_run_folder(path)

    # --- training ---------------------------------------------------------------------------------------
    def __call__(self, num_epochs: int = 0, num_iterations: int = 0, callbacks: Optional[List[AbstractCallback]] = None,
                 grad_accumulation: int = 1, **kwargs) -> nn.Module:
        """Same as :meth:`fit`."""
        return self.fit(num_epochs, num_iterations, callbacks, grad_accumulation, **kwargs)

    def fit(self, num_epochs: int = 0, num_iterations: int = 0, callbacks: Optional[List[AbstractCallback]] = None,
            grad_accumulation: int = 1, **kwargs) -> nn.Module:
        """Train until ``num_epochs`` epochs or ``num_iterations`` batches have run in total, and return the model.

        Both counts are totals over the life of the TrainLoop: after ``fit(num_epochs=5)``, calling
        ``fit(num_epochs=8)`` trains three more epochs. Callbacks registered by an earlier call stay registered.
        A training stopped mid-epoch by ``num_iterations`` steps on the gradients accumulated so far and closes
        the epoch (evaluation and ``on_epoch_end``).

        Pseudocode::

            on_train_begin
            for each epoch:       on_epoch_begin, _run_epoch, auto-evaluation, on_epoch_end, summary line
            on_before_train_end;  final test-set loss;  on_train_end
            on an exception:      on_exception(exception), bars closed, the exception re-raised; the next
                                  fit continues from the interrupted epoch's last optimizer step (or the steps
                                  of an epoch's end or of the train end that had not finished)

        Args:
            num_epochs: train until this many epochs are done.
            num_iterations: or train until this many batches are done.
            callbacks: :class:`AbstractCallback` objects to register.
            grad_accumulation: step the optimizer every this many batches (and at the end of each epoch).
        """
        lost_end = self._lost_train_end()  # a loaded final checkpoint whose job was killed before its end finished
        if self.state.early_stop and not self.run_state.continuation_pending and not self.finishes_interrupted_step \
                and not self.run_state.train_end_pending and not lost_end:
            validation.check_fit_arguments(num_epochs, num_iterations, grad_accumulation)
            self._report_stopped_run(callbacks)
            return self.model_for_user
        if self.gpu_mode in ("ddp", "fsdp") and not self.strategy.is_distributed:
            return self.fit_distributed(num_epochs, num_iterations, callbacks, grad_accumulation, **kwargs)
        self.strategy.configure(**validation.check_fit_keywords(kwargs, self.gpu_mode))
        validation.check_fit_arguments(num_epochs, num_iterations, grad_accumulation)
        validation.check_ready_to_train(self.train_loader, self.optimizers)
        state = self.state
        state.num_epochs, state.num_iterations = num_epochs, num_iterations
        if num_iterations > 0 and loader_length(self.train_loader):  # the epochs the run touches, as 1.x reports
            state.num_epochs = math.ceil(num_iterations / loader_length(self.train_loader))
        state.grad_accumulation = grad_accumulation
        arguments = (state.num_epochs, state.num_iterations, state.grad_accumulation)
        self.callbacks_handler.register_callbacks(callbacks or [])
        if self._target_reached(num_epochs, num_iterations) and not self.run_state.continuation_pending \
                and not self.run_state.interrupted_at_iteration_target(num_iterations) \
                and not self.run_state.train_end_pending and not lost_end:
            logger.warning("Nothing to train: %d epochs (%d iterations) are already done. fit() counts in totals; "
                           "pass a larger num_epochs or num_iterations to continue.",
                           state.epochs_completed, state.iterations_done)
            if self.pending_restore is not None and not self.pending_restore.get("iteration", 0) > 0:
                # A loaded epoch-end checkpoint of a finished run (a requeued job's auto_resume): its states are the
                # run's now (the schedulers registered here reset the learning rate), so a later fit continues it.
                self.set_up()
                self.apply_pending_restore()
            return self.model_for_user
        if lost_end and (self.state.early_stop or self._target_reached(num_epochs, num_iterations)):
            # No epoch to train: _train runs on_train_begin (as the new process's fit it is) and the train end.
            self._lost_end_record = record_beside(self.pending_restore, self.run_state.pending_source)
            if self.strategy.is_main_process:
                logger.warning("The checkpoint %s was saved at the end of training, and its run folder records no "
                               "finished train end for it (the job was stopped after that checkpoint, before its "
                               "train end finished): running the train end now (on_train_begin, the test-set "
                               "evaluation, every on_train_end: final saves, uploads). What of it had finished before "
                               "may be repeated.", self.run_state.pending_source)
        try:
            with self._interrupts.watching(self._data_loaders()), self._compile_recording:
                self._train(num_epochs, num_iterations)
        except BaseException as exception:  # KeyboardInterrupt too: a notebook user stops a run this way
            # The step in progress is abandoned (the next one starts clean), unless an optimizer had stepped in it:
            # then the next fit finishes it, on this batch.
            unfinished = self._step_runner is not None and self._step_runner.abandon()
            unfinished = unfinished or self._batch_end_done is not None  # a committed batch's on_batch_end raised
            if unfinished and self._current_batch is not None:
                self._interrupted_batch = self._current_batch
            self._current_batch = None
            self.run_state.remember_interruption(self.train_loader, unfinished_step=unfinished)
            # Not a callback this fit registered that has not had its on_train_begin yet: the fit failed finishing
            # the last fit's train end, which it takes no part in (review 48t G6).
            waiting, self._waiting_for_train_begin = self._waiting_for_train_begin, set()
            self.callbacks_handler.on_exception(exception, (lambda callback: id(callback) not in waiting)
                                                if waiting else None)
            # (after an exception in the last fit's train end that this fit finished, whose hooks saw that fit's)
            state.num_epochs, state.num_iterations, state.grad_accumulation = arguments
            raise
        return self.model_for_user

    def lr_find(self, start_lr: float = 1e-7, end_lr: float = 10.0, num_iterations: int = 100,
                mode: str = "exponential", smoothing: float = 0.05, divergence_threshold: float = 4.0,
                suggestion: str = "valley", apply: bool = False, grad_accumulation: int = 1,
                callbacks: Optional[List[AbstractCallback]] = None, **distributed_kwargs) -> LRFinderResult:
        """Search a learning rate: train briefly while raising it, and suggest one from the loss curve.

        The search takes ``num_iterations`` optimizer steps on the training loader (from its start, passing over
        it again if it is shorter), the learning rate rising from ``start_lr`` at the first step to ``end_lr`` at
        the last, and stops early once the smoothed loss exceeds ``divergence_threshold`` times its lowest value or
        a loss is not finite. Every parameter group (of every optimizer) follows the first group's learning rate
        with its ratio to it unchanged. The steps are the loop's own (precision, loss scaling, ``torch_compile``,
        DDP, gradient clipping callbacks); the other callbacks do not run. Afterwards the run is exactly as
        before (weights, optimizers, loss scaler, LR schedulers, callbacks' states, RNG, data position, history,
        a loaded checkpoint or an interrupted ``fit`` waiting to continue), also when the search raises, so a
        ``fit`` after ``lr_find`` is bitwise the ``fit`` without it. See the "Finding a learning rate" docs page
        and :mod:`aitoolbox.torchtrain.train_loop.lr_finder`.

        Args:
            start_lr: the first step's learning rate (> 0).
            end_lr: the last step's learning rate (> start_lr).
            num_iterations: optimizer steps of the search (>= 2); with ``grad_accumulation`` each step trains
                that many batches.
            mode: ``'exponential'`` (a constant factor per step: the usual choice, even steps on the log axis) or
                ``'linear'`` (a constant increment).
            smoothing: weight of each new loss in the bias-corrected moving average the stop rule and the
                suggestion read, in (0, 1]; 1 is no smoothing.
            divergence_threshold: stop once the smoothed loss exceeds this many times its lowest value (> 1; for
                a lowest value <= 0, see :func:`~aitoolbox.torchtrain.train_loop.lr_finder.diverged`).
            suggestion: the rule that reads the curve (see :mod:`~aitoolbox.torchtrain.train_loop.lr_suggestion`):
                ``'valley'`` (fastai's: half way down the longest stretch of falling loss), ``'steepest'`` (where
                the loss falls fastest against log lr) or ``'minimum'`` (a tenth of the lr of the lowest loss).
            apply: make the suggestion the first parameter group's learning rate afterwards, the other groups
                keeping their ratio to it (a registered LR scheduler callback gets it as its base learning rate;
                ``OneCycleLR`` and ``CyclicLR`` as their peak, ``max_lr``).
            grad_accumulation: batches per optimizer step, as in :meth:`fit` (use the value you will train with).
            callbacks: callbacks to register first, as ``fit(callbacks=...)`` does (they stay registered); of
                all registered callbacks only gradient clipping ones (``GradNormClip``, ``GradValueClip``) run
                during the search.
            **distributed_kwargs: under ``gpu_mode='ddp'`` in a process of a torchrun / SLURM / OpenMPI job that
                has not trained yet, the search joins the job first, as :meth:`fit_distributed` would, with these
                of its arguments (``ddp_model_args``, ``amp_init_args``, ``backend``, ``sync_bn``,
                ``train_data_shuffle``, ``in_process_data_load``, ``timeout_s``, ...); the later ``fit`` goes on
                with that set-up. Call ``lr_find`` in every process: each gets the same suggestion.

        Returns:
            An :class:`~aitoolbox.torchtrain.train_loop.lr_suggestion.LRFinderResult`: ``lrs``, ``losses``
            (smoothed), ``raw_losses``, ``suggestion``, and ``plot(path=None)``.

        Raises:
            ValueError: a bad argument; ``gpu_mode='fsdp'`` (the run cannot be kept in memory whole);
                ``gpu_mode='ddp'`` outside a distributed job (launch the script with torchrun).
        """
        from aitoolbox.torchtrain.train_loop.lr_finder import find_lr  # it imports callbacks: not at module load
        return find_lr(self, start_lr, end_lr, num_iterations, mode, smoothing, divergence_threshold, suggestion,
                       apply, grad_accumulation, callbacks, distributed_kwargs)

    def _data_loaders(self) -> list:
        """Every data loader of the run (training, validation sets, test)."""
        validation = self._validation_loader
        validation = list(validation.values()) if isinstance(validation, Mapping) else [validation]
        return [self.train_loader, *validation, self.test_loader]

    def _report_stopped_run(self, callbacks: Optional[List[AbstractCallback]]) -> None:
        """``fit`` of a run that a stop request ended (in this process, or in the run a loaded checkpoint saved): it
        is finished and trains nothing, so that a requeued job keeps its final model."""
        if self.gpu_mode not in ("ddp", "fsdp") or self.strategy.is_distributed:  # a launcher starts no process
            self.callbacks_handler.register_callbacks(callbacks or [])  # as by a fit with nothing left to train
        logger.warning("Nothing to train: training was stopped at epoch %d by a stop request (e.g. EarlyStopping), "
                       "which ends the run. To train it further, set tl.early_stop = False before fit.",
                       self.state.epoch + 1)

    def fit_distributed(self, num_epochs: int = 0, num_iterations: int = 0,
                        callbacks: Optional[List[AbstractCallback]] = None, grad_accumulation: int = 1,
                        train_data_shuffle: bool = True, ddp_model_args: Optional[dict] = None,
                        amp_init_args: Optional[dict] = None, in_process_data_load=None, num_nodes: int = 1,
                        node_rank: int = 0, num_gpus: Optional[int] = None, backend: Optional[str] = None,
                        init_method: str = "env://", master_addr: Optional[str] = None,
                        master_port: Optional[int] = None, num_cpu_processes: int = 2, sync_bn: bool = False,
                        start_method: Optional[str] = None, timeout_s: float = 600.0,
                        on_gpu: Optional[bool] = None, fsdp_model_args: Optional[dict] = None,
                        signal_grace_s: float = 60.0) -> nn.Module:
        """Train with DistributedDataParallel, one process per device, and return the trained model.

        Started plainly, it launches ``num_gpus`` processes on this node (without CUDA: ``num_gpus`` or
        ``num_cpu_processes`` CPU processes over gloo) and, when they finish, takes over the run's state: rank 0's
        weights, optimizer states, ``train_history`` and counters now, and the precision state (O2's float32
        masters, the loss scale), every rank's RNG state and history for the next call; the callbacks passed
        stay registered here, with rank 0's states. Two calls (``num_epochs=2``, then ``4``) therefore train as
        one call of 4 epochs. Under torchrun, SLURM or OpenMPI it joins the job as the rank the environment
        gives instead of launching, and a second call goes on with the same set-up. In every process: the model
        is placed on its device, ``amp.initialize(**amp_init_args)`` runs before the DDP wrap, the loaders get a
        DistributedSampler (evaluation loaders an exact, unpadded split), and only rank 0 prints and saves.

        Args:
            num_epochs, num_iterations, callbacks, grad_accumulation: as in :meth:`fit`.
            train_data_shuffle: True: each process trains its share of the order the training loader's sampler
                draws; False: a ``RandomSampler``'s data set in its order instead (another shuffling sampler is
                refused). See the "Distributed training" docs page.
            ddp_model_args: keyword arguments for ``torch.nn.parallel.DistributedDataParallel``.
            amp_init_args: ``amp.initialize`` keyword arguments, e.g. ``{'opt_level': 'O1'}``.
            in_process_data_load: callback(s) whose ``on_multiprocess_start`` builds the data loaders in each
                process (for data that should not be sent to the processes).
            num_nodes: machines in the job; node_rank: this machine's index.
            num_gpus: processes on this node (default: every GPU; without CUDA, CPU processes).
            backend: ``'nccl'``, ``'gloo'`` or None (NCCL with CUDA, gloo otherwise).
            init_method: torch.distributed init method; ``'env://'`` uses master_addr/master_port.
            master_addr: address of node 0 (required for several nodes); master_port: its port (a free one is
                chosen on a single node).
            num_cpu_processes: CPU processes per node when CUDA is unavailable and num_gpus is 0 or None.
            sync_bn: convert BatchNorm layers to SyncBatchNorm.
            start_method: ``'fork'``, ``'spawn'`` or None (fork in notebooks, spawn for scripts).
            timeout_s: how long collectives wait for a missing rank before failing.
            on_gpu: aitoolbox 1.x's switch: False trains CPU processes over gloo even where CUDA is available; None
                or True use the GPUs when there are any. ``backend='nccl'`` without CUDA falls back to gloo.
            fsdp_model_args: with ``gpu_mode='fsdp'``: ``shard_modules`` (module classes that become shard units),
                ``min_num_params`` (otherwise: submodules of at least this many parameters, default 1,000,000),
                ``reshard_after_forward`` (default True) and ``cpu_offload`` (default False); see
                :class:`~aitoolbox.torchtrain.distributed.fsdp.FullyShardedStrategy`.
            signal_grace_s: SIGTERM or SIGHUP (a scheduler's time limit, ``scancel``, a closed ssh session),
                sent to this launcher or, under torchrun, by its agent to the processes: every process finishes
                its current optimizer step, at the same step, each checkpoint callback saves a resumable
                mid-epoch checkpoint, and the call raises
                :class:`~aitoolbox.torchtrain.distributed.signals.SignalStop` (a ``SystemExit`` with code
                128 + signal number). Processes still running this many
                seconds after the signal are killed. The launcher forwards SIGINT (Ctrl-C) too, and its
                processes die with it if it is killed outright (SIGKILL). See :doc:`distributed`.

        Raises:
            RuntimeError: after a ``fit`` that an exception stopped in its train end, before anything starts:
                call ``fit`` to finish that end first.
        """
        if self.run_state.interrupted_in_train_end:
            # (Review 48l F4.) The processes would not run this process's pending end (its steps are named by the
            # identity of callbacks here), and its history would miss train_end_test_loss; fit runs it here.
            raise RuntimeError(
                "fit_distributed was called, but the last fit stopped in its train end; call fit() to finish it first "
                "(an exception in a callback's on_before_train_end or on_train_end, or in the test-set evaluation, "
                "left that end unfinished: the test-set loss, the final saves). fit with the same num_epochs / "
                "num_iterations only finishes the end; then call fit_distributed to train on")
        if self.state.early_stop and not self._lost_train_end():  # a stopped run: no process is started
            validation.check_fit_arguments(num_epochs, num_iterations, grad_accumulation)
            self._report_stopped_run(callbacks)
            return self.model_for_user
        self._launches_processes = True
        return fit_distributed(self, DistributedFitOptions(
            num_epochs=num_epochs, num_iterations=num_iterations, callbacks=callbacks,
            grad_accumulation=grad_accumulation, train_data_shuffle=train_data_shuffle, ddp_model_args=ddp_model_args,
            amp_init_args=amp_init_args, in_process_data_load=in_process_data_load, num_nodes=num_nodes,
            node_rank=node_rank, num_gpus=num_gpus, backend=backend, init_method=init_method,
            master_addr=master_addr, master_port=master_port, num_cpu_processes=num_cpu_processes, sync_bn=sync_bn,
            start_method=start_method, timeout_s=timeout_s, on_gpu=on_gpu, fsdp_model_args=fsdp_model_args,
            signal_grace_s=signal_grace_s, shard_parameters=self.gpu_mode == "fsdp"))

    @property
    def _compile_recording(self) -> ContextManager:
        return self._compiler.training() if self._compiler is not None else contextlib.nullcontext()

    def _train(self, num_epochs: int, num_iterations: int) -> None:
        state = self.state
        self._waiting_for_train_begin = set()
        self.set_up()
        if self.run_state.train_end_pending:
            # The last fit stopped in its train end: finished first, as that fit would have done it, before this
            # fit's training (if any is left: the straight run's next fit starts after that end), with that fit's
            # num_epochs / num_iterations / grad_accumulation in the state for its hooks (review 48t G5).
            arguments = (state.num_epochs, state.num_iterations, state.grad_accumulation)
            self._waiting_for_train_begin = {id(callback) for callback in self.callbacks
                                             if not self.run_state.takes_part_in_train_end(callback)}
            if self.run_state.train_end_arguments is not None:
                state.num_epochs, state.num_iterations, state.grad_accumulation = self.run_state.train_end_arguments
            # An exception keeps them for on_exception, which fit calls before it sets this fit's back (49l F8).
            self._end_training()
            state.num_epochs, state.num_iterations, state.grad_accumulation = arguments
            if state.early_stop or self._target_reached(num_epochs, num_iterations):
                return
        self.frozen_modules.enter_training(self.model, self.model_runner)
        if self.print_callbacks and self.strategy.is_main_process:
            logger.info("Callbacks: %s", self.callbacks)
        if self.strategy.is_main_process:
            self._run_folders.announce(self)
        self._step_runner.start()
        self._plain_batches = _no_batch_context(self.strategy, self._precision)
        check_optimizers_step_the_model(self.model, self.criterion, self.optimizers,
                                        getattr(self._precision, "master_weights", None))
        self.run_state.start_training(self.model)
        self._waiting_for_train_begin = set()
        self.callbacks_handler.on_train_begin()
        if self.strategy.is_distributed:  # a stop one process asked for in on_train_begin: every process, now
            self._agree_on_stop()
        # Asked before resume_point takes the interruption: an epoch interrupted at the last batch of
        # fit(num_iterations) is still finished (its interrupted step, its end), though no batch is left to train.
        close_interrupted = self.run_state.interrupted_at_iteration_target(num_iterations) or \
            self.finishes_interrupted_step  # also after a stop requested in that step's batch
        resume = self.run_state.resume_point(self)
        # An epoch's end an exception interrupted is finished first, also when it had asked to stop.
        while (resume is not None and (resume.batches_trained or close_interrupted)) or \
                (not state.early_stop and not self._target_reached(num_epochs, num_iterations)):
            state.epoch = state.epochs_completed
            try:
                self._run_epoch(num_iterations, resume)
            except RollBack as request:  # back to a point kept earlier (SpikeRollback), maybe in an earlier epoch
                resume = self._roll_back(request)
                continue
            resume = None
            # The loop ends after this epoch (the condition above, the epoch counted): the train end begins with
            # the epoch's completion, so no exception between the two loses it (issue 32). Until here an exception
            # redoes the epoch's end (its steps each done once).
            last = state.early_stop or self._target_reached(num_epochs, num_iterations, counting_this_epoch=True)
            self.run_state.end_epoch((self.callbacks_handler.callbacks, (state.num_epochs, state.num_iterations,
                                                                         state.grad_accumulation)) if last else None)
            if self._compiler is not None:
                self._compiler.check_after_epoch()
        self._end_training()

    def _end_training(self) -> None:
        """The train end: each callback's ``on_before_train_end`` (e.g. the best epoch's weights back, before they are
        evaluated), the test-set evaluation, then every ``on_train_end``. Each step is done once: after an exception
        in it, the next ``fit`` runs the steps that did not finish (a callback's by its identity, as in an epoch's
        end), also the ``on_train_end`` of the callbacks that had not returned (a KeyboardInterrupt stops the
        others), and with the callbacks registered when the end started (one that the next ``fit`` registers has
        its ``on_train_begin`` still to come). Each ``on_train_end`` is a step too: what an interrupted one put into
        the history is dropped (:meth:`_train_end_step`), and an ``on_train_end`` failure that a Ctrl-C in a later
        callback's cut short is raised after the last one by the ``fit`` that finishes the end."""
        hooks, run_state, state = self.callbacks_handler, self.run_state, self.state
        done = run_state.begin_train_end(hooks.callbacks,
                                         (state.num_epochs, state.num_iterations, state.grad_accumulation))
        steps = [(f"on_before_train_end:{id(callback)}", callback.on_before_train_end)
                 for callback in hooks.subscribers("on_before_train_end")
                 if run_state.takes_part_in_train_end(callback)]
        steps.append(("test_evaluation", self._evaluator.at_train_end))
        for name, step in steps:
            if name not in done:
                with self._train_end_step(lambda: name in done):
                    step()
                    done.append(name)
        run_state.begin_on_train_end()
        on_train_end_done = run_state.on_train_end_done
        try:
            hooks.on_train_end(on_train_end_done, run_state.takes_part_in_train_end, run_state.train_end_failures,
                               lambda callback: self._train_end_step(lambda: id(callback) in on_train_end_done))
        except Exception:  # raised after every callback's on_train_end ran: nothing is left to finish
            run_state.end_train_end()
            raise
        # Recorded before the end is marked over here: an exception between the two finishes (re-records) nothing.
        self._record_train_end_done()
        run_state.end_train_end()
        if self.strategy.is_main_process:
            self._epoch_report.warn_unmatched(self.train_history)

    def _lost_train_end(self) -> bool:
        """A loaded epoch-end checkpoint, not applied yet, whose folder records the run's finished train ends and
        not its own (see :mod:`~aitoolbox.experiment.local_save.train_end_marker`): its job stopped before the end
        finished. ``fit`` at its target runs that end instead of reporting nothing to train."""
        pending = self.pending_restore
        if pending is None:
            return False
        lost = train_end_lost(pending, self.run_state.pending_source)
        if self.strategy.is_distributed:  # every process loaded one: rank 0's disk holds the record, all follow it
            lost = bool(self.broadcast_object(lost))
        return lost

    def _record_train_end_done(self) -> None:
        """The train end finished (every ``on_train_end`` returned): recorded, in the main process, in the run folder
        of each checkpoint callback and in the record of the loaded checkpoint whose lost end this was, so that a
        restarted job does not run it again. Failures are logged (the end is done; a restart would repeat it)."""
        lost, self._lost_end_record = self._lost_end_record, None
        if not self.strategy.is_main_process:
            return
        from aitoolbox.torchtrain.callbacks.checkpoint_base import CheckpointCallback  # (it imports the loop)
        written = {callback.record_train_end_done() for callback in self.callbacks
                   if isinstance(callback, CheckpointCallback)}
        written = {os.path.abspath(path) for path in written if path is not None}
        if lost is not None and os.path.abspath(lost) not in written:
            record_train_end_done(lost, self.state.epochs_completed, self.state.total_iteration_idx)

    @contextlib.contextmanager
    def _train_end_step(self, finished: Callable[[], bool]) -> Iterator[None]:
        """One step of the train end, marked done inside it (``finished`` says whether it was). Where an exception
        leaves it unfinished, what it put into the history goes at once, as the next ``fit`` runs it again from its
        start (reviews 48t G3, 48m M3). Dropped here rather than by that ``fit``: what the user records in between
        stays (49l F2); and as the step is marked done inside, a Ctrl-C at any moment leaves it either done with its
        values or to do without them, never done without them or to do with them (49l F1)."""
        lengths = history_lengths(self.train_history)
        try:
            yield
        except BaseException:
            if not finished():
                truncate_history(self.train_history, lengths)
            raise

    def _roll_back(self, request: RollBack) -> Optional[MidEpochResume]:
        """Return the run to the point ``request`` names (see :mod:`.rollback`); where its epoch continues."""
        self._step_runner.abandon()
        resume = roll_back(self, request)
        self._step_runner.discard_interrupted_step()  # (a step of the abandoned interval: undone with it)
        self._step_runner.start()  # no gradients or per-step precision state from the abandoned interval
        self._evaluator.clear_cache()  # results cached for a batch position were computed with the undone weights
        # The replay's on_epoch_begin runs before its batches start: until then the run stands at the kept point
        # (a checkpoint taken there records it, an exception continues from it), not at the abandoned step point.
        self.run_state.continue_after_rollback(resume)
        # A rollback requested inside a batch's hooks (a checkpoint asked for there, see SpikeRollback) left the
        # batch unfinished: it is undone, not an interrupted step for the next fit to finish.
        self._current_batch = self._batch_end_done = None
        self._interrupts.in_batch = False
        return resume

    def roll_back_before_stop(self, request: RollBack) -> None:
        """A stop signal's rollback (see :mod:`.interrupts`): the run returns to the kept point and stands there, as
        before the replay's ``on_epoch_begin``, for the stop's checkpoint and a later ``fit``."""
        self._roll_back(request)
        self.state.epoch = self.state.epochs_completed  # (the epoch loop sets it at the replay's start)

    @property
    def rollbacks(self) -> List[dict]:
        """The rollbacks of this run so far (:class:`~aitoolbox.torchtrain.callbacks.SpikeRollback`), oldest first."""
        return self.run_state.rollbacks.records

    @property
    def model_for_user(self) -> nn.Module:
        """The module ``fit`` returns: the user's TTModel, or the plain module of a ModelWrap (same as ``model``)."""
        return self.model

    def _target_reached(self, num_epochs: int, num_iterations: int, counting_this_epoch: bool = False) -> bool:
        """Whether the fit's target is reached; ``counting_this_epoch``: once the epoch now ending is counted."""
        if num_epochs > 0:
            return self.state.epochs_completed + int(counting_this_epoch) >= num_epochs
        return self.state.iterations_done >= num_iterations

    def _run_epoch(self, num_iterations: int, resume: Optional[MidEpochResume] = None) -> None:
        """One pass over the training data (:meth:`_train_batches`), then the epoch's end: a sequence of named
        steps (:meth:`_epoch_end_steps`: the accumulated loss into the history, ``on_epoch_train_end``,
        auto-evaluation, ``on_epoch_end``, the summary line), each done once.

        ``resume`` continues an epoch that a mid-epoch checkpoint or an exception interrupted; after an exception in
        the epoch's end, the steps it did not finish.
        """
        self._stop_reasons = []
        try:
            self._train_and_end_epoch(num_iterations, resume)
        finally:
            self._log_stop_reasons()

    def _train_and_end_epoch(self, num_iterations: int, resume: Optional[MidEpochResume]) -> None:
        state, run_state = self.state, self.run_state
        if resume is not None and resume.batches_trained:  # stopped in the epoch's end: the steps left
            truncate_history(self.train_history, resume.finished_history_lengths)
            self._epoch_report.start(self.train_history, resume.history_lengths)
            run_state.continue_epoch_end(resume, self.device)
        else:
            self._epoch_report.start(self.train_history)
            self.strategy.on_epoch_begin(state.epoch, self.train_loader)
            self.callbacks_handler.on_epoch_begin()
            self._train_batches(num_iterations, resume)
            run_state.mark_epoch_trained(self.train_history)
        steps = list(self._epoch_end_steps())
        passes = next(index for index, (name, _) in enumerate(steps) if name == "messages")
        with self._evaluator.progress.shared("Evaluation", self.show_progress):  # the epoch end's passes: one bar
            for name, step in steps[:passes]:
                run_state.run_epoch_end_step(name, step, self.train_history)
        for name, step in steps[passes:]:
            run_state.run_epoch_end_step(name, step, self.train_history)

    def _epoch_end_steps(self) -> Iterator[Tuple[str, Callable[[], None]]]:
        """The steps of an epoch's end, in order, by name (a callback's by its identity: the end continued after an
        exception runs each callback that had finished its hook not again, and one registered since once)."""
        hooks, state = self.callbacks_handler, self.state
        yield "accumulated_loss", self._record_accumulated_loss
        for callback in hooks.subscribers("on_epoch_train_end"):
            yield f"on_epoch_train_end:{id(callback)}", callback.on_epoch_train_end
        yield "auto_evaluation", self._evaluator.at_epoch_end
        for callback in hooks.subscribers("on_epoch_end"):
            yield f"on_epoch_end:{id(callback)}", callback.on_epoch_end
        yield "messages", self.message_service.end_of_epoch_trigger
        if self.strategy.is_main_process:
            yield "summary", lambda: self._epoch_report.log(state.epoch, state.num_epochs, self.train_history,
                                                            self.validation_set_names)
        yield "stop_agreement", self._agree_on_stop

    def _record_accumulated_loss(self) -> None:
        accumulated = history_entries("accumulated_loss", self.epoch_loss_sum / self.run_state.batches_done,
                                      self._loss_names)
        for name, value in accumulated.items():
            self.insert_metric_result_into_history(name, value)

    def _agree_on_stop(self) -> None:
        requested_here = bool(self.state.early_stop)
        self.state.early_stop = self.strategy.any_process(requested_here)  # all ranks stop together
        if self.state.early_stop and self.strategy.is_distributed:  # only then: no cost in the epochs without a stop
            self._report_stop_requests(requested_here)

    def _report_stop_requests(self, requested_here: bool) -> None:
        """In the main process: log the reasons of the stops other processes requested (each once, naming their
        ranks), unless the main process requested the same itself. Called in every process (a collective)."""
        requests = self.strategy.all_gather_objects((requested_here, self._stop_requests_here))
        self._stop_requests_here = []
        if not self.strategy.is_main_process:
            return
        own_reasons = set(self._stop_reasons or ()) | set(self._stop_reasons_logged)
        self._stop_reasons_logged = []
        ranks_by_reason: Dict[str, List[int]] = {}
        for rank, (requested, reasons) in enumerate(requests):
            if rank == self.strategy.rank or not requested:
                continue
            for reason in reasons or [""]:
                if reason not in own_reasons:
                    ranks_by_reason.setdefault(reason, []).append(rank)
        for reason, ranks in ranks_by_reason.items():
            if not reason and requested_here:
                continue  # the main process stops on its own request: a request without a reason adds nothing
            where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
            self._log_stop_reason(f"{reason} (requested on {where})" if reason else
                                  f"requested on {where}, without a reason")

    def _train_batches(self, num_iterations: int, resume: Optional[MidEpochResume]) -> None:
        """``_run_batch`` for each batch of the epoch (after those ``resume`` says were trained; first the step an
        exception interrupted, if ``resume`` says so)."""
        state, run_state = self.state, self.run_state
        num_batches = run_state.epoch_length(self.train_loader)  # without the batches a rollback left out
        batches = self.strategy.agreed_batches(run_state.epoch_batches(self.train_loader, resume, self.device),
                                               self.train_loader)
        bar = ProgressBar(num_batches, f"Epoch {state.epoch + 1}/{state.num_epochs}", enabled=self.show_progress)
        if resume is not None and run_state.batches_done > 0:
            # As the run had them after its last batch done, also where none is left to train (an unsized loader's
            # checkpoint after its last batch): the batch's index, the names of its losses.
            state.iteration = run_state.batches_done - 1
            self._loss_names = self._loss_names if resume.loss_names is None else list(resume.loss_names)
            num_losses = self.epoch_loss_sum.numel()  # (the sum is computed from its blocks: once)
            if self._loss_names is None and num_losses > 1:  # a MultiLoss's older checkpoint
                self._loss_names = self._recorded_loss_names(num_losses)
        with contextlib.closing(bar):
            finished = resume is not None and resume.finish_step and self._finish_interrupted_step(num_iterations)
            # Continued exactly at num_iterations (see interrupted_at_iteration_target): no batch is left.
            at_target = num_iterations > 0 and state.iterations_done >= num_iterations
            if not finished and not at_target:
                self._train_loader_batches(batches, num_iterations, bar)
            if run_state.batches_done == 0:
                raise ValueError("train_loader yielded no batches in this epoch: it must yield at least one batch")
            # The last value the bar shows is the epoch's accumulated_loss, not a sample taken mid-epoch.
            postfix = loss_postfix(self.epoch_loss_sum / run_state.batches_done, self._loss_names)
            bar.set_postfix(self.callbacks_handler.progress_bar_postfix(postfix))

    def _recorded_loss_names(self, count: int) -> List[str]:
        """The names of a MultiLoss's ``count`` losses where a checkpoint older than ``epoch_loss_names`` resumes
        with no batch left to train: those the history records (``accumulated_loss_<name>``, sorted as the loop
        sorts them), else their positions."""
        prefix = "accumulated_loss_"
        recorded = sorted(name[len(prefix):] for name in self.train_history.keys() if name.startswith(prefix))
        if len(recorded) == count:
            return recorded
        logger.warning("the checkpoint does not name the %d losses of its MultiLoss (written before checkpoints held "
                       "them) and the history does not either: the epoch's accumulated losses are recorded as "
                       "accumulated_loss_0 ... accumulated_loss_%d", count, count - 1)
        return [str(position) for position in range(count)]

    def _train_loader_batches(self, batches: Any, num_iterations: int, bar: ProgressBar) -> None:
        """The batches of the epoch's loader until it is exhausted, ``num_iterations`` is reached or a stop is
        requested. Every batch trained has its gradients stepped: a window ends every ``grad_accumulation``
        batches, at the epoch's last batch (by ``len``, where it is exact: see
        :meth:`~.run_state.RunState.window_end_length`), at ``num_iterations``, and also where the loader ends or
        the stop comes inside a window."""
        state, strategy = self.state, self.strategy
        running_loss = self._running_loss_postfix
        accumulation = state.grad_accumulation
        every_batch_steps = accumulation == 1
        window_end = self.run_state.window_end_length(self.train_loader)  # None: the loader's end tells
        batches = iter(batches)  # (one iterator: the general loop goes on where the direct one left off)
        if every_batch_steps and self._direct_batches() and self._train_direct_batches(batches, num_iterations, bar):
            self._end_iteration_at_last_batch(batches, window_end)
            return  # num_iterations reached or a stop requested
        for state.iteration, batch_data in batches:  # all of them, or those after the direct ones
            iteration_limit_hit = num_iterations > 0 and state.total_iteration_idx + 2 >= num_iterations
            step_due = every_batch_steps or iteration_limit_hit or state.iteration + 1 == window_end \
                or (state.iteration + 1) % accumulation == 0
            self._run_batch(batch_data, step_due)
            bar.update(running_loss)
            if iteration_limit_hit:
                self._end_iteration_at_last_batch(batches, window_end)
                return
            if state.early_stop and strategy.stops_mid_epoch:
                self._step_runner.step_pending_gradients()  # the window's batches were trained, as at num_iterations
                self._end_iteration_at_last_batch(batches, window_end)
                return
        self.run_state.check_loader_exhausted()  # warns once if len() said otherwise
        self._step_runner.step_pending_gradients()  # a window the loader's end cut short (by len() unforeseen)

    def _end_iteration_at_last_batch(self, batches: Iterator, window_end: Optional[int]) -> None:
        """``num_iterations`` reached (or a stop) at the epoch's last batch: the loader is asked for the next batch,
        as the uninterrupted run asks it, which ends its iteration. A shuffling sampler draws at its end (torch's
        RandomSampler a permutation for the tail, even an empty one), so without it the next ``fit``'s epochs drew
        another order than the run made of one ``fit`` (``fit(num_iterations=N)`` then a longer one, N at an epoch's
        end). Only where ``len`` is exact (``window_end``): nothing else comes."""
        if window_end is not None and self.state.iteration + 1 == window_end:
            next(batches, None)

    def _finish_interrupted_step(self, num_iterations: int) -> bool:
        """Finish the batch whose step an exception interrupted after an optimizer had stepped (see
        :class:`~.step_runner.StepRunner`): its remaining optimizer steps and hooks, then its end (the
        ``on_batch_end`` of each callback that had not returned...). Returns True where the epoch's batches end
        with it (``num_iterations`` reached, a stop requested)."""
        state, runner = self.state, self._step_runner
        batch, self._interrupted_batch = self._interrupted_batch, None
        batch_end_done, self._batch_end_done = self._batch_end_done, None
        state.iteration = self.run_state.batches_done - 1
        if batch_end_done is None and not runner.has_interrupted_step:  # e.g. fit_distributed after an
            # interrupted fit: another step runner
            logger.warning("the optimizer step of batch %d of epoch %d was interrupted after some optimizers had "
                           "stepped and cannot be finished here: the other optimizers skip that batch",
                           state.iteration, state.epoch)
            self.run_state.mark_batch_done()
            return False
        ends_batch = batch_end_done is not None or runner.interrupted_step_ends_batch
        self._interrupts.in_batch = True
        state.optimizer_step_due = True
        self._current_batch = batch
        if runner.has_interrupted_step:
            runner.finish_interrupted_step()
        if ends_batch:
            self._end_batch(True, batch_end_done if batch_end_done is not None else [])
        else:  # a step at the loader's end (step_pending_gradients): its batch had ended before it
            state.optimizer_step_due = False
            self._current_batch = None
            self._interrupts.in_batch = False
        return (num_iterations > 0 and state.iterations_done >= num_iterations) or \
            (state.early_stop and self.strategy.stops_mid_epoch)

    def _running_loss_postfix(self) -> dict:
        postfix = {"loss": f"{self.epoch_loss_sum.mean().item() / self.run_state.batches_done:.4f}"}
        return self.callbacks_handler.progress_bar_postfix(postfix)

    def _run_batch(self, batch_data: Any, optimizer_step: bool) -> None:
        """Forward and backward of one batch, its loss added to the epoch's sum; with ``optimizer_step`` also every
        optimizer's step (both by the :class:`~.step_runner.StepRunner`); then the batch's end."""
        state, hooks = self.state, self.callbacks_handler
        self._interrupts.in_batch = True
        state.total_iteration_idx += 1
        state.optimizer_step_due = optimizer_step
        self._current_batch = batch_data
        if hooks.has_batch_hooks:  # without any, the empty calls are skipped (microseconds a batch)
            hooks.on_batch_begin()
        if self._compiler is not None and self._compiler.verification_due:
            self._verify_compiled_gradients(batch_data)
        if self._plain_batches:  # no context to enter around the batch (two no-op ones cost a microsecond)
            self._backward_and_step(self._model_runner.get_loss(batch_data, self.criterion, self.strategy.device),
                                    optimizer_step)
        else:
            with self.strategy.skip_gradient_sync(accumulating=not optimizer_step):
                with self._precision.autocast():
                    loss = self._model_runner.get_loss(batch_data, self.criterion, self.strategy.device)
                self._backward_and_step(loss, optimizer_step)
        self._end_batch(optimizer_step)

    def _direct_batches(self) -> bool:
        """Whether this epoch's batches may run as :meth:`_train_direct_batches`: every batch steps (checked by the
        caller), no callback has a batch hook, no context is entered around a batch, no compiled-gradient check is
        due and the step runner can take each step directly (a plain precision, nothing pending)."""
        return (self._plain_batches and not self.callbacks_handler.has_batch_hooks
                and (self._compiler is None or not self._compiler.verification_due)
                and self._step_runner.can_step_directly())

    def _train_direct_batches(self, batches: Iterator, num_iterations: int, bar: ProgressBar) -> bool:
        """The batches of :meth:`_train_loader_batches` in the common case :meth:`_direct_batches` describes, in one
        frame: the same state changes in the same order as :meth:`_run_batch` without hooks, each step taken by
        :meth:`~.step_runner.StepRunner.step_directly` (the per-batch cost over a hand-written loop is mostly
        calls). Returns True where the epoch's batches end here (``num_iterations`` reached, a stop requested),
        False where the loader is exhausted or the case no longer holds: the general loop goes on with the batches
        left. A loss that is not one tensor (a MultiLoss, one the checks refuse) takes the general step; so does
        the rest of a batch in which a callback with a batch hook was registered or a precision assigned (in
        ``get_loss``, the backward, an optimizer's step: as in :meth:`_run_batch`, its hooks and the new precision
        apply from there on)."""
        state, strategy, interrupts, run_state = self.state, self.strategy, self._interrupts, self.run_state
        hooks, runner, running_loss = self.callbacks_handler, self._step_runner, self._running_loss_postfix
        device = strategy.device
        distributed = getattr(strategy, "is_distributed", False)  # (as Interrupts.stop_due reads it)
        for state.iteration, batch_data in batches:
            interrupts.in_batch = True
            state.total_iteration_idx += 1
            state.optimizer_step_due = True
            self._current_batch = batch_data
            loss = self._model_runner.get_loss(batch_data, self.criterion, device)
            if hooks.has_batch_hooks or not self._plain_batches:  # changed inside get_loss
                self._backward_and_step(loss, True)
                return self._end_general_batch(num_iterations, bar)
            if type(loss) is torch.Tensor and loss.requires_grad and loss.ndim == 0:  # checked_batch_loss's usual
                self.last_batch_loss = detached = loss.detach()
                self._loss_names = None
                run_state.add_batch_loss(detached)
                if not runner.step_directly(loss):  # a batch hook registered in the backward or the step
                    return self._end_general_batch(num_iterations, bar)
            else:
                self._backward_and_step(loss, True)
                if hooks.has_batch_hooks:  # registered in the backward or a step
                    return self._end_general_batch(num_iterations, bar)
            state.optimizer_step_due = False  # as _end_batch without hooks
            self._current_batch = None
            interrupts.in_batch = False
            if interrupts.pending:
                interrupts.raise_pending()
            if run_state.after_step_action is not None:
                run_state.run_after_step(self)
            if (distributed or interrupts.stop_signal is not None) and interrupts.stop_due(strategy):
                interrupts.stop(self)  # (one process: stop_due is whether a stop signal came)
            bar.update(running_loss)
            if (num_iterations > 0 and state.total_iteration_idx + 1 >= num_iterations) or \
                    (state.early_stop and strategy.stops_mid_epoch):
                return True
            if hooks.has_batch_hooks or not self._plain_batches:  # changed in the step (the user's optimizer)
                return False
        return False

    def _end_general_batch(self, num_iterations: int, bar: ProgressBar) -> bool:
        """The end of a batch :meth:`_train_direct_batches` handed to the general road (a callback with batch hooks
        registered, a precision assigned inside it): :meth:`_end_batch` with the hooks, then whether the epoch's
        batches end here (else the general loop goes on with the rest)."""
        self._end_batch(True)
        bar.update(self._running_loss_postfix)
        state = self.state
        return (num_iterations > 0 and state.total_iteration_idx + 1 >= num_iterations) or \
            (state.early_stop and self.strategy.stops_mid_epoch)

    def _backward_and_step(self, loss: LossResult, optimizer_step: bool) -> None:
        self.last_batch_loss, self._loss_names = checked_batch_loss(loss)
        self.run_state.add_batch_loss(self.last_batch_loss)  # summed at the step (EpochLossSum.commit)
        self._step_runner.backward_and_step(loss, self._loss_names, optimizer_step)

    def _end_batch(self, optimizer_step: bool, batch_end_done: Optional[List[int]] = None) -> None:
        """``on_batch_end``, a Ctrl-C held during the batch, the action asked for after the step (SpikeRollback's
        check) and a stop on SIGTERM. ``batch_end_done``: the callbacks whose ``on_batch_end`` returned for this
        batch before an exception (:meth:`_finish_interrupted_step`)."""
        hooks, interrupts = self.callbacks_handler, self._interrupts
        self.state.optimizer_step_due = False
        if hooks.has_batch_hooks:
            if optimizer_step:
                # The batch is committed: an exception in a hook is continued by the next fit with the hooks that
                # had not returned (a batch inside a window is trained again, hooks and all).
                self._batch_end_done = [] if batch_end_done is None else batch_end_done
                hooks.on_batch_end(self._batch_end_done)
                self._batch_end_done = None
            else:
                hooks.on_batch_end()
        self._current_batch = None
        interrupts.in_batch = False
        if interrupts.pending:  # a Ctrl-C held during the batch is raised now
            interrupts.raise_pending()
        if optimizer_step:
            self.run_state.run_after_step(self)  # e.g. SpikeRollback's check: may roll the run back (RollBack)
            if interrupts.stop_due(self.strategy):  # SIGTERM: every process stops at this step
                interrupts.stop(self)

    def _verify_compiled_gradients(self, batch_data: Any) -> None:
        """torch_compile's check on the first training batch (see :mod:`aitoolbox.torchtrain.compiling.verify`): the
        model itself runs the batch eagerly and compiled (outside any parallel wrapper: no communication)."""
        def compute_loss() -> torch.Tensor:
            with self._precision.autocast():
                loss = self.loop_model.get_loss(batch_data, self.criterion, self.device)
            return sum(loss[name] for name in loss) if isinstance(loss, MultiLoss) else loss

        self._compiler.verify(self.model, compute_loss, self._precision.autocast_dtype)


#: How the run came to stand inside an epoch (RunState.position_in_epoch), as the refusal of an epoch-end
#: checkpoint there says it.
_HOW_INSIDE = {
    "training": "",
    "checkpoint": ", at the position of the loaded mid-epoch checkpoint",
    "exception": ", where the fit that stopped inside it continues",
    "rollback": ", at the point SpikeRollback returned the run to",
}


def _inside_epoch_message(epoch: int, batches_committed: int, how: str) -> str:
    """The refusal of ``checkpoint_state(mid_epoch=False)`` where the run stands inside epoch ``epoch``."""
    return (f"checkpoint_state(mid_epoch=False) was called while the run stands inside epoch {epoch}"
            f"{_HOW_INSIDE[how]}, after {batches_committed} of its batches committed (trained and stepped): an "
            "epoch-end checkpoint would start that epoch again on a run already past its start (weights trained on "
            "those batches, the data order drawn), so a resume would train them twice. Call checkpoint_state() (or "
            "mid_epoch=True) for a checkpoint that continues after them (inside fit's batches: in on_batch_end of a "
            "batch whose optimizer stepped), or take the epoch-end checkpoint at the epoch's end (in on_epoch_end, or "
            "after a fit that finished the epoch)")


def _no_batch_context(strategy: Any, precision: Any) -> bool:
    """Whether the contexts a batch runs in (the strategy's gradient-sync skip, the precision's autocast) are all
    no-ops, whatever the batch: then the loop does not enter them."""
    contexts = (strategy.skip_gradient_sync(accumulating=True), strategy.skip_gradient_sync(accumulating=False),
                precision.autocast())
    return all(isinstance(context, contextlib.nullcontext) for context in contexts)


def _state_unlike_parameters(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a floating tensor of the optimizer's state has another dtype than its parameter (scalar ``step``
    counters aside)."""
    for param, state in getattr(optimizer, "state", {}).items():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.is_floating_point() \
                    and value.dtype != param.dtype:
                return True
    return False


def _state_on_another_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a tensor of the optimizer's state lies on another device than its parameter (scalar ``step``
    counters aside, which torch keeps on the CPU on purpose)."""
    for param, state in getattr(optimizer, "state", {}).items():  # an optimizer-like object may have none
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != param.device:
                return True
    return False
