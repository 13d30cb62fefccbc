"""The DistributedDataParallel strategy: one process per device, gradients all-reduced by torch DDP."""
import atexit
import contextlib
import datetime
import os
import time
import logging
from typing import Any, ContextManager, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.distributed.data import (
    distributed_eval_loader, distributed_train_loader, equal_batch_counts_by_construction, peek_seed,
    sampler_random_state_digest, sharded_order_digest)
from aitoolbox.torchtrain.distributed.dispatch import MethodDispatcher, ParallelModelRunner
from aitoolbox.torchtrain.distributed.environment import ProcessPlacement
from aitoolbox.torchtrain.distributed.rendezvous import init_job_process_group
from aitoolbox.torchtrain.distributed.strategy import SingleDeviceStrategy
from aitoolbox.torchtrain.data.sampler_state import loader_samplers

logger = logging.getLogger(__name__)


_EXHAUSTED = object()  # what next() gives for a loader that ran out (see DistributedStrategy.agreed_batches)


class DistributedStrategy(SingleDeviceStrategy):
    """Training in one process of a DistributedDataParallel job.

    Args:
        placement: this process's rank, local rank, world size and rendezvous address.
        backend: ``'nccl'`` or ``'gloo'``; None picks NCCL with CUDA and gloo on the CPU.
        init_method: torch.distributed init method (``'env://'`` uses ``placement``'s address and port).
        ddp_model_args: keyword arguments for ``torch.nn.parallel.DistributedDataParallel``.
        sync_bn: convert BatchNorm layers to :class:`aitoolbox.torchtrain.parallel.SyncBatchNorm`.
        timeout_s: how long a collective waits for a missing rank before failing (so a dead peer never hangs
            the others forever).
    """

    is_distributed = True

    def __init__(self, placement: ProcessPlacement, backend: Optional[str] = None, init_method: str = "env://",
                 ddp_model_args: Optional[dict] = None, sync_bn: bool = False, timeout_s: float = 600.0):
        use_cuda = torch.cuda.is_available() and backend != "gloo"
        device = torch.device("cuda", placement.local_rank % torch.cuda.device_count()) if use_cuda \
            else torch.device("cpu")
        super().__init__(device)
        self.placement = placement
        self.rank = placement.rank
        self.world_size = placement.world_size
        self.backend = backend or ("nccl" if use_cuda else "gloo")
        self.init_method = init_method
        self.ddp_model_args = dict(ddp_model_args or {})
        self.sync_bn = sync_bn
        self.timeout_s = timeout_s
        self._ddp_wrapper: Optional[nn.parallel.DistributedDataParallel] = None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
                f"backend={self.backend!r})")

    def init_process_group(self, job_token: Optional[str] = None, listen_socket: Any = None) -> None:
        """Join the job's process group (unless this process already belongs to one).

        Args:
            job_token: the job's identity (see :mod:`~aitoolbox.torchtrain.distributed.rendezvous`): with the
                ``'env://'`` init method the group meets in a store of this job only. None: torch's own rendezvous.
            listen_socket: rank 0's: the socket its launcher reserved the port with (the store serves on it).
        """
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if dist.is_initialized():
            return
        timeout = datetime.timedelta(seconds=self.timeout_s)
        # A process that joined a torchrun/SLURM job goes on with the user's script after fit_distributed, so
        # the group stays until the program ends; see _destroy_process_group_at_exit.
        atexit.register(_destroy_process_group_at_exit)
        if self.init_method == "env://" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent keeps one store for all attempts of a job it restarts (--max-restarts), and the
            # keys of the failed attempt stay: a process of the new attempt could read its peer's old address
            # and fail to connect. Each attempt gets keys of its own.
            store = dist.TCPStore(self.placement.master_addr, self.placement.master_port, self.world_size,
                                  is_master=False, timeout=timeout)
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            dist.init_process_group(self.backend, store=dist.PrefixStore(f"aitoolbox/attempt_{attempt}", store),
                                    rank=self.rank, world_size=self.world_size, timeout=timeout)
            return
        if self.init_method == "env://" and job_token is not None:
            init_job_process_group(self.backend, self.placement, job_token, timeout, listen_socket)
            return
        init_method = self.init_method
        if init_method == "env://":
            init_method = f"tcp://{self.placement.master_addr}:{self.placement.master_port}"
        dist.init_process_group(self.backend, init_method=init_method, rank=self.rank, world_size=self.world_size,
                                timeout=timeout)

    def place_model(self, model: nn.Module) -> None:
        if self.sync_bn:
            from aitoolbox.torchtrain.parallel import convert_syncbn_model
            self._convert_batchnorm_in_place(model, convert_syncbn_model)
        super().place_model(model)

    @staticmethod
    def _convert_batchnorm_in_place(model: nn.Module, convert) -> None:
        # The TTModel object itself must stay (the loop and the user hold it): convert its children.
        for name, child in list(model.named_children()):
            setattr(model, name, convert(child))

    def wrap_model(self, model: nn.Module) -> Any:
        args = dict(self.ddp_model_args)
        if self.device.type == "cuda":
            args.setdefault("device_ids", [self.device.index])
            args.setdefault("output_device", self.device.index)
        wrapper = nn.parallel.DistributedDataParallel(MethodDispatcher(model), **args)
        self._ddp_wrapper = wrapper
        return ParallelModelRunner(wrapper, model, evaluate_through_wrapper=False)

    def skip_gradient_sync(self, accumulating: bool) -> ContextManager:
        # DDP decides in forward whether the coming backward all-reduces: forward and backward both go inside.
        if accumulating and self._ddp_wrapper is not None:
            return self._ddp_wrapper.no_sync()
        return self._no_sync_needed

    def sync_skipped_gradients(self) -> None:
        # What DDP's backward would have done: the gradients averaged over the ranks.
        if self._ddp_wrapper is None:
            return
        self.average_tensors([param.grad for param in self._ddp_wrapper.parameters() if param.grad is not None])

    def average_tensors(self, tensors: List[torch.Tensor]) -> None:
        """Average ``tensors`` in place over the ranks, in one all-reduce per dtype (coalesced)."""
        by_dtype = {}
        for tensor in tensors:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        for group in by_dtype.values():
            flat = torch.cat([tensor.reshape(-1) for tensor in group])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat.div_(self.world_size)
            offset = 0
            for tensor in group:
                tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()

    def evaluation_context(self) -> ContextManager:
        """Every rank evaluates with rank 0's buffers (see :func:`rank0_buffers`)."""
        if self._ddp_wrapper is None:
            return self._no_sync_needed
        return rank0_buffers(self._ddp_wrapper.module)

    def setup_loader(self, loader: Optional[DataLoader], shuffle: Optional[bool] = None) -> Optional[DataLoader]:
        """This process's share of the user's training loader (:func:`~.data.distributed_train_loader`); a
        collective. Every process draws the user's sampler's order alike: the seed of the global random state it
        draws with is rank 0's, and the samplers' own random states must agree across the processes.

        Raises:
            ValueError: in every process, when a process's loader cannot be sharded or the processes' samplers
                would draw different orders.
        """
        seed = self.broadcast_object(peek_seed())
        try:
            prepared = distributed_train_loader(loader, self.rank, self.world_size, shuffle, seed)
            outcome = ("ok", sampler_random_state_digest(prepared), sharded_order_digest(prepared))
        except ValueError as error:  # raised in every process below, so that none waits for the others
            outcome = ("error", str(error))
        outcomes = self.all_gather_objects(outcome)
        for rank, (status, detail, *_) in enumerate(outcomes):
            if status == "error":
                raise ValueError(detail if rank == self.rank else f"rank {rank} refused its training loader: {detail}")
        if len({detail for _, detail, _ in outcomes}) > 1:
            differing = [rank for rank, (_, detail, _) in enumerate(outcomes) if detail != outcomes[0][1]]
            raise ValueError(f"the training sampler's own random state differs between the processes (ranks "
                             f"{differing} differ from rank 0): each would draw another order, training some samples "
                             "twice and others never. Build the sampler and its generator with the same seed in every "
                             "process")
        if len({order for _, _, order in outcomes}) > 1:
            # The sampler draws per process (it shards by itself unannounced): sharding it again would train a
            # fraction of the data set silently.
            lengths = {rank: order[1] for rank, (_, _, order) in enumerate(outcomes)}
            name = outcomes[0][2][0]
            raise ValueError(f"the training loader's sampler {name} draws another order in each process (lengths "
                             f"by rank: {lengths}; the same seed and state in every process): it seems to shard by "
                             "itself, e.g. by torch.distributed.get_rank() or through a DistributedSampler it builds, "
                             "and fit_distributed would shard its part again, training a fraction of the data set. "
                             f"Give {name} the attributes num_replicas and rank (a sampler with them is used as "
                             "given), or let it draw the whole data set alike in every process, which "
                             "fit_distributed shards")
        return prepared

    def setup_eval_loader(self, loader: Optional[DataLoader]) -> Optional[DataLoader]:
        return distributed_eval_loader(loader, self.rank, self.world_size)

    def agreed_batches(self, batches: Iterator[Any], loader: Any) -> Iterator[Any]:
        """``batches``, where the loader may give the processes uneven counts (an ``IterableDataset`` sharded by the
        user; see :func:`~.data.equal_batch_counts_by_construction`), with the processes agreeing before each batch
        that all of them have one: a process whose loader ran out while another's had a batch would leave the
        others waiting in a collective it never joins (gloo aborts, NCCL hangs). A collective per batch.

        Raises:
            ValueError: in every process, at the first batch some processes have and others do not, naming each
                process's count.
        """
        if equal_batch_counts_by_construction(loader):
            return batches
        return self._agreed(batches)

    def _agreed(self, batches: Iterator[Any]) -> Iterator[Any]:
        iterator, count = iter(batches), 0
        while True:
            item = next(iterator, _EXHAUSTED)
            has = 0.0 if item is _EXHAUSTED else 1.0
            flags = torch.tensor([has, -has], device=self.device)  # (min of has, -max of has) in one reduction
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
            every, some = flags[0].item() == 1.0, -flags[1].item() == 1.0
            if every:
                count += 1
                yield item
                continue
            if not some:
                return
            counts = self.all_gather_objects((count, item is _EXHAUSTED))
            shown = ", ".join(f"rank {rank}: {done if exhausted else f'more than {done}'}"
                              for rank, (done, exhausted) in enumerate(counts))
            raise ValueError(f"the training loader gives the processes different numbers of batches this epoch "
                             f"({shown}): DDP's processes step together, so each must train as "
                             "many. Shard the data evenly (e.g. an IterableDataset giving every rank as many "
                             "samples, the remainder dropped or repeated), or use a map-style dataset, whose sampler "
                             "fit_distributed shards into equal parts")

    def on_epoch_begin(self, epoch: int, loader: Optional[DataLoader] = None) -> None:
        # Every sampler the loader draws from (a user's DistributedSampler, also inside a batch sampler; the
        # sharding wrapper and what it wraps) gets the epoch: a new order each epoch, as in the torchrun recipe.
        for sampler in loader_samplers(loader):
            if callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(epoch)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        reduced = tensor.clone()
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
        return reduced

    def all_gather_objects(self, obj: Any) -> List[Any]:
        gathered: List[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast_object(self, obj: Any) -> Any:
        holder = [obj]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def any_process(self, flag: bool) -> bool:
        flags = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags.item())

    # One rank leaving the batch loop early would leave the others waiting in DDP's all-reduce: stop
    # requests take effect at the epoch end, agreed by all ranks.
    stops_mid_epoch = False

    def barrier(self) -> None:
        dist.barrier()


