"""apex.parallel.DistributedDataParallel's arguments, run by torch's DistributedDataParallel.

How each apex argument maps onto torch:

* ``message_size`` (elements per bucket) becomes ``bucket_cap_mb = message_size * element size / 2**20``,
  the element size being that of the first trainable parameter's dtype (torch counts bytes, apex counted
  elements).
* ``delay_allreduce=True`` becomes one bucket large enough for every trainable parameter, so a single
  all-reduce runs once backward has produced all gradients. (``no_sync`` is not the equivalent: it skips
  the reduction altogether and leaves it to a later backward pass.)
* ``gradient_average``, ``gradient_predivide_factor`` and ``allreduce_always_fp32`` become a DDP
  communication hook, :func:`apex_allreduce_hook`: divide by the predivide factor before the all-reduce and
  by ``world_size / predivide`` after it, in float32 when asked.
* ``shared_param`` is rejected, as apex rejected it: torch's DDP handles shared parameters itself.
* ``num_allreduce_streams``, ``allreduce_communicators``, ``retain_allreduce_buffers``,
  ``allreduce_trigger_params`` and ``prof`` are accepted and ignored, with a warning when not left at
  their defaults: torch schedules its own communication and keeps no flat buffers or trigger parameters.
"""
import logging
import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

_MIB = 1024 * 1024
DEFAULT_MESSAGE_SIZE = 10_000_000


@dataclass(frozen=True)
class GradientReduction:
    """What :func:`apex_allreduce_hook` needs to know to reduce one bucket the way apex did.

    Attributes:
        process_group: the group the gradients are reduced over (None: the default group).
        world_size: the number of processes in that group.
        gradient_average: divide the sum by the world size (after undoing the predivision).
        gradient_predivide_factor: divide by this before the all-reduce, by ``world_size / factor`` after.
        allreduce_always_fp32: reduce float16 / bfloat16 gradients in float32.
    """

    process_group: Optional[Any]
    world_size: int
    gradient_average: bool = True
    gradient_predivide_factor: float = 1.0
    allreduce_always_fp32: bool = False


