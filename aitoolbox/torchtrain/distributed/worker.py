"""What each process of a ``fit_distributed`` job runs: join the group, train, hand the result home."""
import dataclasses
import os
import pickle
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable, List, Optional, Union

import torch.distributed as dist
from tqdm.auto import tqdm

from aitoolbox.torchtrain.distributed.environment import ProcessPlacement


@dataclasses.dataclass
class FitArguments:
    """The ``fit`` arguments every process trains with."""

    num_epochs: int = 0
    num_iterations: int = 0
    callbacks: Optional[List[Any]] = None
    grad_accumulation: int = 1


@dataclasses.dataclass
class DistributedJob:
    """Everything a process needs: the TrainLoop, what to train, and its place in the job.

    Attributes:
        train_loop: the parent's TrainLoop (pickled to spawned processes, inherited by forked ones).
        train_process: a module-level function ``(job, placement)`` that trains in the process (the training
            side's; this package only launches it).
        fit_arguments: what to train.
        processes_per_node: processes this launcher starts (one per GPU, or CPU processes).
        node_rank: this machine's index among ``num_nodes``.
        world_size: ``num_nodes * processes_per_node``.
        master_addr: rendezvous host; master_port: its port.
        strategy_options: keyword arguments of :class:`DistributedStrategy` (backend, ddp_model_args, ...).
        amp_init_args: ``amp.initialize`` arguments applied in every process before the DDP wrap.
        train_data_shuffle: shuffle the training data (when the original loader shuffles).
        in_process_data_load: callbacks that build the data loaders in ``on_multiprocess_start``.
        result_path: where the node's first process saves the trained state for the launcher (None when
            joining a torchrun/SLURM/OpenMPI job in-process).
        rng_states: the parent's RNG states (``train_state.capture_rng_state``), so every rank starts alike.
        threads_per_process: torch intra-op threads of each CPU process (None leaves torch's default).
    """

    train_loop: Any
    train_process: Callable[["DistributedJob", ProcessPlacement], Any]
    fit_arguments: FitArguments
    processes_per_node: int
    node_rank: int
    world_size: int
    master_addr: str
    master_port: int
    strategy_options: dict
    amp_init_args: Optional[dict]
    train_data_shuffle: bool
    in_process_data_load: List[Any]
    result_path: Optional[str]
    rng_states: Optional[dict] = None
    threads_per_process: Optional[int] = None

    def placement(self, local_rank: int) -> ProcessPlacement:
        rank = self.node_rank * self.processes_per_node + local_rank
        return ProcessPlacement(rank, local_rank, self.world_size, self.master_addr, self.master_port, "aitoolbox")


def worker_entry(local_rank: int, job: Union[DistributedJob, Connection], message_queue) -> None:
    """Entry point of a launched process; reports an exception with its traceback to the parent.

    Args:
        local_rank: the process's rank on this node.
        job: the job itself (fork), or the receiving end of a pipe the parent writes the pickled job to (spawn).
        message_queue: where the outcome is reported.
    """
    if hasattr(os, "setpgrp"):
        os.setpgrp()  # its own process group: the parent can stop it together with its DataLoader workers
    # A forked process inherits tqdm's write lock, a semaphore shared with the parent: a rank stopped while
    # writing would leave it taken, and the parent's next progress bar or log message would wait forever.
    tqdm.set_lock(threading.RLock())
    rank = local_rank
    try:
        if isinstance(job, Connection):
            with job:
                job = pickle.loads(job.recv_bytes())
        placement = job.placement(local_rank)
        rank = placement.rank
        job.train_process(job, placement)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except BaseException as error:  # report everything, KeyboardInterrupt included, then exit non-zero
        message_queue.put(("error", rank, f"{type(error).__name__}: {error}", traceback.format_exc()))
        raise SystemExit(1)
    message_queue.put(("done", rank, "", ""))
