"""DataLoader workers of a training run leave stop signals to the training process: they start with the signals
blocked (torch's worker loop installs a SIGTERM handler that would kill them before ``worker_init_fn`` runs),
then ignore them while the run trains, and the loader is given back as it was. The whole behaviour, with real
signals to whole process groups, is in the fault matrix (tests/torchtrain/distributed/test_signal_matrix.py)."""
import multiprocessing
import signal

import pytest
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.train_loop.worker_signals import (
    WORKER_SIGNALS, WorkerLeavesStopSignals, shared_training_flag, shield_loader_workers, unshield_loader_workers)
from tests.torchtrain.distributed.support import PidFileWorkerInit, regression_data


def _report_blocked(queue) -> None:
    queue.put(sorted(int(signum) for signum in signal.pthread_sigmask(signal.SIG_BLOCK, [])))


@pytest.mark.parametrize("context", [None, "fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_a_shielded_loader_starts_workers_with_the_stop_signals_blocked_and_is_given_back(tmp_path, context):
    user_init = PidFileWorkerInit(tmp_path)
    loader = DataLoader(regression_data(8), batch_size=4, num_workers=2, worker_init_fn=user_init,
                        multiprocessing_context=context)
    own_context = loader.multiprocessing_context
    assert shield_loader_workers(loader, shared_training_flag())
    assert isinstance(loader.worker_init_fn, WorkerLeavesStopSignals) and loader.worker_init_fn.worker_init_fn is \
        user_init
    assert not shield_loader_workers(loader, shared_training_flag())  # once
    queue = multiprocessing.get_context("spawn").Queue()
    process = loader.multiprocessing_context.Process(target=_report_blocked, args=(queue,))
    process.start()
    blocked = queue.get(timeout=120)
    process.join(timeout=60)
    assert set(int(signum) for signum in WORKER_SIGNALS) <= set(blocked)
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # not in this process
    unshield_loader_workers(loader)
    assert loader.worker_init_fn is user_init and loader.multiprocessing_context is own_context


def test_a_loader_without_workers_is_left_alone():
    loader = DataLoader(regression_data(8), batch_size=4)
    assert not shield_loader_workers(loader, shared_training_flag())
    assert loader.worker_init_fn is None and loader.multiprocessing_context is None
