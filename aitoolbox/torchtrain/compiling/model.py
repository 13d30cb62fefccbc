"""Compiling a model in place: ``model(x)`` runs compiled, and the model stays the user's own object.

``torch.compile(model)`` returns a wrapper whose ``state_dict`` keys carry ``_orig_mod.``, which breaks loading
checkpoints into the plain model. ``nn.Module.compile()`` keeps the object, but in torch 2.13 it compiles
nothing for a module whose ``forward`` is torch's own (``nn.Sequential``, a ``ModelWrap``-ed torchvision
model): dynamo skips frames in torch's files, and ``Module._call_impl`` is one. So we do what
``torch.compile(model)`` does inside, on the model itself: compile a small function of ours that calls the
module (a frame dynamo traces, with the module's hooks inlined) and install it where ``nn.Module.compile``
does, as the module's compiled call. ``model(x)`` then runs the compiled graph; the parameters, buffers and
``state_dict`` are the model's own, so a checkpoint of a compiled run loads into an uncompiled model and the
other way round.
"""
import logging
import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn

from aitoolbox.torchtrain.compiling.options import CompileOptions
from aitoolbox.torchtrain.compiling.stats import CompileStats

logger = logging.getLogger(__name__)


def compile_failure_types() -> tuple:
    """The exceptions by which torch.compile reports that it could not compile (as opposed to the user's code
    failing when run): dynamo's own (``Unsupported`` on a graph break under ``fullgraph=True``,
    ``BackendCompilerFailed``, ...)."""
    from torch._dynamo.exc import TorchDynamoException
    return (TorchDynamoException,)


class CompiledModelCall:
    """The module's compiled call: the compiled graph, or on a compile failure a clear error or eager execution.

    Installed as the module's ``_compiled_call_impl`` (the attribute ``nn.Module.compile`` sets and
    ``nn.Module.__call__`` consults). ``nn.Module`` drops it when pickled or deep-copied, so a model sent to
    other processes arrives uncompiled and is compiled there again.

    Args:
        module: the model to compile.
        options: TrainLoop's compile options.
        stats: records the compilations.
    """

    def __init__(self, module: nn.Module, options: CompileOptions, stats: CompileStats):
        self.options = options
        self.module_name = type(module).__name__
        self.label = f"the forward of {self.module_name}"
        self.stats = stats
        self.eager_only = False
        self.calls = 0
        self.compiles = 0  # compilations while this call ran (CompileStats counts them here)
        # dynamic=None (torch's automatic dynamic shapes) compiles a static graph for the first batch size and a
        # dynamic one when another size (the smaller last batch) comes: which graph serves a batch then depends
        # on the order the process met the sizes, and the two may round differently, so a run resumed in a new
        # process would not be bitwise the same. Marking the batch dimension dynamic from the first call makes
        # one graph serve every batch size (sizes 0 and 1 excepted: torch specializes them), whatever the order.
        # Only a dimension 0 that holds the training loader's batch size is marked (a sequence-first input's
        # dimension 0 is its length, which stays static); an explicit 'dynamic' option leaves it all to torch.
        self._mark_batch_dynamic = options.torch_kwargs.get("dynamic") is None
        self.batch_size: Optional[int] = None  # set by the Compiler from the training loader
        # The uncompiled call (forward with its hooks), as nn.Module.__call__ runs it when nothing is compiled.
        self._eager_call: Callable = module._call_impl
        self._compiled: Callable = torch.compile(_traceable_call(self._eager_call, self.module_name),
                                                 **options.torch_kwargs)

    def __repr__(self) -> str:
        state = "eager after a compile failure" if self.eager_only else "compiled"
        return f"CompiledModelCall({self.module_name}, {state}, options={self.options.torch_kwargs})"

    def __call__(self, *args, **kwargs) -> Any:
        self.calls += 1
        if self.eager_only:
            return self._eager_call(*args, **kwargs)
        if self._mark_batch_dynamic and self.batch_size is not None:
            mark_batch_dimension_dynamic(args, kwargs, self.batch_size)
        self.stats.caller = self
        try:
            with self.stats:
                return self._compiled(*args, **kwargs)
        except compile_failure_types() as failure:
            self._handle_failure(failure)
            return self._eager_call(*args, **kwargs)

    def _handle_failure(self, failure: Exception) -> None:
        reason = first_line(failure)
        if self.options.fallback != "eager":
            raise RuntimeError(
                f"torch.compile could not compile the forward of {self.module_name} (TrainLoop torch_compile="
                f"{self.options.torch_kwargs or True}): {reason}\nMake the forward compilable (with "
                f"'fullgraph': True every graph break is an error; TORCH_LOGS=graph_breaks lists them), or pass "
                f"torch_compile={{'fallback': 'eager'}} to train it uncompiled.") from failure
        warnings.warn(f"torch.compile could not compile the forward of {self.module_name}: {reason}. It runs "
                      f"uncompiled (torch_compile 'fallback': 'eager').", RuntimeWarning, stacklevel=2)
        self.eager_only = True


