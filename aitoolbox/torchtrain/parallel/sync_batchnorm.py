"""Batch normalisation whose statistics span every process, on CPUs (gloo) as well as GPUs.

torch's ``nn.SyncBatchNorm`` refuses CPU tensors in training, so :class:`SyncBatchNorm` carries its own
implementation (:class:`SyncBatchNormFunction`) and hands CUDA tensors on an NCCL group to torch's.

The arithmetic, per channel, over a global batch split unevenly across processes:

* forward: every process all-reduces ``[count, sum(x), sum(x**2)]`` (float64), normalises with the global
  mean and biased variance, and updates the running variance with the unbiased one (``n / (n - 1)``);
* backward: every process all-reduces ``[sum(dy), sum(dy * x_hat)]`` so the input gradient equals that of
  one BatchNorm over the global batch. The weight and bias gradients stay local (the sums over this
  process's samples): DistributedDataParallel then averages them like any other parameter gradient.
"""
import inspect
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm
# torch's own kernel-backed implementation (CUDA/NCCL only); private, but the module-level entry point
# that torch's nn.SyncBatchNorm itself calls.
from torch.nn.modules._functions import SyncBatchNorm as TorchSyncBatchNormFunction

# torch's BatchNorm layers take ``bias=`` (a weight without a bias) from torch 2.12 on.
_BATCH_NORM_TAKES_BIAS = "bias" in inspect.signature(_BatchNorm.__init__).parameters

_STATS_DTYPE = torch.float64


def _channel_shape(input: torch.Tensor) -> List[int]:
    """Shape that broadcasts a per-channel vector over ``(N, C, *)``."""
    return [1, input.size(1)] + [1] * (input.dim() - 2)


def _reduce_dims(input: torch.Tensor) -> List[int]:
    return [0] + list(range(2, input.dim()))


def _compute_dtype(input: torch.Tensor) -> torch.dtype:
    # float16 / bfloat16 inputs are normalised in float32, as torch's kernels do.
    return torch.promote_types(input.dtype, torch.float32)


