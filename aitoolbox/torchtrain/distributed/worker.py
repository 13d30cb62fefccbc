"""What each process of a ``fit_distributed`` job runs: join the group, train, hand the result home."""
import ctypes
import dataclasses
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable, List, Optional, Union

import torch.distributed as dist
from tqdm.auto import tqdm

from aitoolbox.torchtrain.distributed.environment import ProcessPlacement
from aitoolbox.torchtrain.distributed.signals import STOP_SIGNALS, SignalStop

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
PARENT_CHECK_INTERVAL_S = 1.0


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
        signal_grace_s: after SIGTERM/SIGHUP, how long a process may take to finish its optimizer step and save
            a resumable checkpoint before it is killed.
        rendezvous_token: the job's identity in its rendezvous store (see
            :mod:`~aitoolbox.torchtrain.distributed.rendezvous`); None: torch's own rendezvous (torchrun's).
        listen_socket: in the process of rank 0 only: the socket its launcher reserved the rendezvous port with.
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
    signal_grace_s: float = 60.0
    rendezvous_token: Optional[str] = None
    listen_socket: Any = None

    def placement(self, local_rank: int) -> ProcessPlacement:
        rank = self.node_rank * self.processes_per_node + local_rank
        return ProcessPlacement(rank, local_rank, self.world_size, self.master_addr, self.master_port, "aitoolbox")


def worker_entry(local_rank: int, job: Union[DistributedJob, Connection], message_queue,
                 listen_socket: Any = None) -> None:
    """Entry point of a launched process; reports an exception with its traceback to the parent.

    Args:
        local_rank: the process's rank on this node.
        job: the job itself (fork), or the receiving end of a pipe the parent writes the pickled job to (spawn).
        message_queue: where the outcome is reported.
        listen_socket: (the process of rank 0) the reserved rendezvous port's socket, which its store serves on.
    """
    reset_signal_handlers()
    die_with_parent()
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
        job.listen_socket = listen_socket
        placement = job.placement(local_rank)
        rank = placement.rank
        job.train_process(job, placement)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except SignalStop as stop:  # SIGTERM/SIGHUP: stopped after a step, with a checkpoint when one was asked for
        message_queue.put(("stopped", rank, stop.signum, list(stop.saved)))
        raise SystemExit(stop.code)
    except BaseException as error:  # report everything, KeyboardInterrupt included, then exit non-zero
        message_queue.put(("error", rank, f"{type(error).__name__}: {error}", traceback.format_exc()))
        raise SystemExit(1)
    message_queue.put(("done", rank, "", ""))


def reset_signal_handlers() -> None:
    """A forked process inherits the launcher's handlers, which forward signals to the launcher's processes:
    give the signals their default handling back, so that training's own handling takes over."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def die_with_parent() -> None:
    """End this process when the launcher dies, however it died (SIGKILL, the OOM killer included).

    A launcher that dies without stopping its processes would leave them training, holding the GPU and writing
    checkpoints into the folder a restarted job resumes from. Linux kills this process with its parent
    (``PR_SET_PDEATHSIG``); elsewhere, and under ``forkserver`` (whose processes are the fork server's
    children), a thread waits for the launcher's end and then exits the process.
    """
    launcher = multiprocessing.parent_process()
    parent_pid = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
                # A launcher that died before the request took effect sent nothing: look.
                if os.getppid() != parent_pid or (launcher is not None and not launcher.is_alive()):
                    os._exit(1)
                if launcher is None or launcher.pid == parent_pid:
                    return  # the kernel ends this process with the launcher
        except (OSError, AttributeError):
            pass
    threading.Thread(target=_exit_when_launcher_gone, args=(launcher, parent_pid), name="aitoolbox-parent-check",
                     daemon=True).start()


def _exit_when_launcher_gone(launcher: Optional[Any], parent_pid: int) -> None:
    if launcher is not None:
        launcher.join()  # returns when the launcher's end closes the pipe this process holds
    else:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_CHECK_INTERVAL_S)
    logger.error("the fit_distributed launcher is gone: this training process exits")
    os._exit(1)
