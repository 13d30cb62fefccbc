"""Models, data, callbacks and process checks shared by the fit_distributed tests.

Everything here is importable by name (``tests.torchtrain.distributed.support``) so that spawned processes
and the scripts the tests write can use it too. The tests run real processes over gloo on the CPU.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.model import TTModel
from aitoolbox.torchtrain.train_loop import TrainLoop

REPO_ROOT = Path(__file__).resolve().parents[3]
IN_FEATURES = 4


# --- models and data ----------------------------------------------------------------------------------------
class Regressor(TTModel):
    """4 -> 8 -> 1 MLP without dropout, so several processes compute exactly what one process would."""

    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(IN_FEATURES, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x)))

    def get_loss(self, batch_data, criterion, device):
        return criterion(self(batch_data[0].to(device)), batch_data[1].to(device))

    def get_predictions(self, batch_data, device):
        x, y, index = batch_data
        return self(x.to(device)).cpu(), y, {"index": index}


class BatchNormRegressor(Regressor):
    """The regressor with a BatchNorm1d layer between the two linear layers (for sync_bn)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.hidden(x))))


class IndexRecordingRegressor(Regressor):
    """Remembers the sample indices of every training batch, in order (evaluation batches are not recorded)."""

    def __init__(self):
        super().__init__()
        self.trained_indices: List[List[int]] = []

    def get_loss(self, batch_data, criterion, device):
        if self.training:
            self.trained_indices.append(batch_data[2].tolist())
        return super().get_loss(batch_data, criterion, device)


