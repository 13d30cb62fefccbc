"""The fully sharded strategy (``gpu_mode='fsdp'``): FSDP2's ``fully_shard``, one process per device.

Each process keeps only its shard of every parameter, gradient and optimizer state (about 1/world of each);
a shard unit's full parameters are all-gathered just before its forward (and backward) and freed after, and
gradients are reduce-scattered. The loop is the same as under DDP; what differs lives here:

* ``wrap_model`` shards the model in place: the chosen submodules become shard units of their own (bottom-up),
  then the model itself. The model stays the user's object (its class becomes an FSDP subclass of it) and its
  ``state_dict`` keys do not change; its parameters become DTensors.
* Mixed precision is FSDP's ``MixedPrecisionPolicy`` (see :func:`aitoolbox.torchtrain.train_loop.use_amp.
  fsdp_mixed_precision`), given to :meth:`FullyShardedStrategy.set_mixed_precision` before the wrap.
* Gradient accumulation reduce-scatters every micro-batch: gradients stay sharded, which is the point of
  sharding (skipping the reduction would keep unsharded gradients until the window's step).
* Evaluation and prediction run with the parameters gathered once (:meth:`evaluation_context`): ranks may
  then see different numbers of evaluation batches, as under DDP, without waiting on each other.
* Checkpoints and the trained model hand back full (gathered) state dicts: see :meth:`model_state_dict`.
"""
import contextlib
import itertools
import logging
from typing import Any, ContextManager, Dict, Iterator, List, Optional, Sequence

import torch
from torch import nn

from aitoolbox.torchtrain.distributed.ddp import DistributedStrategy, rank0_buffers
from aitoolbox.torchtrain.distributed.environment import ProcessPlacement

logger = logging.getLogger(__name__)

FSDP_MODEL_ARGS = ("shard_modules", "min_num_params", "reshard_after_forward", "cpu_offload")
DEFAULT_MIN_NUM_PARAMS = 1_000_000


def check_fsdp_model_args(fsdp_model_args: Optional[dict]) -> dict:
    """Validate ``fit_distributed``'s ``fsdp_model_args`` before any process starts; returns them as a dict.

    Raises:
        TypeError: not a dict, or a value of the wrong type.
        ValueError: an unknown key or an out-of-range value.
    """
    if fsdp_model_args is None:
        return {}
    if not isinstance(fsdp_model_args, dict):
        raise TypeError(f"fsdp_model_args must be a dict with keys among {list(FSDP_MODEL_ARGS)}, "
                        f"got {fsdp_model_args!r}")
    unknown = sorted(set(fsdp_model_args) - set(FSDP_MODEL_ARGS))
    if unknown:
        raise ValueError(f"fsdp_model_args has unknown keys {unknown}; valid keys: {list(FSDP_MODEL_ARGS)}")
    classes = fsdp_model_args.get("shard_modules")
    if classes is not None:
        classes = tuple(classes) if isinstance(classes, (list, tuple)) else (classes,)
        if not classes or not all(isinstance(cls, type) and issubclass(cls, nn.Module) for cls in classes):
            raise TypeError("fsdp_model_args['shard_modules'] must be nn.Module classes (e.g. "
                            f"[nn.TransformerEncoderLayer]), got {fsdp_model_args['shard_modules']!r}")
    threshold = fsdp_model_args.get("min_num_params", DEFAULT_MIN_NUM_PARAMS)
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
        raise ValueError(f"fsdp_model_args['min_num_params'] must be an int >= 1, got {threshold!r}")
    for key in ("reshard_after_forward", "cpu_offload"):
        if key in fsdp_model_args and not isinstance(fsdp_model_args[key], bool):
            raise TypeError(f"fsdp_model_args[{key!r}] must be True or False, got {fsdp_model_args[key]!r}")
    return dict(fsdp_model_args)


def shard_units(model: nn.Module, shard_modules: Optional[Sequence[type]] = None,
                min_num_params: int = DEFAULT_MIN_NUM_PARAMS) -> List[nn.Module]:
    """The submodules of ``model`` that become shard units of their own, innermost first (the model itself, the
    root unit holding everything else, is not in the list).

    With ``shard_modules``: every submodule of those classes (not nested in another chosen one). Without: bottom
    up, every submodule whose parameters not already in a chosen unit number at least ``min_num_params``.
    """
    if shard_modules is not None:
        classes = tuple(shard_modules)
        chosen = [module for name, module in model.named_modules() if name and isinstance(module, classes)]
        nested = {id(inner) for outer in chosen for inner in outer.modules() if inner is not outer}
        return [module for module in reversed(chosen) if id(module) not in nested]
    units: List[nn.Module] = []
    covered: set = set()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        if module is model:
            return
        free = sum(p.numel() for p in module.parameters() if id(p) not in covered)
        if free >= min_num_params:
            units.append(module)
            covered.update(id(p) for p in module.parameters())

    visit(model)
    return units