def mark_batch_dimension_dynamic(args: tuple, kwargs: dict, batch_size: int) -> None:
    """Mark dimension 0 of the tensors a forward is called with as dynamic where it holds the batch (its size is
    the loader's ``batch_size``), without insisting: a dimension the graph needs constant stays constant."""
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.size(0) == batch_size:
            torch._dynamo.maybe_mark_dynamic(value, 0)


def _traceable_call(call: Callable, module_name: str) -> Callable:
    """A function of this package calling ``call``: dynamo traces it (and inlines nn.Module's call, hooks and all)
    where it would skip torch's own ``Module._call_impl`` as the top frame."""
    def call_module(*args, **kwargs):
        return call(*args, **kwargs)
    # Dynamo keeps compiled graphs per code object and counts all graphs kept there, those of freed models too,
    # against torch._dynamo.config.recompile_limit (8). With one code object shared by every compiled model, the
    # TrainLoops built before in the process (a notebook cell run again) would use up this model's budget, and
    # a model with hooks (amp's input casts) needs graphs of its own: each model gets its own code object, freed
    # with it. The name shows in torch's logs ("compiled_call_of_MyNet").
    call_module.__code__ = call_module.__code__.replace(co_name=f"compiled_call_of_{module_name}",
                                                        co_qualname=f"compiled_call_of_{module_name}")
    return call_module


def compile_in_place(module: nn.Module, options: CompileOptions, stats: CompileStats) -> CompiledModelCall:
    """Make ``module(...)`` run compiled, keeping ``module`` the same object (see the module docstring).

    Idempotent for the same options: a module already compiled by TrainLoop keeps its compiled call (and the
    graphs compiled so far). A module the user compiled with ``module.compile()`` is compiled again by TrainLoop
    (its ``nn.Module.compile`` graph would miss forwards that are torch's own).
    """
    current = compiled_call_of(module)
    if current is not None and current.options == options:
        return current
    if getattr(module, "_compiled_call_impl", None) is not None and current is None:
        logger.info("%s was compiled with nn.Module.compile(); TrainLoop compiles it again with torch_compile=%s",
                    type(module).__name__, options.torch_kwargs or True)
    compiled = CompiledModelCall(module, options, stats)
    module._compiled_call_impl = compiled
    return compiled


def compiled_call_of(module: nn.Module) -> Optional[CompiledModelCall]:
    """The TrainLoop compiled call installed on ``module``, or None."""
    current = getattr(module, "_compiled_call_impl", None)
    return current if isinstance(current, CompiledModelCall) else None


def first_line(error: BaseException) -> str:
    """The gist of a compile failure: the first line of its message (dynamo's run to dozens of lines of hints),
    and for a failing backend the backend's own error."""
    text = str(error).strip()
    gist = f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
    inner = getattr(error, "inner_exception", None)  # BackendCompilerFailed: what the backend raised
    if inner is not None:
        inner_text = str(inner).strip()
        gist += f" {type(inner).__name__}: {inner_text.splitlines()[0] if inner_text else ''}"
    return gist