class SyncBatchNormFunction(torch.autograd.Function):
    """Batch normalisation over the union of every process's batch, with an explicit backward.

    ``input`` is ``(N, C, *)``; ``N`` may differ between processes and may be 0. Every process of
    ``process_group`` must call forward and backward the same number of times (each holds collectives).
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor], eps: float,
                momentum: float, process_group) -> torch.Tensor:
        channels = input.size(1)
        dims = _reduce_dims(input)
        x = input.to(_STATS_DTYPE)
        # One collective for all three statistics. float64 keeps E[x^2] - E[x]^2 accurate for float32 data.
        stats = torch.cat([x.sum(dims), (x * x).sum(dims),
                           torch.full((1,), input.numel() // max(channels, 1), dtype=_STATS_DTYPE,
                                      device=input.device)])
        dist.all_reduce(stats, group=process_group)
        count = int(stats[-1].item())
        if count <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got {count} over all "
                             f"processes (input of shape {tuple(input.shape)} on this one)")
        mean = stats[:channels] / count
        var = (stats[channels:2 * channels] / count - mean * mean).clamp_(min=0)
        invstd = torch.rsqrt(var + eps)

        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = var * (count / (count - 1))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)

        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.process_group = process_group
        ctx.count = count
        ctx.bias_dtype = None if bias is None else bias.dtype
        x_hat = _normalize(input, mean, invstd)
        return _affine(x_hat, weight, bias).to(input.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        input, weight, mean, invstd = ctx.saved_tensors
        dims = _reduce_dims(input)
        channels = input.size(1)
        shape = _channel_shape(input)
        grad = grad_output.to(_compute_dtype(input))
        x_hat = _normalize(input, mean, invstd)
        sum_dy = grad.sum(dims, dtype=_STATS_DTYPE)
        sum_dy_xhat = (grad * x_hat).sum(dims, dtype=_STATS_DTYPE)

        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(ctx.bias_dtype)
        # Every process makes the same decision here (the graph is the same), so the collective matches up.
        if ctx.needs_input_grad[0]:
            sums = torch.cat([sum_dy, sum_dy_xhat])
            dist.all_reduce(sums, group=ctx.process_group)
            mean_dy = (sums[:channels] / ctx.count).to(grad.dtype).view(shape)
            mean_dy_xhat = (sums[channels:] / ctx.count).to(grad.dtype).view(shape)
            scale = invstd if weight is None else invstd * weight.to(_STATS_DTYPE)
            grad_input = (grad - mean_dy - x_hat * mean_dy_xhat) * scale.to(grad.dtype).view(shape)
            grad_input = grad_input.to(input.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def _normalize(input: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor) -> torch.Tensor:
    dtype = _compute_dtype(input)
    shape = _channel_shape(input)
    return (input.to(dtype) - mean.to(dtype).view(shape)) * invstd.to(dtype).view(shape)


def _affine(x_hat: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> torch.Tensor:
    shape = _channel_shape(x_hat)
    if weight is not None:
        x_hat = x_hat * weight.to(x_hat.dtype).view(shape)
    if bias is not None:
        x_hat = x_hat + bias.to(x_hat.dtype).view(shape)
    return x_hat


class SyncBatchNorm(_BatchNorm):
    """``apex.parallel.SyncBatchNorm``: BatchNorm whose batch statistics span all processes of a group.

    In training, with a process group of more than one process, the mean and variance are those of the
    global batch (ranks may hold different numbers of samples, even none) and the input gradient is that
    of a BatchNorm over the global batch. In eval mode, or without an initialised process group of more
    than one process, it is a plain BatchNorm. CUDA tensors on an NCCL group run torch's
    ``nn.SyncBatchNorm`` kernels; everything else (CPU over gloo) runs :class:`SyncBatchNormFunction`.

    Args:
        num_features: the number of channels ``C``.
        eps: added to the variance for numerical stability.
        momentum: weight of the newest batch in the running statistics; None for a cumulative average.
        affine: learn a per-channel weight and bias.
        track_running_stats: keep running mean and variance (used in eval mode).
        process_group: the group to synchronise over; None for the default (whole world) group.
        channel_last: inputs are ``(N, *, C)`` (apex's channel-last layout) instead of ``(N, C, *)``.
        fuse_relu: apply ReLU to the output (after adding ``z`` when given).
        bias: learn a bias (with ``affine=True``); keyword only, as in torch.
        device: where to create parameters and buffers.
        dtype: their dtype.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group=None, channel_last: bool = False,
                 fuse_relu: bool = False, *, bias: bool = True, device=None, dtype=None):
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features <= 0:
            raise ValueError(f"num_features must be a positive int (the number of channels), got {num_features!r}")
        if momentum is not None and not 0.0 <= momentum <= 1.0:
            raise ValueError(f"momentum must be in [0, 1] or None (cumulative average), got {momentum!r}")
        if _BATCH_NORM_TAKES_BIAS:
            super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype,
                             bias=bias)
        else:  # torch before 2.12: a BatchNorm always has a bias with its weight
            super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
            if affine and not bias:
                self.register_parameter("bias", None)
        self.process_group = process_group
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, channel_last={self.channel_last}, fuse_relu={self.fuse_relu}"

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input with at least 2 dimensions (N, C, *), got {input.dim()}D "
                             f"of shape {tuple(input.shape)}")
        if input.size(1) != self.num_features:
            layout = "(N, *, C)" if self.channel_last else "(N, C, *)"
            raise ValueError(f"expected {self.num_features} channels in an input laid out as {layout}, got "
                             f"shape {tuple(input.shape)}")

    def _sync_group(self):
        """The process group to synchronise over, or None when plain BatchNorm gives the same result."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    def forward(self, input: torch.Tensor, z: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Normalise ``input``; ``z`` (same shape as the output) is added afterwards, as in apex."""
        x = input.movedim(-1, 1) if self.channel_last and input.dim() > 2 else input
        self._check_input_dim(x)

        # Running statistics and momentum follow torch's _BatchNorm exactly (cumulative average for None).
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        use_buffers = not self.training or self.track_running_stats
        running_mean = self.running_mean if use_buffers else None
        running_var = self.running_var if use_buffers else None

        group = self._sync_group() if self.training else None
        if group is None:
            out = F.batch_norm(x, running_mean, running_var, self.weight, self.bias, bn_training, factor, self.eps)
        elif x.is_cuda and dist.get_backend(group) == dist.Backend.NCCL:
            out = TorchSyncBatchNormFunction.apply(x, self.weight, self.bias, running_mean, running_var, self.eps,
                                                   factor, group, dist.get_world_size(group))
        else:
            out = SyncBatchNormFunction.apply(x, self.weight, self.bias, running_mean, running_var, self.eps,
                                              factor, group)

        if x is not input:
            out = out.movedim(1, -1)
        if z is not None:
            out = out + z
        return F.relu(out) if self.fuse_relu else out


def convert_syncbn_model(module: nn.Module, process_group=None, channel_last: bool = False) -> nn.Module:
    """Replace every BatchNorm layer in ``module`` (recursively) by a :class:`SyncBatchNorm`.

    Any ``_BatchNorm`` is converted: ``BatchNorm1d/2d/3d``, torch's ``SyncBatchNorm`` and this module's own
    (to change its process group). The new layers hold the same parameter and buffer tensors as the old
    ones (values, devices, dtypes and ``requires_grad`` carry over, and an optimizer built before the
    conversion keeps stepping them) and the same training / eval mode.

    Args:
        module: a model, or a single BatchNorm layer.
        process_group: the group the new layers synchronise over; None for the whole world.
        channel_last: the new layers take ``(N, *, C)`` inputs.

    Returns:
        ``module`` with its BatchNorm children replaced, or a new :class:`SyncBatchNorm` when ``module``
        itself is a BatchNorm layer.

    Raises:
        ValueError: a lazy BatchNorm has not yet seen an input (its size is unknown).
    """
    converted = module
    if isinstance(module, _BatchNorm):
        if isinstance(module.weight, nn.parameter.UninitializedParameter) or \
                isinstance(module.running_mean, nn.parameter.UninitializedBuffer):
            raise ValueError(f"cannot convert the uninitialised lazy layer {module!r}: run one forward pass "
                             "first so it knows its number of features")
        converted = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                  module.track_running_stats, process_group=process_group,
                                  channel_last=channel_last, fuse_relu=getattr(module, "fuse_relu", False),
                                  bias=module.bias is not None)
        # Assigning the tensors themselves (not copies) keeps device, dtype, requires_grad and optimizer links.
        converted.weight = module.weight
        converted.bias = module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
        if hasattr(module, "qconfig"):
            converted.qconfig = module.qconfig
    for name, child in module.named_children():
        converted.add_module(name, convert_syncbn_model(child, process_group, channel_last))
    return converted
