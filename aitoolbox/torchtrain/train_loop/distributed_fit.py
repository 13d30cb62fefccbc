"""``TrainLoop.fit_distributed``: validate, launch (or join) the processes, adopt rank 0's result."""
import logging
import os
import tempfile
import warnings
from typing import TYPE_CHECKING, Any, List, Optional

import torch

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.distributed.environment import current_external_placement, find_free_port, port_is_free
from aitoolbox.torchtrain.distributed.launcher import ProcessLauncher, choose_start_method
from aitoolbox.torchtrain.distributed.ddp import DistributedStrategy
from aitoolbox.torchtrain.distributed.environment import ProcessPlacement
from aitoolbox.torchtrain.distributed.worker import DistributedJob, FitArguments
from aitoolbox.torchtrain.train_loop.use_amp import check_use_amp
from aitoolbox.torchtrain.train_loop import validation
from aitoolbox.torchtrain.train_loop.train_state import capture_rng_state, restore_rng_state

if TYPE_CHECKING:  # pragma: no cover
    from aitoolbox.torchtrain.train_loop.train_loop import TrainLoop

logger = logging.getLogger(__name__)


def enter_distributed_process(tl: "TrainLoop", strategy, amp_init_args: Optional[dict]) -> None:
    """In a process of a distributed job: train with ``strategy`` and set up the model afresh."""
    tl.strategy = strategy
    if amp_init_args is not None:
        check_use_amp(amp_init_args, strategy.device)
        tl.use_amp = amp_init_args
    tl._model_runner = None
    tl._precision = None
    tl._evaluation_loaders = {}
    tl._evaluator.clear_cache()


def shard_data_loaders(tl: "TrainLoop", train_data_shuffle: bool) -> None:
    """Give this process its share of the training data (after in-process data loading)."""
    shuffle = None if train_data_shuffle else False
    tl.train_loader = tl.strategy.setup_loader(tl.train_loader, shuffle)
    tl._evaluation_loaders = {}


def save_distributed_result(tl: "TrainLoop", path: str, train_history: dict) -> None:
    """Save what the launching process adopts: weights, optimizer states, rank 0's history, and counters."""
    torch.save({"model": tl.model.state_dict(), "optimizers": [opt.state_dict() for opt in tl.optimizers],
                "train_history": train_history, "epoch": tl.epoch,
                "epochs_completed": tl.epochs_completed, "total_iteration_idx": tl.total_iteration_idx},
               path)


def adopt_distributed_result(tl: "TrainLoop", path: str, callbacks: Optional[List[AbstractCallback]]) -> None:
    """In the launching process: take over the trained state, so the TrainLoop continues from it."""
    result = torch.load(path, map_location="cpu", weights_only=True)
    tl.model.load_state_dict(result["model"])
    for optimizer, state in zip(tl.optimizers, result["optimizers"]):
        try:
            optimizer.load_state_dict(state)
        except (ValueError, KeyError, RuntimeError) as error:
            logger.warning("could not restore the optimizer state from the training processes: %s", error)
    tl.train_history.clear()
    tl.train_history.update(result["train_history"])
    tl.epoch = result["epoch"]
    tl.epochs_completed = result["epochs_completed"]
    tl.total_iteration_idx = result["total_iteration_idx"]
    # A checkpoint loaded before fit_distributed was applied in the processes; a later fit here must not
    # apply it again over the adopted state.
    tl.pending_restore = None
    if tl.experiment_folder is not None:  # rank 0 may have created the run folder of a lazy preset
        tl.experiment_folder.adopt_if_created_elsewhere()
    tl._evaluator.clear_cache()


def train_in_this_process(job: DistributedJob, placement: ProcessPlacement) -> Any:
    """Join the process group and train; each node's first process saves the result for its launcher."""
    if job.rng_states is not None:
        restore_rng_state(job.rng_states)
    if job.threads_per_process is not None:
        torch.set_num_threads(job.threads_per_process)
    if placement.rank != 0:
        logging.getLogger("aitoolbox").setLevel(logging.WARNING)  # only rank 0 reports progress
    tl = job.train_loop
    strategy = DistributedStrategy(placement, **job.strategy_options)
    strategy.init_process_group()
    enter_distributed_process(tl, strategy, job.amp_init_args)
    tl.callbacks_handler.register_callbacks(list(job.in_process_data_load) + list(job.fit_arguments.callbacks or []))
    tl.callbacks_handler.on_multiprocess_start()
    shard_data_loaders(tl, job.train_data_shuffle)
    args = job.fit_arguments
    model = tl.fit(args.num_epochs, args.num_iterations, args.callbacks, args.grad_accumulation)
    if job.result_path is not None:
        # Every node's launcher returns the trained model: the first process of each node saves it (DDP keeps
        # the replicas identical). Histories differ per rank (accumulated_loss is this rank's batches), so all
        # nodes report rank 0's.
        history = strategy.broadcast_object(tl.train_history.get_train_history_dict())
        if placement.local_rank == 0:
            save_distributed_result(tl, job.result_path, history)
    return model


