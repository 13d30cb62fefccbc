"""Keeps the registered callbacks in execution order and calls those that override each hook."""
import contextlib
import logging
from typing import Any, Callable, ContextManager, Dict, Iterable, List, Optional

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback

logger = logging.getLogger(__name__)

HOOK_NAMES = (
    "on_train_loop_registration", "on_multiprocess_start", "on_train_begin", "on_before_train_end", "on_train_end",
    "on_epoch_begin", "on_epoch_train_end", "on_epoch_end", "on_batch_begin", "on_batch_end",
    "on_after_gradient_update", "on_after_optimizer_step", "on_after_batch_prediction", "on_exception",
    "on_stop_signal", "progress_bar_postfix",
)

# The hooks called for every batch: when no callback has one, the loop skips calling them (on a tiny model the
# empty calls are a measurable part of the loop's cost).
BATCH_HOOK_NAMES = ("on_batch_begin", "on_batch_end", "on_after_gradient_update", "on_after_optimizer_step")


def overrides_hook(callback: AbstractCallback, hook_name: str) -> bool:
    """True when the callback's class defines its own version of the hook."""
    return getattr(type(callback), hook_name) is not getattr(AbstractCallback, hook_name)


class CallbacksHandler:
    """Registers callbacks with a TrainLoop and runs them, ordered by ``execution_order``.

    Only the callbacks that override a hook are called for it, so an empty hook costs nothing per batch.

    Args:
        train_loop_obj: the loop the callbacks belong to.
    """

    def __init__(self, train_loop_obj):
        self.train_loop_obj = train_loop_obj
        self.callbacks: List[AbstractCallback] = []
        self._subscribers: Dict[str, List[AbstractCallback]] = {name: [] for name in HOOK_NAMES}
        # Hooks a callback asked not to be called for any more (see unsubscribe), by hook name.
        self._unsubscribed: Dict[str, List[AbstractCallback]] = {name: [] for name in HOOK_NAMES}
        self.has_batch_hooks = False  # some registered callback overrides one of BATCH_HOOK_NAMES

    def register_callbacks(self, callbacks: Optional[Iterable[AbstractCallback]], cache_callbacks: bool = False,
                           print_callbacks: bool = False, every_rank: bool = False) -> None:
        """Attach callbacks to the loop; one already registered is not added twice.

        Args:
            callbacks: the callbacks, or None.
            cache_callbacks: accepted for aitoolbox 1.x compatibility (1.x kept callbacks aside for the processes
                of distributed training; here the TrainLoop travels to them with its callbacks).
            print_callbacks: log the registered callbacks afterwards.
            every_rank: keep callbacks whose ``device_idx_execution`` names another rank too (the launching
                process of ``fit_distributed`` keeps them all for the next call; each rank drops the others').

        Raises:
            TypeError: when an element is not an :class:`AbstractCallback`.
        """
        callbacks = list(callbacks or [])
        for position, callback in enumerate(callbacks):
            if not isinstance(callback, AbstractCallback):
                raise TypeError(
                    f"callbacks[{position}] is a {type(callback).__name__}, not an AbstractCallback. Subclass "
                    "aitoolbox.torchtrain.callbacks.abstract.AbstractCallback and override the hooks you need.")
        rank = self.train_loop_obj.strategy.rank
        try:
            for callback in callbacks:
                if any(callback is known for known in self.callbacks):
                    continue
                if not every_rank and callback.device_idx_execution not in (None, rank):
                    continue
                # Listed only once its registration succeeded: a callback that refused the loop is not run.
                callback.register_train_loop_object(self.train_loop_obj)
                self.callbacks.append(callback)
        finally:
            self._index_hooks()
        if print_callbacks:
            logger.info("Registered callbacks: %s", self.callbacks)

    def drop_callbacks_of_other_ranks(self) -> None:
        """Remove the callbacks whose ``device_idx_execution`` names another rank than this process's.

        Called in each process of distributed training: callbacks registered before the loop travelled to the
        processes were kept by the launching process's rank, not by the rank of the process they run in.
        """
        rank = self.train_loop_obj.strategy.rank
        kept = [cb for cb in self.callbacks if cb.device_idx_execution is None or cb.device_idx_execution == rank]
        if len(kept) != len(self.callbacks):
            self.callbacks[:] = kept  # in place: the TrainLoop's ``callbacks`` is this same list
            self._index_hooks()

    def unsubscribe(self, callback: AbstractCallback, hook_names: Iterable[str] = BATCH_HOOK_NAMES) -> None:
        """Stop calling ``callback``'s ``hook_names`` (by default the batch hooks) until :meth:`subscribe`.

        For a callback whose per-batch work is over (a profiler after its schedule): once no callback is left on
        the batch hooks, the loop skips calling them, as in a run that never had any. Safe inside a hook.
        """
        changed = False
        for name in self._check_hook_names(hook_names):
            if not any(callback is muted for muted in self._unsubscribed[name]):
                self._unsubscribed[name].append(callback)
                changed = True
        if changed:
            self._index_hooks()

    def subscribe(self, callback: AbstractCallback, hook_names: Iterable[str] = BATCH_HOOK_NAMES) -> None:
        """Call ``callback``'s ``hook_names`` again after :meth:`unsubscribe` (those it overrides)."""
        changed = False
        for name in self._check_hook_names(hook_names):
            kept = [muted for muted in self._unsubscribed[name] if muted is not callback]
            changed |= len(kept) != len(self._unsubscribed[name])
            self._unsubscribed[name] = kept
        if changed:
            self._index_hooks()

    @staticmethod
    def _check_hook_names(hook_names: Iterable[str]) -> List[str]:
        names = list(hook_names)
        unknown = [name for name in names if name not in HOOK_NAMES]
        if unknown:
            raise ValueError(f"unknown hook name(s) {unknown}; the hooks are {list(HOOK_NAMES)}")
        return names

    def _index_hooks(self) -> None:
        self.callbacks.sort(key=lambda cb: cb.execution_order)  # stable: ties keep registration order
        # New lists, never changed in place: a hook may (un)subscribe while the handler iterates over the old one.
        self._subscribers = {name: [cb for cb in self.callbacks if overrides_hook(cb, name)
                                    and not any(cb is muted for muted in self._unsubscribed[name])]
                             for name in HOOK_NAMES}
        self.has_batch_hooks = any(self._subscribers[name] for name in BATCH_HOOK_NAMES)

    def subscribers(self, hook_name: str) -> List[AbstractCallback]:
        """The callbacks called for ``hook_name``, in execution order (a list of its own), for a caller that runs
        them one by one (the loop's epoch end records each one done)."""
        return list(self._subscribers[hook_name])

    def on_multiprocess_start(self) -> None:
        for callback in self._subscribers["on_multiprocess_start"]:
            callback.on_multiprocess_start()

    def on_train_begin(self) -> None:
        for callback in self._subscribers["on_train_begin"]:
            callback.on_train_begin()

    def on_before_train_end(self) -> None:
        for callback in self._subscribers["on_before_train_end"]:
            callback.on_before_train_end()

    def on_train_end(self, done: Optional[List[int]] = None,
                     taking_part: Optional[Callable[[AbstractCallback], bool]] = None,
                     failures: Optional[List[Exception]] = None,
                     step: Optional[Callable[[AbstractCallback], ContextManager]] = None) -> None:
        """Every callback's ``on_train_end``, even after one of them raised: a failed upload must not keep the final
        model from being saved. The first failure is raised once all have run; later ones are logged.

        Args:
            done: the identities of the callbacks whose ``on_train_end`` is done (returned, or raised an
                ``Exception``), to which each is added; those in it are skipped. A ``KeyboardInterrupt`` (any
                ``BaseException``) stops at once, so the next ``fit`` calls the callbacks not in it (the
                interrupted one again, from its start), as :meth:`_call_each` does for a step's hooks.
            taking_part: with it, only the callbacks for which it is true are called.
            failures: the failures of the callbacks done so far, to which each new one is added: kept by the caller
                across a ``KeyboardInterrupt``, so the call that finishes the others still raises the first failure
                (an earlier callback's failed save is not lost to a Ctrl-C in a later one).
            step: the context in which one callback's ``on_train_end`` is called and marked done, e.g. to drop what
                an interrupted run of that hook had put into the history.
        """
        failures = [] if failures is None else failures
        done = [] if done is None else done
        for callback in self._subscribers["on_train_end"]:
            if id(callback) in done or (taking_part is not None and not taking_part(callback)):
                continue
            with contextlib.nullcontext() if step is None else step(callback):
                try:
                    callback.on_train_end()
                    done.append(id(callback))
                except Exception as error:
                    done.append(id(callback))
                    failures.append(error)
                    if len(failures) > 1:
                        logger.error("%s (%s) also failed in on_train_end: %s", type(callback).__name__,
                                     callback.callback_name, error)
                except BaseException:  # a Ctrl-C: an earlier callback's failure is raised by the fit finishing this
                    if failures:
                        logger.error("on_train_end was interrupted; an earlier callback had failed in it: %s: %s. The "
                                     "next fit finishes the train end, then raises that failure",
                                     type(failures[0]).__name__, failures[0])
                    raise
        if failures:
            raise failures[0]

    def on_epoch_begin(self) -> None:
        for callback in self._subscribers["on_epoch_begin"]:
            callback.on_epoch_begin()

    def on_epoch_train_end(self) -> None:
        for callback in self._subscribers["on_epoch_train_end"]:
            callback.on_epoch_train_end()

    def on_stop_signal(self) -> None:
        for callback in self._subscribers["on_stop_signal"]:
            callback.on_stop_signal()

    def on_epoch_end(self) -> None:
        for callback in self._subscribers["on_epoch_end"]:
            callback.on_epoch_end()

    def on_batch_begin(self) -> None:
        for callback in self._subscribers["on_batch_begin"]:
            callback.on_batch_begin()

    def on_batch_end(self, done: Optional[List[int]] = None) -> None:
        """``on_batch_end`` of each callback; with ``done``, see :meth:`_call_each`."""
        if done is not None:
            self._call_each("on_batch_end", done)
            return
        for callback in self._subscribers["on_batch_end"]:
            callback.on_batch_end()

    def on_after_gradient_update(self, optimizer_idx: int, done: Optional[List[int]] = None) -> None:
        """``on_after_gradient_update(optimizer_idx)`` of each callback; with ``done``, see :meth:`_call_each`."""
        if done is not None:
            self._call_each("on_after_gradient_update", done, optimizer_idx)
            return
        for callback in self._subscribers["on_after_gradient_update"]:
            callback.on_after_gradient_update(optimizer_idx)

    def on_after_optimizer_step(self, done: Optional[List[int]] = None) -> None:
        """``on_after_optimizer_step`` of each callback; with ``done``, see :meth:`_call_each`."""
        if done is not None:
            self._call_each("on_after_optimizer_step", done)
            return
        for callback in self._subscribers["on_after_optimizer_step"]:
            callback.on_after_optimizer_step()

    def _call_each(self, hook_name: str, done: List[int], *args: Any) -> None:
        """``hook_name`` of each callback whose identity is not in ``done``, adding it to ``done`` once its hook
        returned. A hook of a committed optimizer step that raised is so continued by the next ``fit`` with the
        callbacks that had not finished: one that had (a per-step scheduler) does not act on the step twice."""
        for callback in self._subscribers[hook_name]:
            if id(callback) in done:
                continue
            getattr(callback, hook_name)(*args)
            done.append(id(callback))

    def on_after_batch_prediction(self, y_pred_batch, y_test_batch, metadata_batch, dataset_info: dict) -> None:
        for callback in self._subscribers["on_after_batch_prediction"]:
            callback.on_after_batch_prediction(y_pred_batch, y_test_batch, metadata_batch, dataset_info)

    def progress_bar_postfix(self, postfix: Dict[str, str]) -> Dict[str, str]:
        """``postfix`` (the loop's own entries, the loss) with every callback's :meth:`~.abstract.AbstractCallback.
        progress_bar_postfix` entries added, in execution order."""
        for callback in self._subscribers["progress_bar_postfix"]:
            entries = callback.progress_bar_postfix()
            if entries:
                postfix.update(entries)
        return postfix

    def on_exception(self, exception: BaseException,
                     taking_part: Optional[Callable[[AbstractCallback], bool]] = None) -> None:
        """Let every callback clean up after ``exception`` stopped ``fit``; never raises.

        A callback's ``on_exception`` that raises (or is interrupted by another Ctrl-C) is logged and the
        others still run, so the user sees the exception that stopped training, not one from the clean-up.

        Args:
            exception: what stopped ``fit``.
            taking_part: with it, only the callbacks for which it is true are called (those of a train end).
        """
        for callback in self._subscribers["on_exception"]:
            if taking_part is not None and not taking_part(callback):
                continue
            try:
                callback.on_exception(exception)
            except (Exception, KeyboardInterrupt):  # the clean-up of the others must still run
                logger.exception("%s (%s) raised in on_exception while cleaning up after %s; the other "
                                 "callbacks' clean-up goes on", type(callback).__name__, callback.callback_name,
                                 type(exception).__name__)

    # aitoolbox 1.x's names of the same calls, for code that drives the handler itself.
    def execute_train_begin(self) -> None:
        self.on_train_begin()

    def execute_train_end(self) -> None:
        self.on_train_end()

    def execute_epoch_begin(self) -> None:
        self.on_epoch_begin()

    def execute_epoch_end(self) -> None:
        self.on_epoch_end()

    def execute_batch_begin(self) -> None:
        self.on_batch_begin()

    def execute_batch_end(self) -> None:
        self.on_batch_end()

    def execute_gradient_update(self, optimizer_idx: int = 0) -> None:
        self.on_after_gradient_update(optimizer_idx)

    def execute_optimizer_step(self) -> None:
        self.on_after_optimizer_step()

    def execute_multiprocess_start(self) -> None:
        self.on_multiprocess_start()

    def execute_after_batch_prediction(self, y_pred_batch, y_test_batch, metadata_batch, dataset_info: dict) -> None:
        self.on_after_batch_prediction(y_pred_batch, y_test_batch, metadata_batch, dataset_info)
