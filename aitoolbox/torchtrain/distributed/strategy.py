"""Distribution strategies: what TrainLoop asks of the device layout at a few fixed points.

The loop calls a strategy to place the model (``place_model``, then ``wrap_model`` once mixed precision
has prepared it), to prepare the data loaders
(``setup_loader``), at the start of each epoch (``on_epoch_begin``), to combine numbers across processes
(``all_reduce_sum``, ``all_gather_objects``), around micro-batches that only accumulate gradients
(``skip_gradient_sync``) and to know whether it should write or print
(``is_main_process``). It never asks which strategy it has.
"""
import contextlib
import warnings
from typing import Any, ContextManager, Iterator, List, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.distributed.dispatch import MethodDispatcher, ParallelModelRunner


class SingleDeviceStrategy:
    """Train in this process on one device: a CUDA GPU, or the CPU.

    Args:
        device: where the model and the loss run.
    """

    world_size = 1
    rank = 0
    is_distributed = False
    shards_parameters = False  # FSDP: each process holds only a shard of the parameters
    stops_mid_epoch = True  # a stop request ends the epoch at once (see DistributedStrategy)

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._no_sync_needed = contextlib.nullcontext()  # reused: the loop enters it for every batch

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device})"

    @property
    def is_main_process(self) -> bool:
        """Only the main process prints, saves files and shows progress bars."""
        return self.rank == 0

    def configure(self, dp_model_args: Optional[dict] = None) -> None:
        """Options ``fit`` passes through (aitoolbox 1.x's ``dp_model_args``); a single device has none to use."""

    def place_model(self, model: nn.Module) -> None:
        """Move the model to this process's device (before mixed precision prepares it)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        model.to(self.device)

    def wrap_model(self, model: nn.Module) -> Any:
        """Return what the loop calls ``get_loss`` on: the model itself, or a parallel wrapper around it."""
        return model

    def wrap_model_and_optimizers(self, model: nn.Module, optimizers: List[torch.optim.Optimizer]) -> Any:
        """:meth:`wrap_model`, for strategies that also adapt the optimizers (FSDP re-points them at the sharded
        parameters)."""
        return self.wrap_model(model)

    def set_mixed_precision(self, policy: Any) -> None:
        """A sharding strategy's mixed-precision policy; the others take mixed precision from autocast alone.

        Raises:
            ValueError: a policy is given to a strategy that does not shard.
        """
        if policy is not None:
            raise ValueError(f"{type(self).__name__} takes no mixed-precision policy")

    def evaluation_context(self) -> ContextManager:
        """The context of a whole evaluation or prediction pass (FSDP gathers the parameters once for it)."""
        return self._no_sync_needed

    def model_state_dict(self, model: nn.Module) -> dict:
        """The model's state dict for a checkpoint (FSDP gathers the full one to rank 0; every rank calls this)."""
        return model.state_dict()

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's state dict for a checkpoint (every rank calls this)."""
        return optimizer.state_dict()

    def load_model_state_dict(self, model: nn.Module, state_dict: dict) -> None:
        """Load a checkpoint's model state dict."""
        model.load_state_dict(state_dict)

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load a checkpoint's optimizer state dict: index keyed (``optimizer.state_dict()``), or keyed by parameter
        name (written by a sharded run)."""
        optimizer.load_state_dict(index_keyed_optimizer_state(model, optimizer, state) if _keyed_by_name(state)
                                  else state)

    def skip_gradient_sync(self, accumulating: bool) -> ContextManager:
        """The context of a micro-batch's forward and backward: where gradients are all-reduced by the backward
        (DDP), a micro-batch that only accumulates skips that communication; the window's last batch reduces the
        sum of them all. A single device has nothing to skip."""
        return self._no_sync_needed

    def sync_skipped_gradients(self) -> None:
        """Reduce gradients that every backward since the last step accumulated under ``skip_gradient_sync``
        (an epoch of unknown length ended inside an accumulation window). Nothing to do on a single device."""

    def setup_criterion(self, criterion: Optional[nn.Module]) -> Optional[nn.Module]:
        """Move a criterion module (it may hold class weights) to the device."""
        if isinstance(criterion, nn.Module):
            criterion.to(self.device)
        return criterion

    def setup_loader(self, loader: Optional[DataLoader], shuffle: Optional[bool] = None) -> Optional[DataLoader]:
        """Return the training loader this process iterates (all of it, for a single process)."""
        return loader

    def setup_eval_loader(self, loader: Optional[DataLoader]) -> Optional[DataLoader]:
        """Return the evaluation loader this process iterates (all of it, for a single process)."""
        return loader

    def on_epoch_begin(self, epoch: int, loader: Optional[DataLoader] = None) -> None:
        """Hook for per-epoch state such as a distributed sampler's epoch."""

    def agreed_batches(self, batches: Iterator[Any], loader: Any) -> Iterator[Any]:
        """The epoch's ``batches`` of the training ``loader``, checked (where several processes train) to be as many
        in every process; a single process has nothing to agree on."""
        return batches

    def any_process(self, flag: bool) -> bool:
        """True if ``flag`` is True in any process (so that all processes decide alike)."""
        return flag

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over all processes (identity for one process)."""
        return tensor

    def all_gather_objects(self, obj: Any) -> List[Any]:
        """Collect one picklable object from every process, ordered by rank."""
        return [obj]

    def broadcast_object(self, obj: Any) -> Any:
        """Return the main process's value of ``obj`` in every process."""
        return obj

    def barrier(self) -> None:
        """Wait for every process (nothing to wait for here)."""


