"""Shared by the tracking-callback tests: a small training setup, a recorder of what the loop computed, a guard
that fails a test whose process tries to reach a non-local address, and a reader of W&B's offline run files.

MLflow's telemetry is switched off here, before any test imports mlflow.
"""
import glob
import ipaddress
import json
import os
import socket
import struct
import time
from typing import Dict, Iterator, List

import pytest
import torch
from torch import nn

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import MLP, classification_data, seeded_loader

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")

BATCHES_PER_EPOCH = 5  # 40 samples, batch size 8


def make_train_loop(loop_class=TrainLoop, optimizer_fn=None, test=False, dropout=0.3, **options) -> TrainLoop:
    """The MLP on 40 samples (5 batches an epoch) with a validation set and optionally a test set."""
    torch.manual_seed(0)
    model = MLP(dropout=dropout)
    optimizer = optimizer_fn(model) if optimizer_fn else torch.optim.SGD(model.parameters(), lr=0.1)
    return loop_class(model, seeded_loader(classification_data(40), batch_size=8),
                      seeded_loader(classification_data(16, seed=20), batch_size=8, shuffle=False),
                      seeded_loader(classification_data(12, seed=30), batch_size=8, shuffle=False) if test else None,
                      optimizer, nn.CrossEntropyLoss(), show_progress=False, **options)


class BatchRecorder(AbstractCallback):
    """Records, for every batch (by its global index), the epoch, the batch's loss and each group's learning rate
    in effect for it."""

    def __init__(self):
        super().__init__("batch recorder")
        self.batches: Dict[int, dict] = {}
        self._rates: List[float] = []

    def on_batch_begin(self):
        self._rates = [group["lr"] for optimizer in self.train_loop_obj.optimizers
                       for group in optimizer.param_groups]

    def on_batch_end(self):
        tl = self.train_loop_obj
        self.batches[tl.total_iteration_idx] = {"epoch": tl.epoch, "iteration": tl.iteration,
                                                "loss": tl.last_batch_loss.tolist(), "lrs": self._rates}

    def running_mean(self, step: int) -> float:
        """The mean loss of the epoch's batches up to ``step`` (float32 arithmetic, as the loop's)."""
        epoch = self.batches[step]["epoch"]
        losses = [record["loss"] for index, record in sorted(self.batches.items())
                  if record["epoch"] == epoch and index <= step]
        return (torch.tensor(losses, dtype=torch.float32).sum() / len(losses)).item()


# --- no network ------------------------------------------------------------------------------------------------
def _is_local(host) -> bool:
    if host in (None, "", "localhost") or isinstance(host, bytes) and host in (b"localhost",):
        return True
    try:
        return ipaddress.ip_address(host.decode() if isinstance(host, bytes) else str(host)).is_loopback
    except ValueError:
        return False


@pytest.fixture
def no_network(monkeypatch) -> Iterator[list]:
    """Refuse (and record) every connection or name lookup of this process that is not for a loopback address.

    Covers Python code (MLflow, the wandb client library); a separate process such as wandb-core is covered
    by the network-namespace test. The test fails at the end if anything tried.
    """
    attempts: list = []
    original_connect, original_connect_ex = socket.socket.connect, socket.socket.connect_ex
    original_getaddrinfo = socket.getaddrinfo

    def target_allowed(sock, address) -> bool:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return True  # Unix sockets: wandb's connection to its own service process
        return _is_local(address[0])

    def connect(sock, address):
        if not target_allowed(sock, address):
            attempts.append(("connect", address))
            raise ConnectionRefusedError(f"test guard: no connection to {address}")
        return original_connect(sock, address)

    def connect_ex(sock, address):
        if not target_allowed(sock, address):
            attempts.append(("connect_ex", address))
            return 111
        return original_connect_ex(sock, address)

    def getaddrinfo(host, *args, **kwargs):
        if not _is_local(host):
            attempts.append(("getaddrinfo", host))
            raise socket.gaierror(f"test guard: no name lookup of {host!r}")
        return original_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield attempts
    assert attempts == [], f"the test tried to reach the network: {attempts}"


# --- W&B offline runs ------------------------------------------------------------------------------------------
@pytest.fixture
def wandb_offline(tmp_path, monkeypatch) -> str:
    """W&B in offline mode with every folder it writes under tmp_path and its server address on a closed local
    port; returns WANDB_DIR."""
    pytest.importorskip("wandb")
    wandb_dir = tmp_path / "wandb_home"
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        path = wandb_dir / name.lower()
        path.mkdir(parents=True)
        monkeypatch.setenv(name, str(path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return str(wandb_dir / "wandb_dir")


def wandb_records(path: str) -> Iterator:
    """The records of a ``run-<id>.wandb`` file: W&B's log format (a 7-byte header, then 32 KiB blocks of
    chunks ``crc32 (4 bytes), length (2), type (1: full, 2: first, 3: middle, 4: last)``) holding
    ``wandb_internal_pb2.Record`` messages."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as handle:
        data = handle.read()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    block, position, pending = 32768, 7, b""
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # the block's tail is padding
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _item_key(item) -> str:
    return item.key or "/".join(item.nested_key)


def wait_for_exit_record(path: str, timeout_s: float = 20.0) -> None:
    """Wait until the run file holds its exit record: wandb's service process writes the file on its own schedule,
    and ``run.finish()`` may return before the last records are on disk."""
    deadline = time.monotonic() + timeout_s
    while not any(record.WhichOneof("record_type") == "exit" for record in wandb_records(path)):
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} has no exit record {timeout_s} s after the run finished")
        time.sleep(0.05)


class WandbRun:
    """What a finished offline run wrote: its run record, config, history rows by step, summary, alerts,
    artifacts and exit code."""

    def __init__(self, run_dir: str):
        (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
        wait_for_exit_record(path)
        self.path = path
        self.run = None
        self.config: dict = {}
        self.history: Dict[int, dict] = {}
        self.summary: dict = {}
        self.alerts: list = []
        self.artifacts: list = []
        self.exit_code = None
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                self.run = record.run
                self.config.update({_item_key(item): json.loads(item.value_json) for item in record.run.config.update})
            elif kind == "config":
                self.config.update({_item_key(item): json.loads(item.value_json) for item in record.config.update})
            elif kind == "history":
                row = {_item_key(item): json.loads(item.value_json) for item in record.history.item}
                self.history[row["_step"]] = row
            elif kind == "summary":
                self.summary.update({_item_key(item): json.loads(item.value_json) for item in record.summary.update})
            elif kind == "alert":
                self.alerts.append(record.alert)
            elif kind == "artifact":
                self.artifacts.append(record.artifact)
            elif kind == "exit":
                self.exit_code = record.exit.exit_code

    def values(self, key: str) -> Dict[int, float]:
        """``{step: value}`` of one logged key."""
        return {step: row[key] for step, row in sorted(self.history.items()) if key in row}


def offline_run_dirs(wandb_parent: str) -> List[str]:
    """The offline run folders in ``<wandb_parent>/wandb``, oldest first."""
    return sorted(glob.glob(os.path.join(str(wandb_parent), "wandb", "offline-run-*")))
