"""Training time with MLflow, W&B (offline) and e-mail callbacks whose services cannot be reached, against the
same run without them.

The run: the quickstart CNN on scikit-learn's digits (bundled, no download), Adam, batch 32 (40 batches an
epoch), 3 epochs per ``fit``, float32, TrainLoop's default end-of-epoch evaluation. ``services`` adds

* ``MLflowTracking`` at an endpoint on 127.0.0.1 that accepts connections and never answers (``--endpoint
  silent``, the default: every request waits for the client's 120 s timeout) or a closed port (``--endpoint
  closed``), logging every batch (three values) and every epoch;
* ``WandBTracking`` in offline mode (``WANDB_MODE=offline``, files in a temporary folder), every batch;
* ``EmailNotification`` with ``AWS_ENDPOINT_URL`` at the same endpoint: an e-mail per epoch and one at the end.

``plain`` runs the same loop without them. Both carry two clock callbacks (``execution_order`` -1e6 and +1e6,
so they run before and after every other callback of a hook): the **training time** of a ``fit`` is the sum over
its epochs of "first ``on_epoch_begin`` to last ``on_epoch_end``", which includes everything the callbacks do in
those hooks (queueing the values and e-mails, W&B's logging) and leaves out what happens once per ``fit``:
``wandb.init`` / ``finish`` and the bounded wait at the end of ``fit`` for what is still queued
(``flush_timeout_s``, per callback; ``--flush-timeout``, default 1 s here, 10 s in the library). The whole
``fit`` is timed too and shown beside it.

Each repeat builds fresh models with the same seed and runs ``plain`` and ``services`` once each, the order
alternating (A B, B A, ...); ``--warmup`` repeats run first untimed (W&B starts its service process then). After
each ``services`` run the callbacks drop what they could not send (``discard_unsent``), so later runs do not
share the machine with their retries. Target: the median training time of ``services`` within 5 % of
``plain``'s.

Run:  python benchmarks/unreachable_services.py                (about 1.5 minutes on 2 cores)
      python benchmarks/unreachable_services.py --quick        (smoke test: 1 repeat, 1 epoch)
"""
import argparse
import contextlib
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(0, str(_HERE.parent / "examples"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import _common  # noqa: E402
from quickstart import DigitsCNN, digits_loaders  # noqa: E402

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback  # noqa: E402
from aitoolbox.torchtrain.train_loop import TrainLoop  # noqa: E402

RATIO_TARGET = 1.05
HEADERS = ["run", "training s (median)", "ratio to plain", "whole fit s (median)", "training s per repeat"]


class SilentEndpoint:
    """A TCP server on 127.0.0.1 that accepts every connection, reads what is sent and never answers."""

    def __init__(self):
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._connections: List[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            self._connections.append(connection)
            threading.Thread(target=self._drain, args=(connection,), daemon=True).start()

    @staticmethod
    def _drain(connection: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while connection.recv(65536):
                pass

    def close(self) -> None:
        for sock in [self._listener, *self._connections]:
            with contextlib.suppress(OSError):
                sock.close()


def closed_port_url() -> str:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


class EpochClock(AbstractCallback):
    """One of a pair: at ``execution_order`` -1e6 it stamps each epoch's start, at +1e6 each epoch's end."""

    def __init__(self, stamps: List[float], first: bool):
        super().__init__("epoch clock", execution_order=-10 ** 6 if first else 10 ** 6)
        self.stamps, self.first = stamps, first

    def on_epoch_begin(self):
        if self.first:
            self.stamps.append(time.perf_counter())

    def on_epoch_end(self):
        if not self.first:
            self.stamps.append(time.perf_counter())


def service_environment(url: str, workdir: str) -> None:
    """Point boto3 and W&B at ``url`` / offline files in ``workdir``; nothing may leave 127.0.0.1."""
    wandb_dir = os.path.join(workdir, "wandb")
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        path = os.path.join(wandb_dir, name.lower())
        os.makedirs(path, exist_ok=True)
        os.environ[name] = path
    os.environ.update({
        "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true",
        "WANDB_BASE_URL": url, "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true",
        "AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "benchmark", "AWS_SECRET_ACCESS_KEY": "benchmark",
        "AWS_DEFAULT_REGION": "eu-west-1", "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.path.join(workdir, "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": os.path.join(workdir, "no-aws-credentials"),
    })
    os.environ.pop("WANDB_API_KEY", None)


def service_callbacks(url: str, workdir: str, run_index: int, flush_timeout_s: float) -> list:
    from aitoolbox.torchtrain.callbacks.email_notification import EmailNotification
    from aitoolbox.torchtrain.callbacks.mlflow import MLflowTracking
    from aitoolbox.torchtrain.callbacks.wandb import WandBTracking
    return [MLflowTracking(url, project_name="benchmark", experiment_name=f"run{run_index}", batch_log_frequency=1,
                           flush_timeout_s=flush_timeout_s),
            WandBTracking(batch_log_frequency=1, log_dir=os.path.join(workdir, f"wandb_run{run_index}"),
                          is_project=False, project_name="benchmark"),
            EmailNotification("Benchmark", "bot@example.com", "me@example.com", "benchmark", f"run{run_index}",
                              flush_timeout_s=flush_timeout_s)]


def run_once(args, with_services: bool, url: str, workdir: str, run_index: int) -> Dict[str, float]:
    """One ``fit`` of ``args.epochs`` epochs; returns its training time and whole-fit time in seconds."""
    torch.manual_seed(args.seed)
    train_loader, val_loader, test_loader = digits_loaders(32, args.seed)
    model = DigitsCNN()
    tl = TrainLoop(model, train_loader, val_loader, test_loader, torch.optim.Adam(model.parameters(), lr=2e-3),
                   nn.CrossEntropyLoss(), show_progress=False)
    begins: List[float] = []
    ends: List[float] = []
    services = service_callbacks(url, workdir, run_index, args.flush_timeout) if with_services else []
    start = time.perf_counter()
    tl.fit(num_epochs=args.epochs, callbacks=[EpochClock(begins, True), *services, EpochClock(ends, False)])
    whole = time.perf_counter() - start
    for callback in services:
        if hasattr(callback, "discard_unsent"):
            callback.discard_unsent()
    assert len(begins) == len(ends) == args.epochs, (begins, ends)
    return {"training": sum(end - begin for begin, end in zip(begins, ends)), "fit": whole}


def parse_args(argv: Optional[List[str]] = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="timed pairs (plain, services)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed pairs first")
    parser.add_argument("--endpoint", choices=("silent", "closed"), default="silent",
                        help="silent: accepts and never answers; closed: nothing listens")
    parser.add_argument("--flush-timeout", type=float, default=1.0,
                        help="the callbacks' flush_timeout_s: the wait at the end of each fit (library default 10)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 repeat of 1 epoch, no warm-up")
    parser.add_argument("--write-results", action="store_true",
                        help="replace the 'unreachable_services' section of benchmarks/RESULTS.md with this run")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.repeats, args.warmup = 1, 1, 0
    for name in ("epochs", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.flush_timeout < 0:
        parser.error("--warmup and --flush-timeout must be >= 0")
    return args


def main(argv: Optional[List[str]] = None) -> str:
    args = parse_args(argv)
    _common.set_threads(args.threads)
    info = _common.machine_info(torch.device("cpu"))
    workdir = tempfile.mkdtemp(prefix="aitoolbox-bench-services-")
    silent = SilentEndpoint() if args.endpoint == "silent" else None
    url = silent.url if silent is not None else closed_port_url()
    service_environment(url, workdir)
    times: Dict[str, Dict[str, List[float]]] = {name: {"training": [], "fit": []} for name in ("plain", "services")}
    try:
        with _common.stderr_to_devnull():  # the loop's epoch lines and the callbacks' warnings
            load_before = _common.load_average()
            for repeat in range(args.warmup + args.repeats):
                order = ("plain", "services") if repeat % 2 == 0 else ("services", "plain")
                for name in order:
                    measured = run_once(args, name == "services", url, workdir, repeat)
                    if repeat >= args.warmup:
                        for key, value in measured.items():
                            times[name][key].append(value)
            info["load average (1 min) before / after"] = f"{load_before} / {_common.load_average()}"
    finally:
        if silent is not None:
            silent.close()
        shutil.rmtree(workdir, ignore_errors=True)
    info["settings"] = (f"quickstart DigitsCNN on the digits, batch 32, {args.epochs} epochs per fit, "
                        f"{args.repeats} timed pairs after {args.warmup} warm-up, order alternating; endpoint: "
                        f"{args.endpoint} ({url}); flush_timeout_s={args.flush_timeout:g}")
    plain = _common.median(times["plain"]["training"])
    rows = []
    for name in ("plain", "services"):
        training = _common.median(times[name]["training"])
        rows.append([name, f"{training:.3f}", _common.fmt_ratio(training / plain),
                     f"{_common.median(times[name]['fit']):.3f}", _common.fmt_list(times[name]["training"])])
    ratio = _common.median(times["services"]["training"]) / plain
    paired = _common.median([s / p for s, p in zip(times["services"]["training"], times["plain"]["training"])])
    verdict = "met" if ratio <= RATIO_TARGET else "MISSED"
    lines = [f"- services / plain training time: {ratio:.3f} (of medians), {paired:.3f} (median of paired ratios); "
             f"target <= {RATIO_TARGET:.2f}: {verdict}",
             f"- whole fit: services {_common.median(times['services']['fit']):.3f} s against plain "
             f"{_common.median(times['plain']['fit']):.3f} s; the difference is wandb.init / finish and the bounded "
             f"wait at the end of fit ({args.flush_timeout:g} s per callback with something unsent)"]
    text = "\n".join([f"Command: `{_common.command_line()}`", "", _common.info_lines(info), "",
                      _common.markdown_table(HEADERS, rows), "", *lines, ""])
    print(text)
    if args.write_results:
        path = _common.update_results_section("unreachable_services", text)
        print(f"updated {path}")
    return text


if __name__ == "__main__":
    main()
