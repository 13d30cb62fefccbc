"""What compiling cost a TrainLoop: each compilation, its duration and whether it was a recompilation.

Dynamo announces every compilation through ``torch._dynamo.callback`` (start and end, with a compile id
``"<frame>/<attempt>"``: an attempt above 0 is a recompilation of a frame whose earlier graphs' guards failed,
e.g. on a new input shape). A :class:`CompileStats` listens from the first compiled call of its TrainLoop
and keeps the compilations that happen while that TrainLoop is running (training, evaluation or a compiled
call of its own), so that other code compiling in the same process is not counted.
"""
import dataclasses
import logging
import time
import weakref
from typing import Callable, List, Optional

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CompileEvent:
    """One compilation.

    Attributes:
        compile_id: dynamo's id, ``"<frame>/<attempt>"`` (a backward compiled lazily has its own trigger).
        seconds: wall time the compilation took.
        epoch: the TrainLoop's epoch when it happened.
        iteration: the batch index within that epoch.
        trigger: ``'dynamo'`` (a frame traced), ``'lazy_backward'`` or ``'cudagraph_recording'``.
    """
    compile_id: str
    seconds: float
    epoch: int
    iteration: int
    trigger: str

    @property
    def is_recompile(self) -> bool:
        """True for a further graph of a frame compiled before (its earlier graphs' guards failed)."""
        attempt = self.compile_id.rsplit("/", 1)[-1]
        return attempt.isdigit() and int(attempt) > 0


class CompileStats:
    """The compilations of one TrainLoop's compiled model and optimizer steps (``tl.compile_stats``).

    Args:
        position: returns the loop's current ``(epoch, iteration)``, recorded with each compilation.
    """

    def __init__(self, position: Callable[[], tuple]):
        self.events: List[CompileEvent] = []
        self._position = position
        self._depth = 0  # > 0 while this TrainLoop runs: compilations then are its own
        self._started: Optional[float] = None
        self._listener: Optional[_DynamoListener] = None
        self._limit_hits_seen = 0
        self.recompile_limit_reached = False
        # The compiled callable (model call or optimizer step) that ran last: a compilation is counted to it (a
        # backward compiled lazily, after the forward returned, belongs to that forward).
        self.caller = None

    def __getstate__(self) -> dict:
        # A copy in another process listens there anew (the registration is this process's).
        state = self.__dict__.copy()
        state.update(_depth=0, _started=None, _listener=None, _limit_hits_seen=0, caller=None)
        return state

    def __repr__(self) -> str:
        return (f"CompileStats(compiles={self.compiles}, recompiles={self.recompiles}, "
                f"compile_time_s={self.compile_time_s:.2f})")

    @property
    def compiles(self) -> int:
        """Compilations so far (first compilations and recompilations)."""
        return len(self.events)

    @property
    def recompiles(self) -> int:
        """Compilations of a frame compiled before (guards failed: a new shape, mode or dtype)."""
        return sum(event.is_recompile for event in self.events)

    @property
    def compile_time_s(self) -> float:
        """Seconds spent compiling in all."""
        return sum(event.seconds for event in self.events)

    def compiles_since(self, epoch: int) -> List[CompileEvent]:
        """The compilations during epoch ``epoch`` or later (none after warm-up is what a steady run shows)."""
        return [event for event in self.events if event.epoch >= epoch]

    def check_recompile_limit(self, never_compiled: List[str]) -> bool:
        """True (and a warning, the first time) if dynamo gave up compiling part of this run because a code object
        reached ``torch._dynamo.config.recompile_limit``: that code then runs uncompiled.

        Args:
            never_compiled: the compiled callables that ran but never compiled a graph (dynamo skipping them).
        """
        hits = recompile_limit_hits()
        if (hits > self._limit_hits_seen or never_compiled) and not self.recompile_limit_reached:
            self.recompile_limit_reached = True
            logger.warning(
                "torch.compile reached torch._dynamo.config.recompile_limit (%d): %s of this run now runs "
                "uncompiled. torch counts the graphs of models and optimizers freed "
                "earlier in this process against the limit, so this happens after several TrainLoops in one "
                "notebook or script: call torch._dynamo.reset() before building the next TrainLoop, or raise "
                "torch._dynamo.config.recompile_limit. TORCH_LOGS=recompiles shows what recompiled.",
                _recompile_limit(), " and ".join(never_compiled) or "part")
        self._limit_hits_seen = hits
        return self.recompile_limit_reached

    def listen(self) -> None:
        """Start listening to dynamo's compilation announcements (once; they stop when this object is freed).
        A torch without them (before 2.5) compiles the same, with no statistics recorded."""
        if self._listener is None and _has_compile_callbacks():
            self._listener = _DynamoListener(self)
            self._limit_hits_seen = recompile_limit_hits()

    def __enter__(self) -> "CompileStats":
        if self._depth == 0 and self._listener is not None:
            self._listener.ensure_registered()  # torch._dynamo.reset() unregisters every listener
        self._depth += 1
        return self

    def __exit__(self, *exc_info) -> None:
        self._depth -= 1

    def _on_start(self) -> None:
        if self._depth > 0:
            self._started = time.perf_counter()

    def _on_end(self, compile_id: str, trigger: str) -> None:
        if self._started is None:
            return
        seconds, self._started = time.perf_counter() - self._started, None
        epoch, iteration = self._position()
        event = CompileEvent(compile_id, seconds, epoch, iteration, trigger)
        self.events.append(event)
        if self.caller is not None:
            self.caller.compiles += 1
        logger.debug("torch.compile: %s %s in %.2f s (epoch %d, batch %d); %d compilations so far",
                     "recompiled" if event.is_recompile else "compiled", compile_id, seconds, epoch + 1, iteration,
                     self.compiles)


def _has_compile_callbacks() -> bool:
    import importlib.util
    return importlib.util.find_spec("torch._dynamo.callback") is not None


def recompile_limit_hits() -> int:
    """How often dynamo gave up on a frame in this process because it reached its recompile limit."""
    from torch._dynamo.utils import counters
    return sum(count for reason, count in counters["unimplemented"].items()
               if "recompile limit" in reason.lower() or "recompile_limit" in reason)


def _recompile_limit() -> int:
    import torch._dynamo.config
    return torch._dynamo.config.recompile_limit


class _DynamoListener:
    """Registers with ``torch._dynamo.callback`` and forwards to a CompileStats while it lives."""

    def __init__(self, stats: CompileStats):
        from torch._dynamo.callback import callback_handler
        stats_ref = weakref.ref(stats)

        def on_start(args) -> None:
            target = stats_ref()
            if target is not None:
                target._on_start()

        def on_end(args) -> None:
            target = stats_ref()
            if target is not None:
                target._on_end(str(args.compile_id), args.callback_trigger.name.lower())

        self._handler, self._on_start, self._on_end = callback_handler, on_start, on_end
        self.ensure_registered()
        # The handler is process-wide: unregister when the stats are freed, or it would grow with every TrainLoop.
        weakref.finalize(stats, _unregister, callback_handler, on_start, on_end)

    def ensure_registered(self) -> None:
        if self._on_start not in self._handler.start_callbacks:
            self._handler.register_start_callback(self._on_start)
        if self._on_end not in self._handler.end_callbacks:
            self._handler.register_end_callback(self._on_end)


def _unregister(handler, on_start, on_end) -> None:
    if on_start in handler.start_callbacks:
        handler.remove_start_callback(on_start)
    if on_end in handler.end_callbacks:
        handler.remove_end_callback(on_end)