class FullyShardedStrategy(DistributedStrategy):
    """Training in one process of a fully sharded (FSDP2) job.

    Args:
        placement: this process's rank, local rank, world size and rendezvous address.
        backend: ``'nccl'`` or ``'gloo'``; None picks NCCL with CUDA and gloo on the CPU.
        init_method: torch.distributed init method.
        fsdp_model_args: ``shard_modules`` (module classes that become shard units, e.g.
            ``[nn.TransformerEncoderLayer]``; default: by size), ``min_num_params`` (the size rule's threshold,
            default 1,000,000), ``reshard_after_forward`` (free gathered parameters after each forward and
            gather them again for backward: less memory, more communication; default True), ``cpu_offload``
            (keep the sharded parameters, gradients and optimizer step on the CPU; default False).
        timeout_s: how long a collective waits for a missing rank before failing.
    """

    shards_parameters = True

    def __init__(self, placement: ProcessPlacement, backend: Optional[str] = None, init_method: str = "env://",
                 fsdp_model_args: Optional[dict] = None, timeout_s: float = 600.0):
        super().__init__(placement, backend, init_method, ddp_model_args=None, sync_bn=False, timeout_s=timeout_s)
        self.fsdp_model_args = check_fsdp_model_args(fsdp_model_args)
        self.mixed_precision_policy = None
        self._sharded_model: Optional[nn.Module] = None

    def set_mixed_precision(self, policy: Any) -> None:
        """FSDP's ``MixedPrecisionPolicy`` for the coming wrap (None: everything in the parameters' dtype)."""
        self.mixed_precision_policy = policy

    def wrap_model(self, model: nn.Module) -> Any:
        return self.wrap_model_and_optimizers(model, [])

    def wrap_model_and_optimizers(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> Any:
        """Shard ``model`` in place, and point ``optimizers`` at its sharded parameters.

        ``fully_shard`` replaces every parameter by a sharded one (a DTensor); the user's optimizers, built before,
        are re-pointed by parameter name, and a state they already hold (a second ``fit``, a loaded checkpoint) is
        sharded along.
        """
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

        if isinstance(model, FSDPModule):  # set up again (use_strategy): it is sharded already
            self._sharded_model = model
            return model
        names = {id(param): name for name, param in model.named_parameters()}
        full_states = [_full_optimizer_state(model, optimizer) for optimizer in optimizers]
        args = self.fsdp_model_args
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        options = dict(mesh=mesh, reshard_after_forward=args.get("reshard_after_forward", True))
        if self.mixed_precision_policy is not None:
            options["mp_policy"] = self.mixed_precision_policy
        if args.get("cpu_offload", False):
            options["offload_policy"] = CPUOffloadPolicy()
        units = shard_units(model, args.get("shard_modules"), args.get("min_num_params", DEFAULT_MIN_NUM_PARAMS))
        for batchnorm in _float32_batchnorms(model, self.mixed_precision_policy):
            # BatchNorm's kernels want its weights in the dtype of its running statistics (float32): a unit of its
            # own keeps them float32 (as O2's keep_batchnorm_fp32), and leaves its low-precision input as it is.
            fully_shard(batchnorm, **dict(options, mp_policy=_float32_batchnorm_policy()))
        for unit in units:
            fully_shard(unit, **options)
        # The root's parameters are needed again at once for backward: freeing them after forward would only add an
        # all-gather per batch (torch's own default for the root).
        fully_shard(model, **dict(options, reshard_after_forward=False))
        logger.debug("FSDP: %d shard units below the root %s", len(units), type(model).__name__)
        self._sharded_model = model
        sharded = dict(model.named_parameters())
        for optimizer, full_state in zip(optimizers, full_states):
            _repoint_optimizer(optimizer, names, sharded)
            if full_state is not None:
                self.load_optimizer_state_dict(model, optimizer, full_state)
        # The model itself is what the loop calls: its forward (through get_loss) gathers the root's parameters.
        return model

    def skip_gradient_sync(self, accumulating: bool) -> ContextManager:
        return self._no_sync_needed  # reduce-scatter every micro-batch: gradients stay sharded

    def sync_skipped_gradients(self) -> None:
        """Nothing was skipped (see :meth:`skip_gradient_sync`)."""

    def evaluation_context(self) -> ContextManager:
        """Gather every shard unit's parameters once for a whole evaluation (and free them after): forwards then
        communicate nothing, so ranks with different numbers of evaluation batches never wait on each other."""
        if self._sharded_model is None:
            return contextlib.nullcontext()
        return self._evaluation_context(self._sharded_model)

    @contextlib.contextmanager
    def _evaluation_context(self, model: nn.Module) -> Iterator[None]:
        # The model's buffers are rank 0's (see rank0_buffers): FSDP does not shard or synchronise them.
        with rank0_buffers(model), _gathered_parameters(model, self.fsdp_model_args.get("reshard_after_forward", True)):
            yield

    def model_state_dict(self, model: nn.Module) -> dict:
        """The full model state dict, gathered to the CPU of rank 0 (other ranks get an empty dict); a collective:
        every rank calls it. Copies: training on does not change it."""
        return gather_full_model_state_dict(model)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The full optimizer state dict, gathered to rank 0's CPU, keyed by parameter names (a collective).
        Copies: training on does not change it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        full = get_optimizer_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # Unsharded state on the CPU (e.g. Adam's scalar ``step`` tensors) comes back as the optimizer's own.
        live = {_local(value).data_ptr() for state in optimizer.state.values() for value in state.values()
                if isinstance(value, torch.Tensor)}
        for state in full.get("state", {}).values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.data_ptr() in live:
                    state[key] = value.clone()
        return full

    def load_model_state_dict(self, model: nn.Module, state_dict: dict) -> None:
        """Load a full model state dict (every rank holds it): into the model as it is before sharding (sharding
        then keeps each rank's part), or into the sharded model, each rank taking its shard."""
        if not self._is_sharded(model):
            super().load_model_state_dict(model, state_dict)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True))

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load a full optimizer state dict (parameter-name or index keyed), before sharding or after."""
        if not self._is_sharded(model):
            super().load_optimizer_state_dict(model, optimizer, state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))

    def _is_sharded(self, model: nn.Module) -> bool:
        from torch.distributed.fsdp import FSDPModule
        return self._sharded_model is not None and any(isinstance(m, FSDPModule) for m in model.modules())


def gather_full_model_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The full model state dict of a sharded model on rank 0's CPU (other ranks get an empty dict).

    A collective under FSDP: every process calls it. A plain model in a single process gives its state dict
    copied to the CPU.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule

    if not any(isinstance(module, FSDPModule) for module in model.modules()):
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in model.state_dict().items()}
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # Unsharded tensors (buffers) on the CPU come back as the model's own: copy them, so that training on
    # does not change what was gathered.
    own = {_local(tensor).data_ptr() for tensor in itertools.chain(model.parameters(), model.buffers())}
    return {name: tensor.clone() if isinstance(tensor, torch.Tensor) and tensor.data_ptr() in own else tensor
            for name, tensor in full.items()}


def _float32_batchnorm_policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)


def _float32_batchnorms(model: nn.Module, policy: Any) -> List[nn.Module]:
    """The affine BatchNorm layers to shard with float32 parameters, when ``policy`` computes in a low dtype."""
    low = getattr(policy, "param_dtype", None)
    if low is None or low == torch.float32:
        return []
    return [module for module in model.modules()
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine and module is not model]


def _full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> Optional[dict]:
    """The optimizer's state keyed by parameter name, or None while it holds none (before its first step)."""
    if not optimizer.state:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))


def _repoint_optimizer(optimizer: torch.optim.Optimizer, names: dict, sharded: dict) -> None:
    """Replace the optimizer's parameters by the sharded ones of the same name (its old state is dropped: the
    caller loads it again, sharded)."""
    for group in optimizer.param_groups:
        missing = [param for param in group["params"] if id(param) not in names]
        if missing:
            raise ValueError(f"{type(optimizer).__name__} holds {len(missing)} tensor(s) that are not parameters of "
                             "the model: under gpu_mode='fsdp' an optimizer may only hold the model's parameters")
        group["params"] = [sharded[names[id(param)]] for param in group["params"]]
    optimizer.state.clear()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@contextlib.contextmanager
def _gathered_parameters(model: nn.Module, reshard_after_forward: bool) -> Iterator[None]:
    from torch.distributed.fsdp import FSDPModule
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for unit in units:  # keep what the forwards gather (FSDP's documented way to run evaluations)
        unit.set_reshard_after_forward(False, recurse=False)
    for unit in units:  # the same order on every rank
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            # The root never reshards after forward (its parameters are needed again at once for backward).
            unit.set_reshard_after_forward(reshard_after_forward and unit is not model, recurse=False)
