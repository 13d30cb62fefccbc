"""Where this process sits in a distributed job: launched by us, or by torchrun, SLURM or OpenMPI."""
import dataclasses
import os
import re
import socket
import zlib
from typing import Mapping, Optional


@dataclasses.dataclass(frozen=True)
class ProcessPlacement:
    """Rank, size and rendezvous address of one process of a job.

    Attributes:
        rank: global rank (``node_rank * processes_per_node + local_rank``).
        local_rank: rank within the node; selects the GPU.
        world_size: number of processes in the job.
        master_addr: address of the rank-0 host.
        master_port: port of the rendezvous on that host.
        launcher: ``'aitoolbox'``, ``'torchrun'``, ``'slurm'`` or ``'openmpi'``.
    """

    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    launcher: str


def _first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``gpu[03-05,08],cpu1`` -> ``gpu03``, ``rack[1-2]-n[01-04]`` -> ``rack1-n01``."""
    first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]  # commas inside brackets separate ranges, not hosts
    host = re.sub(r"\[([^\]]*)\]", lambda group: re.split(r"[,-]", group.group(1))[0], first)
    if not host or "[" in host or "]" in host:
        raise ValueError(f"cannot read the first host of SLURM_NODELIST={nodelist!r}; set MASTER_ADDR to the host "
                         "of rank 0 or pass master_addr to fit_distributed")
    return host


def detect_external_launcher(env: Mapping[str, str], master_addr: Optional[str] = None,
                             master_port: Optional[int] = None) -> Optional[ProcessPlacement]:
    """The placement given by torchrun, SLURM or OpenMPI, or None when this process was started plainly.

    torchrun (and ``torch.distributed.launch``) set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT;
    these are the rendezvous torchrun prepared, so they win over ``master_addr``/``master_port``.
    SLURM sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and SLURM_NODELIST (the first node hosts rank 0).
    OpenMPI sets OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE and OMPI_COMM_WORLD_LOCAL_RANK and knows no
    rendezvous host: pass ``master_addr`` or set MASTER_ADDR. For both, the port comes from ``master_port``,
    MASTER_PORT, or 29500. A SLURM or OpenMPI job of a single task (``sbatch`` running ``python train.py``)
    launched nothing: fit_distributed then starts the processes itself.
    """
    def port(default: int = 29500) -> int:
        return int(master_port or env.get("MASTER_PORT") or default)

    if "RANK" in env and "WORLD_SIZE" in env and "LOCAL_RANK" in env:
        addr = env.get("MASTER_ADDR") or master_addr or "127.0.0.1"
        port_number = int(env.get("MASTER_PORT") or master_port or 29500)
        return ProcessPlacement(int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"]), addr, port_number,
                                "torchrun")
    if ("SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", 1)) > 1
            and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")):
        addr = master_addr or env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_NODELIST", "127.0.0.1"))
        return ProcessPlacement(int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), int(env["SLURM_NTASKS"]),
                                addr, port(), "slurm")
    if "OMPI_COMM_WORLD_RANK" in env and int(env.get("OMPI_COMM_WORLD_SIZE", 1)) > 1:
        addr = master_addr or env.get("MASTER_ADDR")
        if addr is None:
            if int(env["OMPI_COMM_WORLD_SIZE"]) > int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", 0) or 0):
                raise ValueError("running under OpenMPI across several nodes: pass master_addr=<host of rank 0> "
                                 "to fit_distributed or export MASTER_ADDR")
            addr = "127.0.0.1"
        return ProcessPlacement(int(env["OMPI_COMM_WORLD_RANK"]), int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)),
                                int(env["OMPI_COMM_WORLD_SIZE"]), addr, port(), "openmpi")
    return None


def current_external_placement(master_addr: Optional[str] = None,
                               master_port: Optional[int] = None) -> Optional[ProcessPlacement]:
    """:func:`detect_external_launcher` on this process's environment."""
    return detect_external_launcher(os.environ, master_addr, master_port)


class PortReservation:
    """A TCP port held for a job's rendezvous store, which rank 0 creates later, in another process.

    The port is bound and *listening*: no other socket can bind it then, ``SO_REUSEADDR`` or not (a port found free
    and released, or bound without listening, lets another job take it or share it). Rank 0's store serves on this
    very socket (``torch.distributed.TCPStore(..., master_listen_fd=...)``, see :meth:`fileno`), so the port is
    never free between the reservation and the store. Hold it until the job's processes are done; :meth:`close`
    (or leaving the ``with`` block) releases it.

    Args:
        port: the port; 0 picks a free one.
        host: the address to listen on (``'0.0.0.0'``: every interface, for the other nodes of a job).

    Raises:
        OSError: the port is taken already (``EADDRINUSE``).
    """

    def __init__(self, port: int = 0, host: str = "127.0.0.1"):
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            # Only lets the port be bound while connections of an earlier job linger (TIME_WAIT): a listening
            # socket is never shared on Linux, whatever the other socket's options.
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._socket.bind((host, port))
            self._socket.listen(128)
        except OSError:
            self._socket.close()
            raise
        self.port: int = self._socket.getsockname()[1]

    @property
    def socket(self) -> socket.socket:
        """The listening socket (handed to the process of rank 0, whose store serves on it)."""
        return self._socket

    def fileno(self) -> int:
        return self._socket.fileno()

    def close(self) -> None:
        self._socket.close()

    def __enter__(self) -> "PortReservation":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def job_master_port(env: Mapping[str, str], default: int = 29500) -> int:
    """The rendezvous port of a multi-node job launched without ``master_port``: the same on every node, and
    different for different jobs sharing a host. Derived from the job id (AITOOLBOX_RUN_ID, else SLURM_JOB_ID)
    into 29510..39509; ``default`` when the job has no id."""
    job = env.get("AITOOLBOX_RUN_ID") or env.get("SLURM_JOB_ID")
    if not job:
        return default
    return 29510 + zlib.crc32(job.encode("utf-8")) % 10000


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True
