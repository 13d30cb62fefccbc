"""What each process of a ``fit_distributed`` job runs: join the group, train, hand rank 0's result home."""
import dataclasses
import logging
import os
import pickle
import random
import traceback
from typing import Any, List, Optional, Union

import numpy as np
import torch
import torch.distributed as dist

from aitoolbox.torchtrain.distributed.ddp import DistributedStrategy
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
        fit_arguments: what to train.
        processes_per_node: processes this launcher starts (one per GPU, or CPU processes).
        node_rank: this machine's index among ``num_nodes``.
        world_size: ``num_nodes * processes_per_node``.
        master_addr: rendezvous host; master_port: its port.
        strategy_options: keyword arguments of :class:`DistributedStrategy` (backend, ddp_model_args, ...).
        amp_init_args: ``amp.initialize`` arguments applied in every process before the DDP wrap.
        train_data_shuffle: shuffle the training data (when the original loader shuffles).
        in_process_data_load: callbacks that build the data loaders in ``on_multiprocess_start``.
        result_path: where rank 0 saves the trained state for the parent (None when joining in-process).
        rng_states: the parent's python, numpy and torch RNG states, so every rank starts identically.
        threads_per_process: torch intra-op threads of each CPU process (None leaves torch's default).
    """

    train_loop: Any
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
    rng_states: Optional[tuple] = None
    threads_per_process: Optional[int] = None

    def placement(self, local_rank: int) -> ProcessPlacement:
        rank = self.node_rank * self.processes_per_node + local_rank
        return ProcessPlacement(rank, local_rank, self.world_size, self.master_addr, self.master_port, "aitoolbox")


def capture_rng_states() -> tuple:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def restore_rng_states(states: tuple) -> None:
    python_state, numpy_state, torch_state = states
    random.setstate(python_state)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch_state)


def train_in_this_process(job: DistributedJob, placement: ProcessPlacement) -> Any:
    """Join the process group and train; rank 0 saves the result for the parent. Returns the model."""
    if job.rng_states is not None:
        restore_rng_states(job.rng_states)
    if job.threads_per_process is not None:
        torch.set_num_threads(job.threads_per_process)
    if placement.rank != 0:
        logging.getLogger("aitoolbox").setLevel(logging.WARNING)  # only rank 0 reports progress
    tl = job.train_loop
    strategy = DistributedStrategy(placement, **job.strategy_options)
    strategy.init_process_group()
    tl.enter_distributed_process(strategy, job.amp_init_args)
    tl.callbacks_handler.register_callbacks(list(job.in_process_data_load) + list(job.fit_arguments.callbacks or []))
    tl.callbacks_handler.on_multiprocess_start()
    tl.shard_data_loaders(job.train_data_shuffle)
    args = job.fit_arguments
    model = tl.fit(args.num_epochs, args.num_iterations, args.callbacks, args.grad_accumulation)
    if job.result_path is not None and placement.rank == 0:
        tl.save_distributed_result(job.result_path)
    return model


def worker_entry(local_rank: int, job: Union[DistributedJob, bytes], message_queue) -> None:
    """Entry point of a launched process; reports an exception with its traceback to the parent.

    Args:
        local_rank: the process's rank on this node.
        job: the job itself (fork), or the job pickled by the parent (spawn).
        message_queue: where the outcome is reported.
    """
    if hasattr(os, "setpgrp"):
        os.setpgrp()  # its own process group: the parent can stop it together with its DataLoader workers
    rank = local_rank
    try:
        if isinstance(job, bytes):
            job = pickle.loads(job)
        placement = job.placement(local_rank)
        rank = placement.rank
        train_in_this_process(job, placement)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except BaseException as error:  # report everything, KeyboardInterrupt included, then exit non-zero
        message_queue.put(("error", rank, f"{type(error).__name__}: {error}", traceback.format_exc()))
        raise SystemExit(1)
    message_queue.put(("done", rank, "", ""))