@contextlib.contextmanager
def rank0_buffers(module: nn.Module) -> Iterator[None]:
    """``module``'s buffers as rank 0 holds them, in every rank, for an evaluation; each rank's own put back after.

    The model is rank 0's (``fit_distributed`` returns it, checkpoints save it), but each rank updates its own
    buffers: DDP gives every rank rank 0's buffers at the start of each training forward, so after training a
    rank's BatchNorm statistics differ by its last batch's update (FSDP never synchronises them). Each rank's block
    of the data is then evaluated with the statistics one process evaluates it with. A collective: every rank
    enters it.
    """
    buffers = list(module.buffers())
    own = [buffer.detach().clone() for buffer in buffers]
    with torch.no_grad():
        for buffer in buffers:
            dist.broadcast(buffer, src=0)
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(buffers, own):
                buffer.copy_(value)


def _destroy_process_group_at_exit() -> None:
    """Shut the process group down while the interpreter still runs.

    A gloo worker thread frees each finished collective's tensors itself, a moment after the caller's wait
    returned. Freeing a tensor made in Python takes the GIL; once the interpreter is finalising, that thread is
    made to exit mid-destructor and the C++ runtime aborts the process ("terminate called without an active
    exception", seen under torchrun after training succeeded, which torchrun then reports as a failure). So
    the group is shut down here, and its threads get a moment to finish what they were freeing.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        time.sleep(0.2)