def apex_allreduce_hook(state: GradientReduction, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook with apex's arithmetic: predivide, sum over processes, postdivide.

    With ``gradient_average=False`` nothing is divided after the sum, so the result is
    ``sum / gradient_predivide_factor``, exactly as in apex.
    """
    buffer = bucket.buffer()
    # Summing many low-precision gradients in their own dtype loses bits (float16 may even overflow);
    # float64 buffers are never narrowed.
    upcast = state.allreduce_always_fp32 and buffer.dtype in (torch.float16, torch.bfloat16)
    to_reduce = buffer.float() if upcast else buffer
    if state.gradient_predivide_factor != 1.0:
        to_reduce.div_(state.gradient_predivide_factor)
    work = dist.all_reduce(to_reduce, group=state.process_group, async_op=True)

    def finish(future: torch.futures.Future) -> torch.Tensor:
        reduced = future.value()[0]
        if state.gradient_average:
            reduced.div_(state.world_size / state.gradient_predivide_factor)
        if reduced.dtype != buffer.dtype:
            buffer.copy_(reduced)
            return buffer
        return reduced

    return work.get_future().then(finish)


def _trainable(module: nn.Module) -> Iterable[nn.Parameter]:
    return (p for p in module.parameters() if p.requires_grad)


def _bucket_cap_mb(module: nn.Module, message_size: int, delay_allreduce: bool) -> float:
    """torch's bucket size in MiB for apex's ``message_size`` (elements) or ``delay_allreduce``."""
    params = list(_trainable(module))
    if delay_allreduce:
        total_bytes = sum(p.numel() * p.element_size() for p in params)
        # One MiB of head room: torch compares the running bucket size against the cap.
        return float(math.ceil(total_bytes / _MIB) + 1)
    element_size = params[0].element_size() if params else 4
    return message_size * element_size / _MIB


def _check_positive(name: str, value: Any, integer: bool = False) -> None:
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
        expected = "a positive int" if integer else "a positive number"
        raise ValueError(f"{name} must be {expected}, got {value!r}")


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """``apex.parallel.DistributedDataParallel`` as a subclass of torch's DistributedDataParallel.

    Replace ``from apex.parallel import DistributedDataParallel`` with
    ``from aitoolbox.torchtrain.parallel import DistributedDataParallel``. The module keeps every torch DDP
    feature (``no_sync``, ``join``, ``register_comm_hook``, ``.module``); see this module's docstring for
    how each apex argument maps onto torch.

    Like apex, a module on a GPU runs on that GPU (the current device, in apex's usual
    ``torch.cuda.set_device`` then ``.cuda()`` flow) unless ``device_ids`` says otherwise; a CPU module runs
    over gloo with no device ids.

    Averaging: with the default arguments torch's built-in reduction averages the gradients (it divides
    before summing, apex divided after: the same mean up to rounding), which leaves
    ``register_comm_hook`` free for the caller. A non-default ``gradient_average``,
    ``gradient_predivide_factor`` or ``allreduce_always_fp32`` registers :func:`apex_allreduce_hook`.

    Args:
        module: the model, already on its device (and already through ``amp.initialize`` if used).
        message_size: the bucket size in elements (apex's unit), converted to torch's ``bucket_cap_mb``.
        delay_allreduce: reduce all gradients at once after backward instead of overlapping with it.
        shared_param: removed in apex; must be None.
        allreduce_trigger_params: accepted for compatibility; no torch equivalent (warns if set).
        retain_allreduce_buffers: accepted for compatibility; no torch equivalent (warns if set).
        allreduce_always_fp32: reduce float16 / bfloat16 gradients in float32, then cast back.
        num_allreduce_streams: accepted for compatibility; no torch equivalent (warns if not 1).
        allreduce_communicators: accepted for compatibility; no torch equivalent (warns if set).
        gradient_average: divide the summed gradients by the world size (False: keep the sum, divided by
            ``gradient_predivide_factor`` as in apex).
        gradient_predivide_factor: divide gradients by this before the all-reduce and by
            ``world_size / gradient_predivide_factor`` after, to keep float16 sums in range.
        gradient_average_split_factor: apex's deprecated name for ``gradient_predivide_factor``.
        prof: accepted for compatibility; no torch equivalent (warns if set).
        **torch_ddp_kwargs: passed to torch's DistributedDataParallel (``device_ids``, ``process_group``,
            ``find_unused_parameters``, ``bucket_cap_mb``, ...).

    Raises:
        ValueError: ``shared_param`` is set, a size or factor is not positive, or ``bucket_cap_mb`` is
            given together with a non-default ``message_size`` or ``delay_allreduce=True``.
    """

    def __init__(self, module: nn.Module, message_size: int = DEFAULT_MESSAGE_SIZE, delay_allreduce: bool = False,
                 shared_param: Any = None, allreduce_trigger_params: Optional[Iterable[nn.Parameter]] = None,
                 retain_allreduce_buffers: bool = False, allreduce_always_fp32: bool = False,
                 num_allreduce_streams: int = 1, allreduce_communicators: Any = None,
                 gradient_average: bool = True, gradient_predivide_factor: float = 1.0,
                 gradient_average_split_factor: Optional[float] = None, prof: bool = False,
                 **torch_ddp_kwargs: Any):
        if shared_param is not None:
            raise ValueError(
                f"shared_param={shared_param!r}: this argument was removed from apex's DistributedDataParallel "
                "and is not supported. Leave it None: torch's DistributedDataParallel handles parameters "
                "shared between layers by itself.")
        if gradient_average_split_factor is not None:
            warnings.warn("gradient_average_split_factor is deprecated (as in apex); use gradient_predivide_factor",
                          DeprecationWarning, stacklevel=2)
            gradient_predivide_factor = gradient_average_split_factor
        _check_positive("message_size", message_size, integer=True)
        _check_positive("gradient_predivide_factor", gradient_predivide_factor)
        _warn_unsupported(allreduce_trigger_params=(allreduce_trigger_params, None),
                          retain_allreduce_buffers=(retain_allreduce_buffers, False),
                          num_allreduce_streams=(num_allreduce_streams, 1),
                          allreduce_communicators=(allreduce_communicators, None),
                          prof=(prof, False))

        if "bucket_cap_mb" in torch_ddp_kwargs:
            if message_size != DEFAULT_MESSAGE_SIZE or delay_allreduce:
                raise ValueError(
                    f"bucket_cap_mb={torch_ddp_kwargs['bucket_cap_mb']!r} conflicts with message_size="
                    f"{message_size!r} / delay_allreduce={delay_allreduce!r}: both set the bucket size; give one")
        else:
            torch_ddp_kwargs["bucket_cap_mb"] = _bucket_cap_mb(module, message_size, delay_allreduce)
        first_param = next(module.parameters(), None)
        if "device_ids" not in torch_ddp_kwargs and first_param is not None and first_param.is_cuda:
            # apex used the device the module is on (the current one after torch.cuda.set_device); torch
            # needs to be told, and refuses device ids for a CPU module.
            index = first_param.device.index
            torch_ddp_kwargs["device_ids"] = [torch.cuda.current_device() if index is None else index]

        super().__init__(module, **torch_ddp_kwargs)

        self.message_size = message_size
        self.delay_allreduce = delay_allreduce
        self.allreduce_always_fp32 = allreduce_always_fp32
        self.gradient_average = gradient_average
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.gradient_reduction = None
        if not gradient_average or gradient_predivide_factor != 1.0 or allreduce_always_fp32:
            self.gradient_reduction = GradientReduction(
                process_group=self.process_group, world_size=dist.get_world_size(self.process_group),
                gradient_average=gradient_average, gradient_predivide_factor=self.gradient_predivide_factor,
                allreduce_always_fp32=allreduce_always_fp32)
            self.register_comm_hook(self.gradient_reduction, apex_allreduce_hook)
        logger.debug("apex DistributedDataParallel on torch DDP: bucket_cap_mb=%s, hook=%s",
                     torch_ddp_kwargs["bucket_cap_mb"], self.gradient_reduction)


def _warn_unsupported(**options: Any) -> None:
    """Warn for each apex option (``name=(value, default)``) that differs from its default."""
    for name, (value, default) in options.items():
        changed = value is not None if default is None else value != default
        if changed:
            warnings.warn(f"{name}={value!r} has no equivalent in torch's DistributedDataParallel and is ignored",
                          UserWarning, stacklevel=3)
