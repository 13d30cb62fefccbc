"""Where a training run is: the one object that holds a run's progress and captures or restores all of its state.

A :class:`RunState` holds the loop's counters (:class:`~.loop_state.LoopState`, ``tl.state``), the current epoch's
progress (batches trained, the sum of their losses, the RNG state the epoch's data order was drawn from), the
point an exception continues from, and a loaded checkpoint waiting for ``fit``. The rest of a run's state lives in
the parts that own it (model and optimizers, precision, callbacks, history); :meth:`RunState.capture` gathers all of
it into one checkpoint dict and :meth:`RunState.load` puts one back (the format is :mod:`.train_state`'s).

Everything that continues a run goes through here: a checkpoint file, the result ``fit_distributed`` hands to the
launching process, and a ``fit`` called again after an exception. So there is one answer to "what is a run", and
"resume equals straight" and "two fits equal one" hold by construction.
"""
import copy
import logging
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import IterableDataset

from aitoolbox.torchtrain.train_loop.data_position import epoch_without
from aitoolbox.torchtrain.train_loop.evaluation import loader_generators, loader_length
from aitoolbox.torchtrain.train_loop.loop_state import LoopState
from aitoolbox.torchtrain.train_loop.losses import EpochLossSum
from aitoolbox.torchtrain.train_loop.rollback import RollbackHistory
from aitoolbox.experiment.local_save.checkpoints import OPTIMIZER_KEY, SCHEDULERS_KEY
from aitoolbox.torchtrain.train_loop.train_state import (
    MidEpochResume, apply_pending_states, capture_rng_state, capture_train_state, history_lengths,
    restore_rng_state, restore_train_state, saved_optimizer_states)

if TYPE_CHECKING:  # pragma: no cover
    from aitoolbox.torchtrain.train_loop.train_loop import TrainLoop

logger = logging.getLogger(__name__)

_CPU_GENERATOR = torch.default_generator  # torch.get_rng_state() is a Python call around its get_state()


