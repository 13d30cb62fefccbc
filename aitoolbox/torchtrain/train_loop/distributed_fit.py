"""``TrainLoop.fit_distributed``: validate, launch (or join) the processes, adopt rank 0's result."""
import contextlib
import dataclasses
import logging
import os
import tempfile
import warnings
from typing import TYPE_CHECKING, Any, List, Optional

import torch

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.ddp import InMultiProcessDataLoad
from aitoolbox.torchtrain.distributed.data import check_eval_loader, check_train_loader
from aitoolbox.torchtrain.distributed.environment import (
    PortReservation, current_external_placement, job_master_port)
from aitoolbox.torchtrain.distributed.launcher import ProcessLauncher, choose_start_method, main_script_path
from aitoolbox.torchtrain.distributed.rendezvous import job_shape, job_token
from aitoolbox.torchtrain.distributed.ddp import DistributedStrategy
from aitoolbox.torchtrain.distributed.fsdp import FullyShardedStrategy, check_fsdp_model_args
from aitoolbox.torchtrain.distributed.environment import ProcessPlacement
from aitoolbox.torchtrain.distributed.worker import DistributedJob, FitArguments
from aitoolbox.torchtrain.train_loop import validation
from aitoolbox.torchtrain.train_loop.interrupts import DEFAULT_SIGNAL_GRACE_S
from aitoolbox.experiment.local_save.checkpoints import MODEL_KEY, OPTIMIZER_KEY, failures_named
from aitoolbox.torchtrain.train_loop.train_state import (
    capture_rng_state, check_resumable_by, restore_callback_states, restore_rng_state, restore_train_state,
    saved_optimizer_states)

if TYPE_CHECKING:  # pragma: no cover
    from aitoolbox.torchtrain.train_loop.train_loop import TrainLoop

logger = logging.getLogger(__name__)

# In the result the launcher adopts: the run folder (and resumed checkpoint) of an experiment-tracking preset.
RUN_RECORD_KEY = "experiment_run"
# ... and the experiment folders of the callbacks, as rank 0 used them (their timestamps, whether created).
CALLBACK_FOLDERS_KEY = "callback_experiment_folders"


def shard_data_loaders(tl: "TrainLoop", train_data_shuffle: bool) -> None:
    """Give this process its share of the training data (after in-process data loading)."""
    tl.train_loader = tl.strategy.setup_loader(tl.train_loader, _shuffle(train_data_shuffle))


def _shuffle(train_data_shuffle: bool) -> Optional[bool]:
    """``train_data_shuffle`` as the strategy takes it: None keeps the sampler's order, False the data set's."""
    return None if train_data_shuffle else False


def _train_loader_built_in_process(options: "DistributedFitOptions") -> bool:
    """Whether ``in_process_data_load`` may replace the training loader in each process (a callback other than
    InMultiProcessDataLoad may do anything)."""
    return any(not isinstance(callback, InMultiProcessDataLoad) or callback.train_loader_build_fn not in (None, False)
               for callback in options.data_load_callbacks())


def distributed_result(tl: "TrainLoop") -> dict:
    """What the launching process adopts: the run's whole state, as an epoch-end checkpoint holds it (weights,
    optimizers, precision state with O2's float32 masters and the loss scale, callback states, counters, every
    rank's history and RNG state), and the run folder rank 0 decided on. Call it in every process (a collective:
    states are gathered)."""
    with warnings.catch_warnings():
        # Not a checkpoint the user asked for: the warning that one taken here does not resume a StatefulDataLoader
        # with persistent workers bitwise (train_state.capture_train_state) would come at the end of every run.
        warnings.filterwarnings("ignore", message=r"this checkpoint starts an epoch .* persistent_workers=True")
        result = tl.checkpoint_state(mid_epoch=False)
    if callable(getattr(tl, "run_record", None)):
        result[RUN_RECORD_KEY] = tl.run_record()
    result[CALLBACK_FOLDERS_KEY] = callback_folders(tl)
    return result


