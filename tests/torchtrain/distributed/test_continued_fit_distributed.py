"""Issue 35 item 4: a continued ``fit_distributed`` keeps the run whole, as two ``fit`` calls do: the experiment
folder of callbacks given their own experiment details is the one the first call's processes created (not a
second ``<name>_1``), and a call with nothing left to train answers in the launching process, starting none."""
import logging
import multiprocessing
import os
import time

import pytest

from aitoolbox.torchtrain.callbacks.model_save import ModelCheckpoint
from aitoolbox.torchtrain.callbacks.tensorboard import TensorboardFullTracking
from tests.torchtrain.distributed.support import make_train_loop

pytestmark = [pytest.mark.filterwarnings("ignore:CUDA is not available"), pytest.mark.slow]  # fit_distributed runs


def experiment(folder) -> dict:
    return {"project_name": "proj", "experiment_name": "exp", "local_model_result_folder_path": str(folder)}


def run_folders(folder) -> list:
    return sorted(os.listdir(folder / "proj"))


@pytest.mark.parametrize("callbacks_again", [False, True], ids=["callbacks-once", "callbacks-every-call"])
def test_two_fit_distributed_calls_keep_one_experiment_folder(tmp_path, callbacks_again):
    def callbacks():
        return [ModelCheckpoint(**experiment(tmp_path)), TensorboardFullTracking(**experiment(tmp_path))]

    tl = make_train_loop()
    tl.fit_distributed(num_epochs=2, callbacks=callbacks(), num_cpu_processes=2, start_method="fork")
    (first,) = run_folders(tmp_path)
    tl.fit_distributed(num_epochs=3, callbacks=callbacks() if callbacks_again else None, num_cpu_processes=2,
                       start_method="fork")
    assert run_folders(tmp_path) == [first]
    timestamp = first[len("exp_"):]
    run = tmp_path / "proj" / first
    checkpoints = sorted(name for name in os.listdir(run / "checkpoint_model") if name.endswith(".pth"))
    assert checkpoints == [f"model_exp_{timestamp}_E{epoch}.pth" for epoch in range(3)]
    assert os.listdir(run / "tensorboard")  # the TensorBoard files are in the same run folder


def test_a_fit_distributed_with_nothing_left_to_train_starts_no_process(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    tl = make_train_loop()
    tl.fit_distributed(num_epochs=1, callbacks=[ModelCheckpoint(**experiment(tmp_path))], num_cpu_processes=2,
                       start_method="fork")
    weights = {name: value.clone() for name, value in tl.model.state_dict().items()}
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        model = tl.fit_distributed(num_epochs=1, num_cpu_processes=2, start_method="fork")
    assert time.monotonic() - started < 2.0  # answered here: starting two processes takes far longer
    assert multiprocessing.active_children() == []
    assert caplog.text.count("Nothing to train") == 1
    assert model is tl.model and all((weights[name] == value).all() for name, value in model.state_dict().items())
    assert run_folders(tmp_path) and len(run_folders(tmp_path)) == 1