class RunState:
    """A training run's progress, and the capture and restore of its whole state.

    Attributes:
        counters: the loop's counters and flags (``tl.state``).
        epoch_loss: the sum of the current epoch's batch losses (committed at each optimizer step).
        batches_done: batches of the current epoch trained so far.
        epoch_start_rng: the RNG state the current epoch's data order was drawn from.
        pending_checkpoint: a loaded checkpoint whose precision, callback and RNG states ``fit`` applies when it
            starts (``tl.pending_restore``).
        pending_source: the file ``pending_checkpoint`` was read from (None: a dict the caller made), named in the
            errors of applying it.
        rollbacks: the batches rollbacks left out (each epoch leaves them out as if its loader never yielded them)
            and the record of each rollback (:mod:`.rollback`).
    """

    def __init__(self, counters: Optional[LoopState] = None):
        self.counters = counters if counters is not None else LoopState()
        self.epoch_loss = EpochLossSum()
        self.batches_done = 0
        self.num_batches: Optional[int] = None  # the current epoch's (see epoch_length)
        self.epoch_start_rng: Optional[dict] = None
        self.pending_checkpoint: Optional[dict] = None
        self.pending_source: Optional[str] = None
        # The current epoch's last completed batch (a tuple, see mark_batch_done), or a MidEpochResume once the
        # epoch's batches are all trained; None before the epoch's first step.
        self._step_point: Any = None
        self._loader_generators: list = []  # the training loader's own generators (epoch_batches), see mark_batch_done
        self._interrupted_at: Optional[MidEpochResume] = None
        # How the run came to the MidEpochResume in _step_point (see position_in_epoch): "checkpoint",
        # "exception" or "rollback".
        self._continued_from = "checkpoint"
        self.rollbacks = RollbackHistory()
        #: The action :meth:`call_after_step` asked for, until :meth:`run_after_step` runs it (None: none).
        self.after_step_action: Optional[Callable[["TrainLoop"], None]] = None
        #: With :attr:`time_loader` (ThroughputMonitor sets it): seconds spent getting training batches from the
        #: loader (starting an epoch's iteration, and each ``next``), summed over the run.
        self.loader_wait_s = 0.0
        self.time_loader = False
        # The model's buffers (BatchNorm's running statistics...) and their values at the step point: a batch
        # trained again after an exception must not count its forward's updates twice.
        self._buffers: List[torch.Tensor] = []
        self._buffers_at_step: List[torch.Tensor] = []
        self._cuda_rng = False
        self._loader_length_warned = False
        # Whether a checkpoint has warned that it starts an epoch of a loader resetting its persistent workers: once
        # a run, not at every epoch-end save.
        self.persistent_workers_warned = False
        # The steps of the train end finished so far, while it runs and after an exception in it (None: no train
        # end in progress), see begin_train_end.
        self._train_end_done: Optional[List[str]] = None
        # The identities of the callbacks whose on_train_end returned (or raised an Exception: the handler calls the
        # others and raises after them), while the train end runs; a KeyboardInterrupt leaves the rest.
        self._on_train_end_done: List[int] = []
        # The identities of the callbacks registered when the train end started: only they take part in it, also
        # when the next fit finishes it after registering its own callbacks (review 48l F1).
        self._train_end_callbacks: List[int] = []
        # fit was left by an exception in the train end (not: the train end is running).
        self._train_end_interrupted = False
        # The first on_train_end failures of the end in progress: one interrupted by a Ctrl-C in a later callback's
        # on_train_end is raised by the fit that finishes the end (review 48t G2).
        self.train_end_failures: List[Exception] = []
        # The fit arguments (num_epochs, num_iterations, grad_accumulation) of the fit whose end this is: the next
        # fit finishing it sets its own first, and the end's hooks see the ones of its fit (review 48t G5).
        self.train_end_arguments: Optional[Tuple[int, int, int]] = None

    # --- the run as a checkpoint -------------------------------------------------------------------------
    def capture(self, tl: "TrainLoop", mid_epoch: bool, hyperparams: Optional[dict] = None,
                include_weights: bool = True, include_pending: bool = True) -> dict:
        """The whole run now, as a checkpoint dict (a collective in a distributed run: call it in every process).

        A loaded checkpoint that ``fit`` has not applied yet is the run: its precision, callback, scheduler and
        random states and its position are taken from it (those of the loop are not the run's until ``fit``
        applies them), the weights, optimizer states and history from the loop, where loading put them.
        ``include_pending=False`` captures the loop as it is (a :class:`~.run_snapshot.RunSnapshot` keeps the
        pending checkpoint beside it)."""
        checkpoint = capture_train_state(tl, mid_epoch, hyperparams, include_weights)
        if include_pending and self.pending_checkpoint is not None:
            _take_pending_states(checkpoint, self.pending_checkpoint)
        return checkpoint

    def load(self, tl: "TrainLoop", checkpoint: dict, source: Optional[str] = None) -> None:
        """Load a checkpoint before ``fit``: weights and counters now, the rest when ``fit`` starts; ``source`` (the
        file it was read from) is named in the errors of applying the rest."""
        restore_train_state(tl, checkpoint)
        self.pending_source = source
        self._interrupted_at = self._step_point = None  # the checkpoint says where to continue
        if self.train_end_pending:  # (review 48t G4: it went silently)
            # An on_train_end failure kept across a Ctrl-C was logged as one the next fit raises (review 49l F7).
            failure = self.train_end_failures[0] if self.train_end_failures else None
            kept = "" if failure is None else (f"; the on_train_end failure kept from it ({type(failure).__name__}: "
                                               f"{failure}), which that fit would raise, is then not raised")
            logger.warning("the last fit stopped in its train end: loading a checkpoint drops what was left of that "
                           "end (the final test-set evaluation, the callbacks' on_train_end: final saves) for the run "
                           "before the checkpoint. To finish it, call fit() before loading%s", kept)
        self.end_train_end()

    def start_training(self, model: torch.nn.Module) -> None:
        """At the start of ``fit``, the model set up (its buffers are the tensors that train now: casting a model
        replaces them): the buffers the step point holds."""
        self._buffers = list(model.buffers())
        self._buffers_at_step = [buffer.detach().clone() for buffer in self._buffers]
        # CUDA's generators are part of the step point once CUDA is in use (a model on a GPU initialises it in set-up;
        # asked once here: is_initialized() at every step costs, is_available() more).
        self._cuda_rng = torch.cuda.is_initialized()

    def resume_point(self, tl: "TrainLoop") -> Optional[MidEpochResume]:
        """At the start of training: apply a loaded checkpoint's pending states, or take the point where the last
        ``fit`` stopped on an exception. Returns where to continue inside an epoch (None: at an epoch's start)."""
        from_checkpoint = apply_pending_states(tl)
        point, self._interrupted_at = self._interrupted_at, None
        # Until the epoch's batches start again (epoch_batches marks the resumed position), an exception (in
        # on_epoch_begin, say) continues from this same point: nothing was trained since.
        self._step_point = from_checkpoint if from_checkpoint is not None else point
        self._continued_from = "checkpoint" if from_checkpoint is not None else "exception"
        if from_checkpoint is not None:
            return from_checkpoint
        if point is not None and tl.strategy.is_main_process:
            # A count of the batches done, not a batch index (review of issue 35, friction 4).
            logger.info("Continuing epoch %d where the last fit stopped, after %d batch%s of it",
                        self.counters.epoch + 1, point.batches_done, "" if point.batches_done == 1 else "es")
        return point

    def continue_after_rollback(self, resume: Optional[MidEpochResume]) -> None:
        """A rollback put a kept point back (``resume``: where its epoch continues; None: at an epoch's start). Until
        the replayed epoch's batches start again (its ``on_epoch_begin`` runs first), the run stands at that point,
        as after a loaded mid-epoch checkpoint: a checkpoint taken there records it, an exception continues from it.
        The epoch's batch count and ``iteration`` are the point's (a point restored from a checkpoint file left
        the abandoned run's in the replayed ``on_epoch_begin``, review 47r D5); the loss sum is the abandoned run's
        until the replay's batches start (the checkpoint takes the point's from ``resume``)."""
        self._interrupted_at = None
        self._step_point = resume
        self._continued_from = "rollback"
        self.batches_done = resume.batches_done if resume is not None else 0
        if resume is not None and resume.batches_done > 0:
            self.counters.iteration = resume.batches_done - 1  # the last batch trained before the point

    def progress_beyond_checkpoint(self) -> dict:
        """What the run's progress holds besides a checkpoint's content: a loaded checkpoint waiting for ``fit``
        (kept as it is: it is the caller's) and the point a ``fit`` stopped by an exception continues from."""
        return {"pending_checkpoint": self.pending_checkpoint, "pending_source": self.pending_source,
                "interrupted_at": copy.deepcopy(self._interrupted_at)}

    def restore_progress_beyond_checkpoint(self, progress: dict) -> None:
        """Put back what :meth:`progress_beyond_checkpoint` returned (it stays usable for another restore)."""
        self.pending_checkpoint = progress["pending_checkpoint"]
        self.pending_source = progress.get("pending_source")
        self._interrupted_at = copy.deepcopy(progress["interrupted_at"])

    # --- the current epoch ---------------------------------------------------------------------------------
    def epoch_batches(self, loader: Any, resume: Optional[MidEpochResume], device: torch.device) -> Iterator[Tuple[int, Any]]:
        """``(index, batch)`` pairs of the epoch starting now, the epoch's progress set to ``resume``'s (or
        zero): its data order is drawn again from the epoch's starting RNG state, the batches trained skipped
        (without loading them where the loader allows: :func:`~.data_position.resumed_epoch`), and the RNG state
        to continue with put back. Batches a rollback left out are not yielded, and the indices are those of the
        batches that remain (:func:`~.data_position.epoch_without`)."""
        started = time.perf_counter()
        if resume is not None:
            restore_rng_state(resume.epoch_start_rng, loader)
        self._loader_generators = loader_generators(loader)
        self.epoch_start_rng = capture_rng_state(loader, self._loader_generators)
        self.epoch_loss = EpochLossSum(resume.loss_sum if resume else None, device)
        batches_done = resume.batches_done if resume is not None else 0
        epoch = self.counters.epoch
        batches = enumerate(epoch_without(loader, self.rollbacks.loader_start(epoch, batches_done),
                                          self.rollbacks.positions(epoch), resume.loader_state if resume else None),
                            start=batches_done)
        if batches_done > 0:
            restore_rng_state(resume.rng, loader)  # after the skipped batches' draws, as the run had it
        # (Stopped before the epoch's first step: the epoch starts again from its starting RNG state, which is
        # what the run had there; the state at the stop would draw another data order.)
        self.batches_done = batches_done
        self.mark_batch_done()
        if not self.time_loader:
            return batches
        self.loader_wait_s += time.perf_counter() - started  # the loader's iterator starts (workers, skipping)
        return self._timed(batches)

    def _timed(self, batches: Iterator[Tuple[int, Any]]) -> Iterator[Tuple[int, Any]]:
        """``batches``, adding the time each ``next`` takes to :attr:`loader_wait_s`."""
        while True:
            started = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                self.loader_wait_s += time.perf_counter() - started
                return
            self.loader_wait_s += time.perf_counter() - started
            yield batch

    def epoch_length(self, loader: Any) -> Optional[int]:
        """The current epoch's number of batches (those a rollback left out not counted); None if unknown. Kept as
        :attr:`num_batches` until the next epoch (or replay) starts."""
        self.num_batches = self.rollbacks.epoch_length(self.counters.epoch, loader_length(loader))
        return self.num_batches

    def window_end_length(self, loader: Any) -> Optional[int]:
        """The epoch's length (:attr:`num_batches`) where its last batch may close an accumulation window before the
        loader is exhausted; None where ``len`` may be wrong: an ``IterableDataset``'s ``__len__`` is its author's
        estimate, and a loader whose ``len`` proved wrong once is not trusted again. Stepping at a batch ``len``
        called the last, with more to come, would add an optimizer step on a partial window (review of issue 32,
        D6); the loader's end closes the window instead."""
        if self._loader_length_warned or isinstance(getattr(loader, "dataset", None), IterableDataset):
            return None
        return self.num_batches if self.num_batches is not None else loader_length(loader)  # (outside an epoch)

    def check_loader_exhausted(self) -> None:
        """The epoch's loader is exhausted: warn (once) if it yielded another number of batches than its ``len``
        said (an ``IterableDataset`` with an approximate ``__len__``)."""
        expected = self.num_batches
        if expected is None or self.batches_done == expected or self._loader_length_warned:
            return
        self._loader_length_warned = True
        warnings.warn(f"train_loader's len() is {expected} (batches an epoch) but it yielded {self.batches_done} in "
                      f"epoch {self.counters.epoch}: the loop steps on the last window's gradients when the loader "
                      "is exhausted, but what is computed from len() (the progress bar, get_num_training_steps(), "
                      "schedules built on it) is off. Give the dataset an exact __len__, or none.", UserWarning,
                      stacklevel=2)

    def call_after_step(self, action: Callable[["TrainLoop"], None]) -> None:
        """Run ``action(tl)`` once the current batch is done: after its optimizer step and every callback's
        ``on_batch_end``, where a mid-epoch checkpoint holds the whole step (call it from a batch hook of a batch
        that steps). ``action`` may raise :class:`~.rollback.RollBack`. One action per step: a second replaces it."""
        self.after_step_action = action

    def run_after_step(self, tl: "TrainLoop") -> None:
        """The loop, at the end of a batch that stepped: run the action :meth:`call_after_step` asked for."""
        action, self.after_step_action = self.after_step_action, None
        if action is not None:
            action(tl)

    def add_batch_loss(self, loss: torch.Tensor) -> None:
        """A batch was trained: its loss joins the epoch's sum at the next optimizer step."""
        self.epoch_loss.values.append(loss)  # EpochLossSum.add without its call (runs per batch)
        self.batches_done += 1

    def mark_batch_done(self) -> None:
        """Every optimizer stepped for the last batch: an exception from here on continues after it.

        Runs at every optimizer step, so it keeps a tuple (the MidEpochResume is built only if an exception comes),
        of the RNG only torch's generators (a copy of a few kilobytes): the batches trained again after an
        exception draw their dropout masks as the interrupted run did; and a copy of the model's buffers (put back
        by the exception, see :meth:`remember_interruption`). The training loader's own generators too (none for
        most loaders): fetching the next batch may draw from them after the step (a shuffling sampler's tail, with
        a partial last batch), and the continuation draws that again.
        """
        self.epoch_loss.commit()
        if self._buffers:
            torch._foreach_copy_(self._buffers_at_step, self._buffers)  # one kernel launch for all of them
        cuda = torch.cuda.get_rng_state_all() if self._cuda_rng else []
        loader_states = list(map(torch.Generator.get_state, self._loader_generators))  # (no Python frame a step)
        self._step_point = (self.batches_done, self.counters.total_iteration_idx, _CPU_GENERATOR.get_state(), cuda,
                            loader_states)

    def mark_epoch_trained(self, history: Any) -> None:
        """The epoch's batches are all trained: its end (:meth:`run_epoch_end_step`) begins. An exception in it
        continues with the end's steps not finished yet."""
        lengths = history_lengths(history)
        self._step_point = MidEpochResume(self.batches_done, self.epoch_loss.state(include_pending=True), None, None,
                                          batches_trained=True, history_lengths=lengths,
                                          finished_history_lengths=lengths)

    def continue_epoch_end(self, resume: MidEpochResume, device: torch.device) -> None:
        """Continue the end of an epoch that an exception interrupted (``resume``, from :meth:`resume_point`): its
        progress, the epoch's batch count and loss sum are the interrupted end's."""
        self._step_point = resume
        self.batches_done = resume.batches_done
        self.epoch_loss = EpochLossSum(resume.loss_sum, device)

    def run_epoch_end_step(self, name: str, action: Callable[[], None], history: Any) -> None:
        """One step of the epoch's end: ``action()`` unless an interrupted end finished the step ``name`` already;
        then the step is recorded as finished (with the history as it left it)."""
        progress = self._step_point
        if name in progress.finished_steps:
            return
        action()
        progress.finished_steps.append(name)
        progress.finished_history_lengths = history_lengths(history)

    @property
    def in_epoch_end(self) -> bool:
        """The current epoch's batches are all trained and its end is running."""
        return isinstance(self._step_point, MidEpochResume) and self._step_point.batches_trained

    def epochs_completed_at_checkpoint(self, mid_epoch: bool) -> int:
        """The epochs a checkpoint taken now records as done: the counter; in an epoch's end, an epoch-end
        checkpoint (``mid_epoch=False``) is the run after that end, so the epoch counts."""
        return self.counters.epochs_completed + (1 if not mid_epoch and self.in_epoch_end else 0)

    @property
    def continuation_pending(self) -> bool:
        """The last ``fit`` stopped on an exception with work the next ``fit`` must finish before anything else
        (an epoch's end), whatever the counters say is left to train."""
        point = self._interrupted_at
        return point is not None and point.batches_trained

    @property
    def interrupted_before_epoch_evaluation(self) -> bool:
        """The last ``fit`` stopped on an exception in an epoch's end before its evaluation was done (the loss sum
        into the history, ``on_epoch_train_end``, the evaluation itself)."""
        point = self._interrupted_at
        return point is not None and point.batches_trained and "auto_evaluation" not in point.finished_steps

    @property
    def in_epoch_end_before_evaluation(self) -> bool:
        """An epoch's end is running and its evaluation is not done yet: in ``on_epoch_train_end`` or the evaluation
        (also where the last ``fit`` stopped there, see :attr:`interrupted_before_epoch_evaluation`)."""
        return self.in_epoch_end and "auto_evaluation" not in self._step_point.finished_steps

    def interrupted_at_iteration_target(self, num_iterations: int) -> bool:
        """An exception interrupted an epoch's batches exactly where ``fit(num_iterations=num_iterations)`` ends
        (e.g. in the last batch's ``on_batch_end``, or between the optimizers of its step), or a loaded mid-epoch
        checkpoint was taken there (before that epoch's end, which a mid-epoch checkpoint always precedes): that
        ``fit`` still has to finish the step and close the shortened epoch, as the uninterrupted run did, though no
        batch is left."""
        if num_iterations <= 0 or self.counters.iterations_done != num_iterations:
            return False
        point = self._interrupted_at
        if point is not None:
            return not point.batches_trained and point.batches_done > 0
        return self.pending_checkpoint is not None and self.pending_checkpoint.get("iteration", 0) > 0

    @property
    def interrupted_step_point(self) -> Optional[MidEpochResume]:
        """The step point an exception left inside an epoch's batches, that the next ``fit`` continues from (None:
        none, or the interruption is in the epoch's end). A mid-epoch checkpoint taken before that ``fit`` records
        this position, not the batch the exception came in."""
        point = self._interrupted_at
        return point if point is not None and not point.batches_trained else None

    @property
    def continuation_point(self) -> Optional[MidEpochResume]:
        """The step point inside an epoch's batches that the run continues from and has not trained past: the
        :attr:`interrupted_step_point`, or, once ``fit`` has taken it (or a loaded mid-epoch checkpoint's), that same
        point until the epoch's batches start again (in ``on_epoch_begin``). A checkpoint taken now records this
        position: the loop's own counters (``tl.iteration``) are still those of the batch the last ``fit`` stopped
        in, or a new loop's."""
        point = self._interrupted_at if self._interrupted_at is not None else self._step_point
        return point if isinstance(point, MidEpochResume) and not point.batches_trained else None

    @property
    def inside_epoch_batches(self) -> bool:
        """The run stands between two batches of an epoch: at a step point of the epoch being trained, at a
        :attr:`continuation_point`, or at a loaded mid-epoch checkpoint's position before ``fit`` applies it. False
        at an epoch boundary (before the first ``fit``, after one that ended with an epoch, before an epoch's first
        batch) and in an epoch's end: there a checkpoint has no position inside an epoch to record, and a mid-epoch
        one is the epoch-end one."""
        if self._interrupted_at is not None:
            return not self._interrupted_at.batches_trained
        if self.pending_checkpoint is not None and self.pending_checkpoint.get("iteration", 0) > 0:
            return True  # a loaded mid-epoch checkpoint: the run stands at its position until fit goes on from it
        return isinstance(self._step_point, tuple) or self.continuation_point is not None

    def position_in_epoch(self) -> Optional[Tuple[int, str]]:
        """Where the run stands inside an epoch, for the messages of the checkpoints refused there: ``(batches
        committed, how the run got there)``, the latter ``"training"`` (between the batches of the epoch being
        trained), ``"checkpoint"`` (at a loaded mid-epoch checkpoint's position, before or after ``fit`` has taken
        it), ``"exception"`` (where a ``fit`` stopped inside the epoch continues) or ``"rollback"`` (at the point a
        rollback returned to). None at an epoch boundary, also where the epoch starts again from its first batch
        (stopped before its first step) and in an epoch's end."""
        point = self.continuation_point
        if point is None and self._interrupted_at is None and self.pending_checkpoint is not None:
            batches = self.pending_checkpoint.get("iteration", 0)  # (a 1.x checkpoint has none: an epoch's end)
            return (batches, "checkpoint") if batches > 0 else None
        if point is not None:
            origin = "exception" if self._interrupted_at is not None else self._continued_from
            return (point.batches_done, origin) if point.batches_done > 0 else None
        if isinstance(self._step_point, tuple) and self._interrupted_at is None:
            return self._step_point[0], "training"
        return None

    @property
    def batches_committed(self) -> int:
        """The batches of the current epoch whose optimizer step is done: the step point's count (:attr:`batches_done`
        also counts a batch from its forward on, before its step)."""
        point = self._step_point
        if isinstance(point, tuple):  # (see mark_batch_done)
            return point[0]
        return point.batches_done if point is not None else 0

    # --- the train end -----------------------------------------------------------------------------------------
    def begin_train_end(self, callbacks: List[Any], arguments: Optional[Tuple[int, int, int]] = None) -> List[str]:
        """The train end (``on_before_train_end``, the test-set evaluation, ``on_train_end``) starts, or continues
        after an exception in it: the names of its steps finished so far, to which the loop adds each step it
        finishes. Until :meth:`end_train_end`, an exception leaves the rest for the next ``fit``
        (:attr:`train_end_pending`).

        Args:
            callbacks: the registered callbacks; where the end starts, they are those that take part in it
                (:meth:`takes_part_in_train_end`).
            arguments: where the end starts, its fit's ``(num_epochs, num_iterations, grad_accumulation)``
                (:attr:`train_end_arguments`).
        """
        self._train_end_interrupted = False
        if self._train_end_done is None:
            self._train_end_done, self._on_train_end_done = [], []
            self._train_end_callbacks = [id(callback) for callback in callbacks]
            self.train_end_failures, self.train_end_arguments = [], arguments
        return self._train_end_done

    def takes_part_in_train_end(self, callback: Any) -> bool:
        """``callback`` was registered when the train end in progress started (one registered later, by the
        ``fit`` that finishes an interrupted end, has its own ``on_train_begin`` still to come)."""
        return id(callback) in self._train_end_callbacks

    @property
    def on_train_end_done(self) -> List[int]:
        """The identities of the callbacks whose ``on_train_end`` is done in the train end in progress (see
        :meth:`~aitoolbox.torchtrain.callbacks.handler.CallbacksHandler.on_train_end`)."""
        return self._on_train_end_done

    def end_train_end(self) -> None:
        """The train end is done: its steps and every callback's ``on_train_end``."""
        self._train_end_done, self._on_train_end_done, self._train_end_interrupted = None, [], False
        self._train_end_callbacks = []
        self.train_end_failures, self.train_end_arguments = [], None

    @property
    def train_end_pending(self) -> bool:
        """The train end is running, or the last ``fit`` stopped on an exception in it: the next ``fit`` finishes
        that end first, as the ``fit`` would have, whatever is left to train."""
        return self._train_end_done is not None

    def begin_on_train_end(self) -> None:
        """The train end's steps before ``on_train_end`` are done (see :attr:`in_train_end_before_on_train_end`)."""
        if "on_train_end" not in self._train_end_done:
            self._train_end_done.append("on_train_end")

    @property
    def in_train_end_before_on_train_end(self) -> bool:
        """The train end is running (or the last ``fit`` stopped in it) and its ``on_train_end`` has not started:
        in ``on_before_train_end`` or the test-set evaluation."""
        return self._train_end_done is not None and "on_train_end" not in self._train_end_done

    @property
    def interrupted_in_train_end(self) -> bool:
        """The last ``fit`` stopped on an exception in its train end, which the next ``fit`` finishes."""
        return self._train_end_interrupted

    def end_epoch(self, train_end: Optional[Tuple[List[Any], Tuple[int, int, int]]] = None) -> None:
        """The epoch is complete and counted: an exception from here on starts the next one.

        Args:
            train_end: for the training's last epoch (the target reached, or a stop requested), the callbacks
                registered and the fit arguments (see :meth:`begin_train_end`): the train end begins in the same
                statement that completes the epoch, so that an exception between the two (a Ctrl-C after the last
                epoch's end, before the end's first step) leaves that end to the next ``fit`` instead of losing it.
        """
        if train_end is not None and self._train_end_done is None:
            # Set while _train_end_done is None (no end pending): nothing reads them until the statement below.
            self._on_train_end_done, self.train_end_failures = [], []
            self._train_end_callbacks = [id(callback) for callback in train_end[0]]
            self.train_end_arguments = train_end[1]
        begun = [] if train_end is not None and self._train_end_done is None else self._train_end_done
        # One statement: the epoch counted, its end over and the train end begun together (a KeyboardInterrupt
        # lands between statements, not inside this assignment's stores).
        self.counters.epochs_completed, self._step_point, self._train_end_done = \
            self.counters.epochs_completed + 1, None, begun

    # --- an exception --------------------------------------------------------------------------------------
    def remember_interruption(self, loader: Any, unfinished_step: bool = False) -> None:
        """``fit`` is left by an exception: remember where the next ``fit`` continues (never raises, so that the
        user sees their own exception). Inside an epoch's batches the model's buffers go back to the step point
        at once, so the model is the committed run's (weights change only at steps).

        Args:
            loader: the training loader.
            unfinished_step: the current batch's step was interrupted after some optimizer had stepped (several
                optimizers stepped in turn): the next ``fit`` finishes it, then goes on after the batch.
        """
        self._train_end_interrupted = self.train_end_pending
        if self._interrupted_at is not None:  # the last exception's continuation has not begun: it still stands
            return
        try:
            self._interrupted_at = self._interruption_point(loader, unfinished_step)
        except Exception:  # e.g. a device in an error state
            logger.exception("Could not record where training stopped; the next fit restarts the epoch")
            self._interrupted_at = None

    def _interruption_point(self, loader: Any, unfinished_step: bool) -> Optional[MidEpochResume]:
        """The interrupted epoch's last completed batch (the batches of a partly accumulated window are trained
        again, with the torch RNG state they had), the batch whose step is to be finished, or, stopped in the
        epoch's end, that end."""
        point = self._step_point
        if unfinished_step:  # everything as it is now: the batch's forward and backward are done
            return MidEpochResume(self.batches_done, self.epoch_loss.state(include_pending=True), self.epoch_start_rng,
                                  capture_rng_state(loader), finish_step=True)
        if point is None or isinstance(point, MidEpochResume):
            return point
        batches_done, total_iteration_idx, torch_rng, cuda_rng, loader_states = point
        self.counters.total_iteration_idx = total_iteration_idx
        if self._buffers:
            with torch.no_grad():
                torch._foreach_copy_(self._buffers, self._buffers_at_step)
        rng = dict(capture_rng_state(loader), torch=torch_rng, cuda=cuda_rng, loader_generators=loader_states)
        return MidEpochResume(batches_done, self.epoch_loss.state(), self.epoch_start_rng, rng)