def _callback_folder_objects(tl: "TrainLoop") -> list:
    """The experiment folders of the registered callbacks that know theirs (each once)."""
    folders = []
    for callback in tl.callbacks:
        folder = getattr(callback, "_experiment_folder", None)
        if folder is not None and not any(folder is known for known in folders):
            folders.append(folder)
    return folders


def callback_folders(tl: "TrainLoop") -> list:
    """``[root, project, experiment, timestamp, created]`` of each callback's experiment folder (plain data)."""
    return [[folder.root, folder.project_name, folder.experiment_name, folder.timestamp, folder.created]
            for folder in _callback_folder_objects(tl)]


def adopt_callback_folders(tl: "TrainLoop", records: list) -> None:
    """In the launching process: the callbacks write, in a later call, into the folders the processes used (a
    folder the processes created is this run's, never one to avoid as another run's)."""
    used = {tuple(record[:3]): record[3:] for record in records}
    for folder in _callback_folder_objects(tl):
        found = used.get((folder.root, folder.project_name, folder.experiment_name))
        if found is not None:
            folder.adopt(found[0], created=found[1])


def adopt_distributed_result(tl: "TrainLoop", path: str, callbacks: Optional[List[AbstractCallback]]) -> None:
    """In the launching process: take over the run's state, so that a later ``fit_distributed`` (or ``fit``)
    continues exactly where this one ended, as one longer call would have.

    The weights and optimizer states are loaded now; the rest (precision state, each rank's RNG and history)
    stays pending for the next call's processes, which apply it when they start training. The call's callbacks
    are registered here too (all of them: each rank of a later call keeps its own), with rank 0's states.
    """
    result = torch.load(path, map_location="cpu", weights_only=True)
    tl.callbacks_handler.register_callbacks(callbacks, every_rank=True)
    restore_train_state(tl, result)
    restore_callback_states(tl, result)
    # The weights are loaded: what stays pending for the next call keeps only the optimizers' hyperparameters
    # (the learning rates schedulers set), not a second copy of every tensor.
    pending = tl.pending_restore
    pending.pop(MODEL_KEY, None)
    pending[OPTIMIZER_KEY] = [{"param_groups": state["param_groups"]} for state in saved_optimizer_states(pending)]
    if result.get(RUN_RECORD_KEY) is not None:  # the folder rank 0 decided on, never one derived from a clock
        tl.adopt_run_record(result[RUN_RECORD_KEY])
    adopt_callback_folders(tl, result.get(CALLBACK_FOLDERS_KEY, []))


def _continues_in_this_process(tl: "TrainLoop", placement: ProcessPlacement) -> bool:
    """A later fit_distributed of the same torchrun/SLURM job: this process already trains as that rank."""
    import torch.distributed as dist
    strategy = tl.strategy
    return strategy.is_distributed and getattr(strategy, "placement", None) == placement and dist.is_initialized()


def train_in_this_process(job: DistributedJob, placement: ProcessPlacement) -> Any:
    """Join the process group and train; each node's first process saves the result for its launcher."""
    tl = job.train_loop
    args = job.fit_arguments
    if _continues_in_this_process(tl, placement):
        # The model, its precision (O2's masters, the loss scale), loaders and callbacks are set up already: the
        # run goes on as one longer call would.
        if job.amp_init_args is not None and job.amp_init_args != tl.use_amp:
            logger.warning("fit_distributed continues the run set up by the previous call; amp_init_args=%s is "
                           "ignored (the run keeps %s)", job.amp_init_args, tl.use_amp)
        return tl.fit(args.num_epochs, args.num_iterations, args.callbacks, args.grad_accumulation)
    _join_as_rank(job, placement)
    model = tl.fit(args.num_epochs, args.num_iterations, args.callbacks, args.grad_accumulation)
    if job.result_path is not None:
        # Every node's launcher returns the trained model: the first process of each node saves the run's state
        # (DDP keeps the replicas identical; the state holds every rank's history and RNG).
        result = distributed_result(tl)
        if tl.shards_parameters and job.world_size > job.processes_per_node:
            result = _node_leaders_share(result, job, placement)
        if placement.local_rank == 0:
            torch.save(result, job.result_path)
    return model


