"""Counting the FLOPs of one training batch: the model's and the hardware's, by the math that runs them.

:class:`BatchFlopCounter` counts with ``torch.utils.flop_counter.FlopCounterMode`` (matrix multiplications,
convolutions and attention, ``2 * m * n * k`` for an ``(m, k) @ (k, n)`` product; element-wise operations count
nothing), and sorts every counted operation as it runs:

* **forward** (outside the autograd engine) and **backward** (the engine running the gradients): the *model FLOPs*,
  the forward and backward of the batch counted once;
* **recomputation**: operations the engine runs with gradients enabled, which is what activation checkpointing
  does when it runs a segment's forward again during the backward (a backward with ``create_graph=True`` looks the
  same and is counted here too). With the model FLOPs these are the *hardware FLOPs*;
* paused spans (the optimizer steps: an optimizer whose step multiplies matrices, such as Muon, does work that is
  not the model's) are not counted at all.

Each operation's FLOPs are also filed under the precision its math ran in
(:func:`~aitoolbox.torchtrain.callbacks.peak_flops.math_precision`): the dtype of its inputs, and for float32 on a
CUDA device TF32 where torch allows it for that kind of operation (``cudnn.allow_tf32`` for convolutions, on by
default; ``cuda.matmul.allow_tf32`` for matrix multiplications, off by default), so that MFU can divide each part by
the peak of the math that ran it.
"""
import dataclasses
from typing import Any, Dict, Optional

import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from aitoolbox.torchtrain.callbacks.peak_flops import math_precision

_CONVOLUTIONS = {"convolution", "_convolution", "cudnn_convolution", "convolution_overrideable",
                 "_slow_conv2d_forward", "convolution_backward"}


@dataclasses.dataclass
class BatchFlops:
    """FLOPs counted over one training batch.

    Attributes:
        model: forward and backward, each counted once.
        hardware: ``model`` plus what activation checkpointing recomputed.
        model_by_precision: ``model`` split by the precision its math ran in (``'fp32'``, ``'tf32'``, ``'bf16'``,
            ``'fp16'``, ``'fp64'``, ... see :func:`~aitoolbox.torchtrain.callbacks.peak_flops.math_precision`).
        hardware_by_precision: the same for ``hardware``.
    """

    model: float = 0.0
    hardware: float = 0.0
    model_by_precision: Dict[str, float] = dataclasses.field(default_factory=dict)
    hardware_by_precision: Dict[str, float] = dataclasses.field(default_factory=dict)

    def scaled(self, factor: float) -> "BatchFlops":
        """The same counts times ``factor`` (a batch of another size)."""
        return BatchFlops(self.model * factor, self.hardware * factor,
                          {key: value * factor for key, value in self.model_by_precision.items()},
                          {key: value * factor for key, value in self.hardware_by_precision.items()})

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_state(cls, state: Optional[dict]) -> Optional["BatchFlops"]:
        if not state:
            return None
        return cls(float(state["model"]), float(state["hardware"]), dict(state["model_by_precision"]),
                   dict(state["hardware_by_precision"]))


class BatchFlopCounter:
    """Counts one batch's FLOPs (see the module's description): :meth:`start` before its forward, :meth:`pause` and
    :meth:`resume` around what must not count, :meth:`stop` for the :class:`BatchFlops`. Computes exactly what the
    batch computes without it."""

    def __init__(self):
        self.flops = BatchFlops()
        self._paused = False
        self._mode: Optional[FlopCounterMode] = None

    def start(self) -> None:
        registry = getattr(flop_counter, "flop_registry", {})
        self._mode = FlopCounterMode(display=False, custom_mapping={
            operation: self._sorting(operation, formula) for operation, formula in registry.items()})
        self._mode.__enter__()

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused = False

    def stop(self) -> BatchFlops:
        """Leave the counting mode (safe to call when it is not active) and return the counts."""
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)
        return self.flops

    def _sorting(self, operation: Any, formula: Any) -> Any:
        name = getattr(operation, "__name__", str(operation))
        kind = "conv" if name in _CONVOLUTIONS else "matmul"

        def count(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
            flops = formula(*args, out_val=out_val, **kwargs)
            if not self._paused and flops:
                self._file(kind, flops, args)
            return flops

        count._get_raw = True  # the registry's formulas already take the raw arguments
        return count

    def _file(self, kind: str, flops: int, args: tuple) -> None:
        tensor = next((arg for arg in args if isinstance(arg, torch.Tensor)), None)
        precision = "fp32" if tensor is None else math_precision(kind, tensor.dtype, tensor.device.type)
        counts = self.flops
        counts.hardware += flops
        counts.hardware_by_precision[precision] = counts.hardware_by_precision.get(precision, 0) + flops
        # In the engine with gradients on: a checkpointed segment's forward run again (hardware work only).
        if torch._C._current_graph_task_id() != -1 and torch.is_grad_enabled():
            return
        counts.model += flops
        counts.model_by_precision[precision] = counts.model_by_precision.get(precision, 0) + flops