# What a loaded checkpoint waiting for fit holds of the run that the loop does not hold yet.
_PENDING_KEYS = ("precision", "callbacks", SCHEDULERS_KEY, "amp", "rng", "epochs_completed", "iteration", "early_stop",
                 "epoch_start_rng", "epoch_loss_sum", "epoch_loss_state", "epoch_loss_names", "train_loader_state",
                 "train_history_per_rank", "rollbacks")


def _take_pending_states(checkpoint: dict, pending: dict) -> None:
    """Put into ``checkpoint`` (captured from the loop) the states of the loaded checkpoint ``pending`` that ``fit``
    has not applied yet (copies: the pending checkpoint is the caller's)."""
    for key in _PENDING_KEYS:
        if key in pending:
            checkpoint[key] = copy.deepcopy(pending[key])
        else:
            checkpoint.pop(key, None)
    if "train_history_per_rank" in checkpoint:
        checkpoint["train_history"] = checkpoint["train_history_per_rank"][0]
    # LR schedulers put their initial learning rate into the optimizers when registered; fit puts the saved back.
    saved_groups = [state["param_groups"] for state in saved_optimizer_states(pending)]
    states = [checkpoint[OPTIMIZER_KEY]] if isinstance(checkpoint[OPTIMIZER_KEY], dict) else checkpoint[OPTIMIZER_KEY]
    for state, groups in zip(states, saved_groups):
        for group, saved in zip(state["param_groups"], groups):
            group.update({key: copy.deepcopy(value) for key, value in saved.items() if key != "params"})