def _join_as_rank(job: DistributedJob, placement: ProcessPlacement) -> None:
    """Make ``job.train_loop`` the process of rank ``placement.rank``: the process group, the strategy, the
    callbacks of this rank (``on_multiprocess_start``) and this rank's share of the training data."""
    if job.rng_states is not None:
        restore_rng_state(job.rng_states)
    if job.threads_per_process is not None:
        torch.set_num_threads(job.threads_per_process)
    if placement.rank != 0:
        logging.getLogger("aitoolbox").setLevel(logging.WARNING)  # only rank 0 reports progress
    tl = job.train_loop
    tl._interrupts.grace_s = job.signal_grace_s  # SIGTERM: time to finish the step and save (then killed)
    options = dict(job.strategy_options)
    strategy_class = FullyShardedStrategy if options.pop("shard_parameters", False) else DistributedStrategy
    strategy = strategy_class(placement, **options)
    strategy.init_process_group(job.rendezvous_token, job.listen_socket if placement.rank == 0 else None)
    tl.use_strategy(strategy, job.amp_init_args)
    tl.callbacks_handler.drop_callbacks_of_other_ranks()
    tl.callbacks_handler.register_callbacks(list(job.in_process_data_load) + list(job.fit_arguments.callbacks or []))
    tl.callbacks_handler.on_multiprocess_start()
    shard_data_loaders(tl, job.train_data_shuffle)


def join_external_job(tl: "TrainLoop", options: "DistributedFitOptions") -> bool:
    """In a process that torchrun, SLURM or OpenMPI started: become its rank as ``fit_distributed`` would, without
    training (``lr_find`` before the first ``fit``); the later ``fit_distributed`` goes on with this set-up. A
    collective: every process of the job calls it.

    Returns:
        False outside such a job (nothing done); True once this process is a rank of the job.
    """
    options.validate()
    placement = current_external_placement(options.master_addr, options.master_port)
    if placement is None:
        return False
    if _continues_in_this_process(tl, placement):
        return True
    logger.info("joining the %s job as rank %d of %d", placement.launcher, placement.rank, placement.world_size)
    job = DistributedJob(processes_per_node=1, node_rank=placement.rank, world_size=placement.world_size,
                         master_addr=placement.master_addr, master_port=placement.master_port, result_path=None,
                         rendezvous_token=_external_job_token(tl, options, placement), **_job_settings(tl, options))
    _join_as_rank(job, placement)
    return True


def _external_job_token(tl: "TrainLoop", options: "DistributedFitOptions",
                        placement: ProcessPlacement) -> Optional[str]:
    """The identity of a SLURM or OpenMPI job in its rendezvous store; None under torchrun, whose agent runs the
    rendezvous of its job."""
    if placement.launcher == "torchrun":
        return None
    return job_token(os.environ, job_shape(main_script_path(), placement.world_size, 0, _fit_shape(options, tl),
                                           tl.model_for_user, tl.optimizers))


def _fit_shape(options: "DistributedFitOptions", tl: "TrainLoop") -> list:
    """What the fit trains, as every node computes it alike: its targets and the training data's kind, size and batch
    size (two jobs of one script over other data tell apart; hyperparameters are left out: a node may hold its own
    paths in them)."""
    loader = tl.train_loader
    dataset = getattr(loader, "dataset", None)
    try:
        size = len(dataset)
    except TypeError:  # (an IterableDataset without len)
        size = None
    return [options.num_epochs, options.num_iterations, options.grad_accumulation, type(dataset).__qualname__, size,
            getattr(loader, "batch_size", None)]