def regression_data(num_samples: int, seed: int = 0) -> TensorDataset:
    """``(x, y, index)`` samples of a noisy linear target; the index lets tests check prediction order."""
    generator = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(num_samples, IN_FEATURES, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(num_samples, 1, generator=generator)
    return TensorDataset(x, y, torch.arange(num_samples))


def make_model(model_class=Regressor, seed: int = 0) -> TTModel:
    torch.manual_seed(seed)
    return model_class()


def make_train_loop(model: Optional[TTModel] = None, batch_size: int = 4, train_samples: int = 32,
                    eval_samples: int = 35, shuffle: bool = False, lr: float = 0.1, **train_loop_options) -> TrainLoop:
    """A TrainLoop with SGD and a mean-reduced MSE loss; the validation and test sets hold ``eval_samples``."""
    model = make_model() if model is None else model
    train = DataLoader(regression_data(train_samples), batch_size=batch_size, shuffle=shuffle,
                       generator=torch.Generator().manual_seed(5) if shuffle else None)
    validation = DataLoader(regression_data(eval_samples, seed=1), batch_size=4)
    test = DataLoader(regression_data(eval_samples, seed=2), batch_size=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return TrainLoop(model, train, validation, test, optimizer, nn.MSELoss(), show_progress=False,
                     **train_loop_options)


# --- callbacks the processes run -------------------------------------------------------------------------------
class RecordRankResult(AbstractCallback):
    """At train end, in every rank: evaluate and predict (these are collectives), then save what the rank holds.

    Writes ``<folder>/rank<r>.pt`` with the weights, history, epoch, predictions and evaluation losses.
    """

    def __init__(self, folder: str):
        super().__init__("record rank result")
        self.folder = str(folder)

    def on_train_end(self):
        tl = self.train_loop_obj
        y_pred, y_true, metadata = tl.predict_on_test_set()
        record = {
            "rank": tl.strategy.rank,
            "world_size": tl.strategy.world_size,
            "state_dict": {k: v.detach().cpu().clone() for k, v in tl.model.state_dict().items()},
            "train_history": tl.train_history.get_train_history_dict(),
            "epoch": tl.epoch,
            "test_pred": y_pred, "test_true": y_true, "test_index": list(metadata["index"]),
            "loss_train": tl.evaluate_loss_on_train_set(float_dict_format=True),
            "loss_validation": tl.evaluate_loss_on_validation_set(float_dict_format=True),
            "loss_test": tl.evaluate_loss_on_test_set(float_dict_format=True),
            "module_types": sorted({type(module).__name__ for module in tl.model.modules()}),
            "is_main_process": tl.is_main_process,
            # None in the launching process: the callback stays registered there for a later (single-process) fit.
            "master_port": getattr(getattr(tl.strategy, "placement", None), "master_port", None),
            "trained_indices": getattr(tl.model, "trained_indices", None),
            "pid": os.getpid(),
        }
        torch.save(record, os.path.join(self.folder, f"rank{tl.strategy.rank}.pt"))


def load_rank_results(folder, world_size: int = 2) -> List[dict]:
    return [torch.load(os.path.join(str(folder), f"rank{rank}.pt"), weights_only=False) for rank in range(world_size)]


class BuildLoadersInProcess(AbstractCallback):
    """``in_process_data_load``: each process builds its own loaders (here: ``num_samples`` training samples)."""

    def __init__(self, num_samples: int):
        super().__init__("build loaders in process")
        self.num_samples = num_samples

    def on_multiprocess_start(self):
        tl = self.train_loop_obj
        tl.train_loader = DataLoader(regression_data(self.num_samples), batch_size=4)
        tl.test_loader = DataLoader(regression_data(self.num_samples, seed=2), batch_size=4)


class RecordPid(AbstractCallback):
    """Writes this rank's pid to ``<folder>/pid-rank<r>`` at train begin (to check that it is gone later)."""

    def __init__(self, folder: str):
        super().__init__("record pid")
        self.folder = str(folder)

    def on_train_begin(self):
        Path(self.folder, f"pid-rank{self.train_loop_obj.strategy.rank}").write_text(str(os.getpid()))


class FailOnRank(AbstractCallback):
    """At the start of ``epoch`` on ``rank``: raise a ValueError (``how='raise'``), die by SIGKILL (``'kill'``),
    or exit at once with code 3 without any report or clean-up (``'exit'``, like a crash in native code)."""

    def __init__(self, rank: int, epoch: int, how: str = "raise"):
        super().__init__("fail on rank")
        self.rank = rank
        self.epoch = epoch
        self.how = how

    def on_epoch_begin(self):
        tl = self.train_loop_obj
        if tl.strategy.rank != self.rank or tl.epoch != self.epoch:
            return
        if self.how == "raise":
            raise ValueError(f"deliberate failure on rank {self.rank} at epoch {self.epoch}")
        if self.how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)


class PidFileWorkerInit:
    """DataLoader ``worker_init_fn`` that writes each worker's pid into ``folder``."""

    def __init__(self, folder: str):
        self.folder = str(folder)

    def __call__(self, worker_id: int) -> None:
        Path(self.folder, f"pid-worker-{os.getpid()}").write_text(str(os.getpid()))


# --- processes -------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_environments(world_size: int = 2) -> List[dict]:
    """The environment torchrun gives each of ``world_size`` processes on this machine (a free port for the job)."""
    port = str(free_port())
    return [{"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": port} for rank in range(world_size)]


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def recorded_pids(folder) -> Dict[str, int]:
    return {path.name: int(path.read_text()) for path in Path(folder).glob("pid-*")}


def wait_until_gone(pids: Iterable[int], timeout_s: float = 60.0) -> List[int]:
    """Wait until none of ``pids`` runs; return those still running at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pid for pid in pids if process_alive(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def child_pids(pid: Optional[int] = None) -> List[int]:
    """Running direct children of ``pid`` (default: this process), read from /proc."""
    pid = os.getpid() if pid is None else pid
    children = []
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_path.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            children.append(int(stat_path.parent.name))
    return children


def run_script(script: Path, args: Sequence[str] = (), env: Optional[dict] = None, timeout: float = 300.0,
               cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    """Run ``python script args`` with the repository importable; return the finished process (text output)."""
    return subprocess.run([sys.executable, str(script), *args], env=script_env(env), timeout=timeout,
                          capture_output=True, text=True, cwd=str(cwd or script.parent))


def run_scripts_together(commands: Sequence[Sequence[str]], envs: Sequence[Optional[dict]],
                         timeout: float = 300.0) -> List[tuple]:
    """Start ``python *command`` for each command at once (the nodes or ranks of one job, each with
    ``script_env(env)``), wait for all, and require every one to succeed; returns their ``(stdout, stderr)``.
    None left running after."""
    processes = [subprocess.Popen([sys.executable, *map(str, command)], env=script_env(env), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for command, env in zip(commands, envs)]
    try:
        outputs = [process.communicate(timeout=timeout) for process in processes]
    finally:
        for process in processes:
            process.kill()
    for process, (_, stderr) in zip(processes, outputs):
        assert process.returncode == 0, stderr
    return outputs


def script_env(extra: Optional[dict] = None) -> dict:
    """This environment without distributed-launcher variables, with the repository on PYTHONPATH."""
    launcher_prefixes = ("SLURM_", "OMPI_", "PMI_", "TORCHELASTIC_")
    launcher_names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "GROUP_RANK", "ROLE_RANK"}
    env = {k: v for k, v in os.environ.items()
           if k not in launcher_names and not k.startswith(launcher_prefixes)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def assert_state_dicts_equal(a: dict, b: dict) -> None:
    """Bitwise equality of two state dicts."""
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name].cpu(), b[name].cpu()), f"{name} differs"


def assert_state_dicts_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        difference = (a[name].double().cpu() - b[name].double().cpu()).abs().max().item()
        assert difference <= atol, f"{name} differs by {difference}"


# --- seed 000: the multi-device snippet of aitoolbox's mixed-precision guide -------------------------------------
# The user code around it: imports, a small TTModel CNN, and the 8x8 digits data set (scikit-learn ships it).
SEED_PRELUDE = '''
import torch
from torch import nn, optim
from torch.utils.data import DataLoader, TensorDataset
from sklearn.datasets import load_digits

from aitoolbox.torchtrain.model import TTModel


class CNNModel(TTModel):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, kernel_size=3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        x = nn.functional.max_pool2d(torch.relu(self.conv(x)), 2)
        return torch.log_softmax(self.fc(torch.flatten(x, 1)), dim=1)

    def get_loss(self, batch_data, criterion, device):
        x, y = batch_data
        return criterion(self(x.to(device)), y.to(device))

    def get_predictions(self, batch_data, device):
        x, y = batch_data
        return self(x.to(device)).argmax(dim=1).cpu(), y, None


digits = load_digits()
images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
labels = torch.tensor(digits.target)
train_set = TensorDataset(images[:600], labels[:600])
val_set = TensorDataset(images[600:800], labels[600:800])
test_set = TensorDataset(images[800:1000], labels[800:1000])
'''

# Verbatim from seed 000 (its 4-space indentation included), with the DataLoader(...) placeholders filled in.
SEED_SNIPPET = '''
    from aitoolbox.torchtrain.train_loop import *


    train_loader = DataLoader(train_set, batch_size=20, shuffle=True)
    val_loader = DataLoader(val_set, batch_size=50)
    test_loader = DataLoader(test_set, batch_size=50)

    model = CNNModel()  # TTModel based neural model

    optimizer = optim.Adam(model.parameters(), lr=0.001, betas=(0.9, 0.999))
    criterion = nn.NLLLoss()

    tl = TrainLoop(model,
                   train_loader, val_loader, test_loader,
                   optimizer, criterion,
                   use_amp=True)

    model = tl.fit_distributed(num_epochs=10,
                               amp_init_args={'opt_level': 'O1'},
                               num_nodes=1, node_rank=0, num_gpus=torch.cuda.device_count())
'''

# After the snippet: one line the tests parse.
SEED_REPORT = '''
    import json, multiprocessing
    y_pred, y_true, _ = tl.predict_on_validation_set()
    print("RESULT " + json.dumps({
        "model_class": type(model).__name__, "same_model": model is tl.model, "epoch": tl.epoch,
        "loss": tl.train_history["loss"], "val_loss": tl.train_history["val_loss"],
        "val_accuracy": (y_pred == y_true).float().mean().item(),
        "active_children": len(multiprocessing.active_children())}))
'''


def seed_script() -> str:
    """The seed program as a script: user code at the top, the snippet under the ``__main__`` guard."""
    return SEED_PRELUDE + '\nif __name__ == "__main__":\n' + SEED_SNIPPET + SEED_REPORT


def seed_result(output: str) -> dict:
    """The RESULT line the seed program printed."""
    found = re.findall(r"RESULT (\{.*\})", output)  # progress bars may share its line (carriage returns)
    assert len(found) == 1, output[-3000:]
    return json.loads(found[0])


def check_seed_result(result: dict) -> None:
    """The snippet returned the trained model and the TrainLoop holds rank 0's 10 epochs."""
    assert result["model_class"] == "CNNModel" and result["same_model"]
    assert result["epoch"] == 9 and len(result["loss"]) == len(result["val_loss"]) == 10
    assert result["loss"][-1] < 0.8 * result["loss"][0]
    assert result["val_accuracy"] > 0.5  # 10 classes: chance is 0.1
    assert result["active_children"] == 0