def resolve_backend(backend: Optional[str], on_gpu: Optional[bool]) -> Optional[str]:
    """The process-group backend: ``on_gpu=False`` (aitoolbox 1.x) means CPU processes over gloo, and so does NCCL
    (1.x's default backend) on a machine without CUDA, with a warning."""
    if backend not in (None, "gloo", "nccl", "mpi"):
        raise ValueError(f"backend must be 'nccl', 'gloo', 'mpi' or None (automatic), got {backend!r}")
    if on_gpu is False:
        return "gloo" if backend in (None, "nccl") else backend
    if backend == "nccl" and not torch.cuda.is_available():
        warnings.warn("backend='nccl' needs CUDA, which this machine lacks: using gloo with CPU processes", stacklevel=4)
        return "gloo"
    return backend


def processes_per_node(num_gpus: Optional[int], num_cpu_processes: int, use_cuda: bool = True) -> int:
    """One process per GPU; without CUDA (or with ``use_cuda=False``), ``num_gpus`` (if > 0) or
    ``num_cpu_processes`` CPU processes."""
    for name, value in (("num_gpus", num_gpus), ("num_cpu_processes", num_cpu_processes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if use_cuda and torch.cuda.is_available():
        available = torch.cuda.device_count()
        count = num_gpus or available
        if count > available:
            raise ValueError(f"num_gpus={num_gpus} but this machine has {available} GPU(s)")
        return count
    count = num_gpus or num_cpu_processes
    if count < 1:
        raise ValueError("num_cpu_processes must be >= 1")
    warnings.warn(f"CUDA is not available: fit_distributed trains with {count} CPU processes over gloo",
                  stacklevel=4)
    return count


def rendezvous(num_nodes: int, node_rank: int, master_addr: Optional[str], master_port: Optional[int]):
    """Host and port of rank 0; on one node a free port is picked (or a busy requested one replaced)."""
    if num_nodes == 1:
        addr = master_addr or "127.0.0.1"
        if master_port is None:
            return addr, find_free_port()
        if not port_is_free(master_port):
            replacement = find_free_port()
            logger.warning("master_port %d is busy; using port %d instead", master_port, replacement)
            return addr, replacement
        return addr, master_port
    if master_addr is None:
        raise ValueError(f"num_nodes={num_nodes}: pass master_addr, the address of the node with node_rank 0, so "
                         "the nodes can find each other")
    return master_addr, master_port or 29500


def fit_distributed(tl: "TrainLoop", num_epochs: int, num_iterations: int, callbacks: Optional[List[AbstractCallback]],
                    grad_accumulation: int, train_data_shuffle: bool, ddp_model_args: Optional[dict],
                    amp_init_args: Optional[dict], in_process_data_load, num_nodes: int, node_rank: int,
                    num_gpus: Optional[int], backend: Optional[str], init_method: str, master_addr: Optional[str],
                    master_port: Optional[int], num_cpu_processes: int, sync_bn: bool, start_method: Optional[str],
                    timeout_s: float, on_gpu: Optional[bool] = None):
    """See :meth:`TrainLoop.fit_distributed`."""
    validation.check_fit_arguments(num_epochs, num_iterations, grad_accumulation)
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"num_nodes must be an int >= 1, got {num_nodes!r}")
    if isinstance(node_rank, bool) or not isinstance(node_rank, int) or not 0 <= node_rank < num_nodes:
        raise ValueError(f"node_rank must be an int in 0..{num_nodes - 1}, got {node_rank!r}")
    backend = resolve_backend(backend, on_gpu)
    if amp_init_args is not None and not isinstance(amp_init_args, dict):
        raise TypeError(f"amp_init_args must be a dict of amp.initialize arguments, got {amp_init_args!r}")
    data_load_callbacks = [] if in_process_data_load is None else (
        list(in_process_data_load) if isinstance(in_process_data_load, (list, tuple)) else [in_process_data_load])
    strategy_options = dict(backend=backend, init_method=init_method, ddp_model_args=ddp_model_args,
                            sync_bn=sync_bn, timeout_s=timeout_s)
    fit_arguments = FitArguments(num_epochs, num_iterations, callbacks, grad_accumulation)
    common = dict(train_loop=tl, fit_arguments=fit_arguments, strategy_options=strategy_options,
                  amp_init_args=amp_init_args, train_data_shuffle=train_data_shuffle,
                  in_process_data_load=data_load_callbacks)

    placement = current_external_placement(master_addr, master_port)
    if placement is not None:  # torchrun / SLURM / OpenMPI started us: this process is one rank
        logger.info("joining the %s job as rank %d of %d", placement.launcher, placement.rank, placement.world_size)
        job = DistributedJob(processes_per_node=1, node_rank=placement.rank, world_size=placement.world_size,
                             master_addr=placement.master_addr, master_port=placement.master_port,
                             result_path=None, **common)
        return train_in_this_process(job, placement)

    per_node = processes_per_node(num_gpus, num_cpu_processes, use_cuda=backend != "gloo")
    addr, port = rendezvous(num_nodes, node_rank, master_addr, master_port)
    method = choose_start_method(start_method)
    threads = None
    if (backend == "gloo" or not torch.cuda.is_available()) and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // per_node)  # CPU processes share the cores
    with tempfile.TemporaryDirectory(prefix="aitoolbox-ddp-") as result_dir:
        result_path = os.path.join(result_dir, "result.pt")
        job = DistributedJob(processes_per_node=per_node, node_rank=node_rank, world_size=num_nodes * per_node,
                             master_addr=addr, master_port=port, result_path=result_path,
                             rng_states=capture_rng_state(), threads_per_process=threads, **common)
        ProcessLauncher(job, method).run()
        adopt_distributed_result(tl, result_path, callbacks)
    return tl.model_for_user