def _node_leaders_share(result: Any, job: DistributedJob, placement: ProcessPlacement) -> Any:
    """Rank 0's gathered state, handed to the first process of every node.

    Under FSDP the whole state is gathered on global rank 0 only; the other nodes' launchers would otherwise
    adopt a state without weights. It travels once, at the end, over a gloo group of the node leaders (the
    state is on the CPU); every process takes part in creating that group, as torch requires.
    """
    import torch.distributed as dist
    leaders = [node * job.processes_per_node for node in range(job.world_size // job.processes_per_node)]
    group = dist.new_group(ranks=leaders, backend="gloo")
    if placement.local_rank == 0:
        holder = [result if placement.rank == 0 else None]
        dist.broadcast_object_list(holder, src=0, group=group)
        result = holder[0]
        dist.destroy_process_group(group)
    return result


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
    """Host, port and :class:`PortReservation` (or None) of rank 0's rendezvous store.

    On one node the port is reserved here (a free one, or ``master_port`` unless busy, then a free one instead:
    nothing outside the machine needs to know it) and stays reserved until the caller closes the reservation,
    after the processes are done: rank 0's store serves on the reservation's socket, so no other job can take the
    port at any moment. Several nodes agree on the port without talking: ``master_port``, else one derived from
    the job id (:func:`job_master_port`), else 29500; node 0 reserves it and, when it is busy, stops at once with
    an error saying to pass ``master_port``.
    """
    if num_nodes == 1:
        addr = master_addr or "127.0.0.1"
        host = "127.0.0.1" if addr in ("127.0.0.1", "localhost") else "0.0.0.0"  # where the processes connect
        if master_port is not None:
            try:
                reservation = PortReservation(master_port, host)
                return addr, reservation.port, reservation
            except OSError:
                reservation = PortReservation(0, host)
                logger.warning("master_port %d is busy (another job's?); using port %d instead", master_port,
                               reservation.port)
                return addr, reservation.port, reservation
        reservation = PortReservation(0, host)
        return addr, reservation.port, reservation
    if master_addr is None:
        raise ValueError(f"num_nodes={num_nodes}: pass master_addr, the address of the node with node_rank 0, so "
                         "the nodes can find each other")
    port = master_port or job_master_port(os.environ)
    if node_rank != 0:
        return master_addr, port, None  # the port is node 0's to check
    try:
        reservation = PortReservation(port, host="0.0.0.0")
    except OSError as error:
        raise OSError(error.errno, f"port {port} for the rendezvous of the {num_nodes} nodes is in use on this node "
                      f"(node_rank 0): pass a free master_port=<port> to fit_distributed on every node"
                      f"{'' if master_port else ' (it was derived from the job id, or the default 29500)'}") from error
    return master_addr, port, reservation


@dataclasses.dataclass
class DistributedFitOptions:
    """The arguments of ``TrainLoop.fit_distributed`` in one typed object (each documented there)."""

    num_epochs: int = 0
    num_iterations: int = 0
    callbacks: Optional[List[AbstractCallback]] = None
    grad_accumulation: int = 1
    train_data_shuffle: bool = True
    ddp_model_args: Optional[dict] = None
    amp_init_args: Optional[dict] = None
    fsdp_model_args: Optional[dict] = None
    shard_parameters: bool = False
    in_process_data_load: Any = None
    num_nodes: int = 1
    node_rank: int = 0
    num_gpus: Optional[int] = None
    backend: Optional[str] = None
    init_method: str = "env://"
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    num_cpu_processes: int = 2
    sync_bn: bool = False
    start_method: Optional[str] = None
    timeout_s: float = 600.0
    on_gpu: Optional[bool] = None
    signal_grace_s: float = DEFAULT_SIGNAL_GRACE_S

    def validate(self) -> None:
        """Check the job's shape before any process starts.

        Raises:
            ValueError: a count or rank out of range.
            TypeError: ``amp_init_args`` is not a dict.
        """
        validation.check_fit_arguments(self.num_epochs, self.num_iterations, self.grad_accumulation)
        if isinstance(self.num_nodes, bool) or not isinstance(self.num_nodes, int) or self.num_nodes < 1:
            raise ValueError(f"num_nodes must be an int >= 1, got {self.num_nodes!r}")
        if isinstance(self.node_rank, bool) or not isinstance(self.node_rank, int) \
                or not 0 <= self.node_rank < self.num_nodes:
            raise ValueError(f"node_rank must be an int in 0..{self.num_nodes - 1}, got {self.node_rank!r}")
        if isinstance(self.signal_grace_s, bool) or not isinstance(self.signal_grace_s, (int, float)) \
                or not self.signal_grace_s > 0:
            raise ValueError(f"signal_grace_s must be a number of seconds > 0 (the time the processes get to save a "
                             f"checkpoint after SIGTERM), got {self.signal_grace_s!r}")
        if self.amp_init_args is not None and not isinstance(self.amp_init_args, dict):
            raise TypeError(f"amp_init_args must be a dict of amp.initialize arguments, got {self.amp_init_args!r}")
        if self.shard_parameters:
            check_fsdp_model_args(self.fsdp_model_args)
            if self.ddp_model_args:
                raise ValueError("ddp_model_args configure DistributedDataParallel, which gpu_mode='fsdp' does not "
                                 "use: pass FSDP options as fsdp_model_args")
            if self.sync_bn:
                raise ValueError("sync_bn is not available with gpu_mode='fsdp': use gpu_mode='ddp' for SyncBatchNorm")
        elif self.fsdp_model_args is not None:
            raise ValueError("fsdp_model_args needs TrainLoop(..., gpu_mode='fsdp')")

    def data_load_callbacks(self) -> List[AbstractCallback]:
        """``in_process_data_load`` as a list."""
        if self.in_process_data_load is None:
            return []
        if isinstance(self.in_process_data_load, (list, tuple)):
            return list(self.in_process_data_load)
        return [self.in_process_data_load]


def _job_settings(tl: "TrainLoop", options: DistributedFitOptions) -> dict:
    """The :class:`DistributedJob` fields every process of a job shares, from ``fit_distributed``'s arguments."""
    backend = resolve_backend(options.backend, options.on_gpu)
    if options.shard_parameters:
        strategy_options = dict(shard_parameters=True, backend=backend, init_method=options.init_method,
                                fsdp_model_args=options.fsdp_model_args, timeout_s=options.timeout_s)
    else:
        strategy_options = dict(backend=backend, init_method=options.init_method,
                                ddp_model_args=options.ddp_model_args, sync_bn=options.sync_bn,
                                timeout_s=options.timeout_s)
    fit_arguments = FitArguments(options.num_epochs, options.num_iterations, options.callbacks,
                                 options.grad_accumulation)
    common = dict(train_loop=tl, train_process=train_in_this_process, fit_arguments=fit_arguments,
                  strategy_options=strategy_options, amp_init_args=options.amp_init_args,
                  signal_grace_s=float(options.signal_grace_s),
                  train_data_shuffle=options.train_data_shuffle, in_process_data_load=options.data_load_callbacks())
    return common


def fit_distributed(tl: "TrainLoop", options: DistributedFitOptions):
    """See :meth:`TrainLoop.fit_distributed`."""
    options.validate()
    if tl._precision_chosen_by_user:  # refused before any process starts (each process checks its device)
        validation.check_user_precision(tl._precision, options.shard_parameters, None, options.amp_init_args)
    common = _job_settings(tl, options)
    backend = common["strategy_options"]["backend"]

    placement = current_external_placement(options.master_addr, options.master_port)
    if placement is not None:  # torchrun / SLURM / OpenMPI started us: this process is one rank
        logger.info("joining the %s job as rank %d of %d", placement.launcher, placement.rank, placement.world_size)
        job = DistributedJob(processes_per_node=1, node_rank=placement.rank, world_size=placement.world_size,
                             master_addr=placement.master_addr, master_port=placement.master_port,
                             result_path=None, rendezvous_token=_external_job_token(tl, options, placement), **common)
        return train_in_this_process(job, placement)

    if options.num_nodes == 1 and tl._target_reached(options.num_epochs, options.num_iterations) \
            and not tl._lost_train_end():  # (not a loaded final checkpoint whose end a kill lost: the processes run it)
        # As fit answers: the callbacks are registered (they stay for a later call), nothing is trained, and no
        # process is started for it. (With several nodes every node's launcher must meet the others.)
        tl.callbacks_handler.register_callbacks(options.callbacks, every_rank=True)
        logger.warning("Nothing to train: %d epochs (%d iterations) are already done. fit_distributed() counts in "
                       "totals; pass a larger num_epochs or num_iterations to continue.", tl.epochs_completed,
                       tl.iterations_done)
        return tl.model_for_user
    per_node = processes_per_node(options.num_gpus, options.num_cpu_processes, use_cuda=backend != "gloo")
    if not _train_loader_built_in_process(options):  # refused before any process starts (each checks it again)
        check_train_loader(tl.train_loader, options.num_nodes * per_node, _shuffle(options.train_data_shuffle))
    if tl.pending_restore is not None:  # a loaded mid-epoch checkpoint of another world size: refused here too
        with failures_named(tl.run_state.pending_source):
            check_resumable_by(tl.pending_restore, options.num_nodes * per_node)
    if not options.data_load_callbacks():  # (else each process may build its own: each checks them)
        for which, loaders in (("validation", tl.validation_loader), ("test", tl.test_loader)):
            for loader in (loaders.values() if isinstance(loaders, dict) else [loaders]):
                check_eval_loader(loader, which)
    addr, port, reservation = rendezvous(options.num_nodes, options.node_rank, options.master_addr,
                                         options.master_port)
    method = choose_start_method(options.start_method)
    threads = None
    if (backend == "gloo" or not torch.cuda.is_available()) and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // per_node)  # CPU processes share the cores
        if method == "fork" and threads > 1:
            # GNU OpenMP cannot start threads in a forked child of a process that already ran a parallel region:
            # the child's first multi-threaded operation would hang forever.
            logger.warning("forked CPU processes compute with one thread each (%d would hang: OpenMP cannot start "
                           "threads in a forked child); run fit_distributed from a script (spawned processes) to "
                           "use %d threads per process", threads, threads)
            threads = 1
    # The port stays reserved while the processes run (the store binds it in spite of the reservation).
    with tempfile.TemporaryDirectory(prefix="aitoolbox-ddp-") as result_dir, \
            (reservation or contextlib.nullcontext()):
        result_path = os.path.join(result_dir, "result.pt")
        world_size = options.num_nodes * per_node
        # The job's identity in its rendezvous: on one machine its own (no other process may join); across machines
        # what every node computes alike (job id, what the job trains).
        token = job_token({}) if options.num_nodes == 1 else job_token(os.environ, job_shape(
            main_script_path(), world_size, options.num_nodes, _fit_shape(options, tl), tl.model_for_user,
            tl.optimizers))
        job = DistributedJob(processes_per_node=per_node, node_rank=options.node_rank, world_size=world_size,
                             master_addr=addr, master_port=port, result_path=result_path,
                             rng_states=capture_rng_state(), threads_per_process=threads, rendezvous_token=token,
                             **common)
        ProcessLauncher(job, method, listen_socket=reservation.socket if reservation is not None else None).run()
        adopt_distributed_result(tl, result_path, options.callbacks)
    return tl.model_for_user
