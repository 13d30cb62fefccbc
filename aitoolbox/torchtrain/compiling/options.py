"""TrainLoop's ``torch_compile`` argument, checked and turned into :class:`CompileOptions`."""
import dataclasses
from typing import Any, Dict, Optional, Union

# What torch.compile itself accepts (handed through as they are).
TORCH_COMPILE_KEYS = ("backend", "mode", "fullgraph", "dynamic", "options", "disable")
# What TrainLoop adds.
TRAINLOOP_KEYS = ("fallback", "optimizer_step", "verify")
FALLBACKS = ("error", "eager")


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """How TrainLoop compiles: ``torch.compile`` keyword arguments plus what to do when compiling fails.

    Attributes:
        torch_kwargs: keyword arguments for ``torch.compile`` of the model's forward (``backend``, ``mode``,
            ``fullgraph``, ``dynamic``, ``options``, ``disable``).
        fallback: ``'error'`` (a model or optimizer step that cannot be compiled stops training with an error
            naming it) or ``'eager'`` (a warning, then it runs uncompiled).
        optimizer_step: compile each optimizer's ``step`` too (the larger part of the speed-up for MLPs).
        verify: compare the compiled forward's gradients with eager ones on the first training batch, and stop
            with an error naming the parameters that differ (see :mod:`~aitoolbox.torchtrain.compiling.verify`).
    """
    torch_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    fallback: str = "error"
    optimizer_step: bool = True
    verify: bool = True

    @property
    def optimizer_kwargs(self) -> Dict[str, Any]:
        """``torch.compile`` arguments for the optimizer steps: those of the model, except ``fullgraph`` (every
        torch optimizer's step has deliberate graph breaks around the update) and ``dynamic`` (parameter shapes
        never change)."""
        return {key: value for key, value in self.torch_kwargs.items() if key not in ("fullgraph", "dynamic")}

    @classmethod
    def from_argument(cls, torch_compile: Union[bool, dict, None]) -> Optional["CompileOptions"]:
        """The options ``TrainLoop(torch_compile=...)`` asks for, or None to train uncompiled.

        Raises:
            TypeError: ``torch_compile`` is neither a bool nor a dict, or a value has the wrong type.
            ValueError: a key or a ``fallback`` value is unknown.
        """
        if torch_compile is None or torch_compile is False:
            return None
        if torch_compile is True:
            return cls()
        if not isinstance(torch_compile, dict):
            raise TypeError(f"torch_compile must be False, True or a dict of torch.compile options (e.g. "
                            f"{{'backend': 'inductor', 'mode': 'max-autotune'}}), got {torch_compile!r}")
        unknown = sorted(set(torch_compile) - set(TORCH_COMPILE_KEYS) - set(TRAINLOOP_KEYS))
        if unknown:
            raise ValueError(f"torch_compile has unknown keys {unknown}: the valid keys are torch.compile's "
                             f"{list(TORCH_COMPILE_KEYS)} and TrainLoop's {list(TRAINLOOP_KEYS)}")
        fallback = torch_compile.get("fallback", "error")
        if fallback not in FALLBACKS:
            raise ValueError(f"torch_compile['fallback'] must be one of {list(FALLBACKS)} ('eager': warn and run "
                             f"uncompiled when compiling fails), got {fallback!r}")
        optimizer_step = torch_compile.get("optimizer_step", True)
        if not isinstance(optimizer_step, bool):
            raise TypeError(f"torch_compile['optimizer_step'] must be True or False, got {optimizer_step!r}")
        verify = torch_compile.get("verify", True)
        if not isinstance(verify, bool):
            raise TypeError(f"torch_compile['verify'] must be True or False, got {verify!r}")
        for key in ("fullgraph", "disable"):
            if key in torch_compile and not isinstance(torch_compile[key], bool):
                raise TypeError(f"torch_compile[{key!r}] must be True or False, got {torch_compile[key]!r}")
        if "options" in torch_compile and torch_compile["options"] is not None \
                and "mode" in torch_compile and torch_compile["mode"] is not None:
            raise ValueError("torch_compile may give 'mode' or 'options', not both (torch.compile refuses the pair)")
        torch_kwargs = {key: torch_compile[key] for key in TORCH_COMPILE_KEYS if key in torch_compile}
        return cls(torch_kwargs=torch_kwargs, fallback=fallback, optimizer_step=optimizer_step, verify=verify)
