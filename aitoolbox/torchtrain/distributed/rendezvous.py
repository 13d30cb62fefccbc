"""The rendezvous store of a job: rank 0 serves it on the port its launcher reserved, and a process joins only the
store of its own job.

Two jobs given the same ``master_port`` (or the default 29500) must never join each other's process group: a rank
of one that reached the other's store would take a rank there, and both jobs would hang or train wrongly. So the
store holds the job's identity (:func:`job_token`): rank 0 writes it first thing, every other rank reads it before
joining and stops at once, naming ``master_port``, when it is another job's; and the job's keys live under that
identity (a ``PrefixStore``), so no key of one job is read by another.
"""
import datetime
import hashlib
import json
import os
import secrets
import socket
from typing import Any, Iterable, Mapping, Optional

import torch.distributed as dist

from aitoolbox.torchtrain.distributed.environment import ProcessPlacement

JOB_KEY = "aitoolbox/job"


def job_token(environ: Mapping[str, str], shape: Optional[dict] = None) -> str:
    """The identity of a job that every process of it computes alike, on any node, without talking: the
    scheduler's job (and SLURM step) id when there is one, and ``shape``, what the job is (the script, the number of
    processes, the model's parameters, the optimizers' settings...). A random one when neither is given (the
    processes of one launcher get it from the launcher)."""
    ids = {name: environ[name] for name in ("AITOOLBOX_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID",
                                            "PMIX_NAMESPACE") if environ.get(name)}
    if not ids and not shape:
        return secrets.token_hex(8)
    text = json.dumps({"ids": ids, "shape": shape or {}}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def job_shape(script: Optional[str], world_size: int, num_nodes: int, fit_arguments: Iterable[Any], model: Any,
              optimizers: Iterable[Any]) -> dict:
    """What a job is, as every node of it builds it alike (see :func:`job_token`): never state that a node may have
    loaded on its own (weights, optimizer states, a learning rate a scheduler changed)."""
    from aitoolbox.experiment.local_save.stable_value import UnstableValueError, stable_json

    def settings(optimizer) -> str:
        try:
            return stable_json(getattr(optimizer, "defaults", {}))
        except UnstableValueError:  # (e.g. a function in the defaults): the class says enough
            return ""

    return {"script": os.path.basename(script or ""), "world_size": world_size, "num_nodes": num_nodes,
            "fit": list(fit_arguments),
            "parameters": [[name, list(parameter.shape)] for name, parameter in model.named_parameters()],
            "optimizers": [[type(optimizer).__qualname__, settings(optimizer)] for optimizer in optimizers]}


def init_job_process_group(backend: str, placement: ProcessPlacement, token: str, timeout: datetime.timedelta,
                           listen_socket: Optional[socket.socket] = None) -> None:
    """``torch.distributed.init_process_group`` over the job's own store at ``placement``'s address.

    Rank 0 serves the store, on ``listen_socket`` when its launcher reserved the port (else it binds the port
    itself), and writes the job's identity; every other rank connects and checks it.

    Raises:
        RuntimeError: the store at that address is another job's; the message names ``master_port``.
    """
    is_master = placement.rank == 0
    # The TCPStore takes the descriptor over: it gets a duplicate, so the launcher's reservation stays its own.
    listen_fd = os.dup(listen_socket.fileno()) if is_master and listen_socket is not None else None
    store = dist.TCPStore(placement.master_addr, placement.master_port, placement.world_size, is_master,
                          timeout=timeout, master_listen_fd=listen_fd)
    if is_master:
        store.set(JOB_KEY, token)
    else:
        found = store.get(JOB_KEY).decode("utf-8", errors="replace")
        if found != token:
            raise RuntimeError(
                f"the rendezvous at {placement.master_addr}:{placement.master_port} belongs to another job (its "
                f"identity is {found!r}, this job's is {token!r}): two jobs were given the same master_port="
                f"{placement.master_port}. Give each job its own master_port (or let fit_distributed choose one on a "
                "single machine); this process did not join the other job")
    dist.init_process_group(backend, store=dist.PrefixStore(f"aitoolbox/{token}/", store), rank=placement.rank,
                            world_size=placement.world_size, timeout=timeout)