def index_keyed_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """A name-keyed optimizer state dict turned into ``optimizer.load_state_dict``'s form (parameters numbered
    in the order of ``optimizer``'s parameter groups).

    Raises:
        ValueError: the state names parameters the optimizer does not hold.
    """
    name_of = {id(param): name for name, param in model.named_parameters()}
    names = [name_of.get(id(param)) for group in optimizer.param_groups for param in group["params"]]
    index_of = {name: index for index, name in enumerate(names) if name is not None}
    unknown = sorted({name for group in state["param_groups"] for name in group["params"]} - set(index_of))
    if unknown:
        raise ValueError(f"the optimizer state names parameters {unknown[:5]} that this {type(optimizer).__name__} "
                         "does not hold: the checkpoint is of another model or optimizer")
    return {"state": {index_of[name]: value for name, value in state["state"].items()},
            "param_groups": [dict(group, params=[index_of[name] for name in group["params"]])
                             for group in state["param_groups"]]}


def _keyed_by_name(optimizer_state: dict) -> bool:
    """True for an optimizer state dict keyed by parameter names (torch.distributed.checkpoint's form)."""
    groups = optimizer_state.get("param_groups") or []
    return any(isinstance(key, str) for group in groups for key in group.get("params", []))


class DataParallelStrategy(SingleDeviceStrategy):
    """``torch.nn.DataParallel`` over several GPUs of this machine, driven from one process.

    Each batch is split along its first dimension across the GPUs; the loss is the mean of the replicas'
    losses. Predictions run on the first GPU. Prefer ``gpu_mode='ddp'``, which is faster and also scales
    across machines.

    Args:
        device: the first GPU, where the master copy of the model lives.
        device_ids: the GPUs to use; all visible GPUs when None.
    """

    def __init__(self, device: torch.device, device_ids: Optional[List[int]] = None):
        super().__init__(device)
        self.device_ids = device_ids
        self.dp_model_args: dict = {}

    def configure(self, dp_model_args: Optional[dict] = None) -> None:
        """``dp_model_args``: further ``torch.nn.DataParallel`` arguments (``output_device``, ``dim``...)."""
        self.dp_model_args = dict(dp_model_args or {})
        if "device_ids" in self.dp_model_args:
            self.device_ids = self.dp_model_args.pop("device_ids")

    def wrap_model(self, model: nn.Module) -> Any:
        wrapper = nn.DataParallel(MethodDispatcher(model, use_replica_device=True), device_ids=self.device_ids,
                                  **self.dp_model_args)
        return ParallelModelRunner(wrapper, model)


GPU_MODES = ("single", "dp", "ddp", "fsdp")


def _has_fully_shard() -> bool:
    import torch.distributed.fsdp as fsdp
    return hasattr(fsdp, "fully_shard")


def resolve_device(cuda_device_idx: Optional[int]) -> torch.device:
    """The device of a single-process run: the given (or current) CUDA GPU when there is one, else the CPU.

    Raises:
        TypeError: ``cuda_device_idx`` is not an int.
        ValueError: ``cuda_device_idx`` is set without CUDA, or is out of range.
    """
    if cuda_device_idx is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if isinstance(cuda_device_idx, bool) or not isinstance(cuda_device_idx, int):
        raise TypeError(f"cuda_device_idx must be an int GPU index or None, got {cuda_device_idx!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"cuda_device_idx={cuda_device_idx} was given but CUDA is not available on this machine; "
                         "leave cuda_device_idx=None to train on the CPU")
    count = torch.cuda.device_count()
    if not 0 <= cuda_device_idx < count:
        raise ValueError(f"cuda_device_idx={cuda_device_idx} is out of range: this machine has {count} GPU(s), "
                         f"valid indices are 0..{count - 1}")
    return torch.device("cuda", cuda_device_idx)


def create_strategy(gpu_mode: str, cuda_device_idx: Optional[int]) -> SingleDeviceStrategy:
    """The strategy for TrainLoop's ``gpu_mode`` in this (parent) process.

    ``'ddp'`` and ``'fsdp'`` also get a single-device strategy here: the processes they launch build their own.

    ``'dp'`` without CUDA trains on the CPU with a warning (as aitoolbox 1.x did).

    Raises:
        ValueError: unknown ``gpu_mode``.
    """
    if gpu_mode not in GPU_MODES:
        raise ValueError(f"gpu_mode must be one of {', '.join(repr(m) for m in GPU_MODES)}; got {gpu_mode!r}")
    if gpu_mode == "fsdp" and not _has_fully_shard():
        raise ValueError(f"gpu_mode='fsdp' needs torch's FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6); "
                         f"this is torch {torch.__version__}: upgrade torch, or use gpu_mode='ddp'")
    device = resolve_device(cuda_device_idx)
    if gpu_mode == "dp":
        if device.type != "cuda":
            warnings.warn("gpu_mode='dp' (torch.nn.DataParallel) needs CUDA GPUs and this machine has none: training "
                          "on the CPU in this process. Use gpu_mode='ddp' for several CPU processes.", stacklevel=3)
            return SingleDeviceStrategy(device)
        return DataParallelStrategy(device)
    return SingleDeviceStrategy(device)
