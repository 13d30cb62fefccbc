"""Early stopping across checkpoints (issue 22, item 8): a resumed run stops at the epoch the straight run stops at,
a stopped run's checkpoint records that training ended, and a requeued job of a stopped run trains nothing and
leaves its final model as it was."""
import glob
import io
import json
import logging
import os
import runpy
import subprocess
import sys

import pytest
import torch
from torch import nn

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.stopping import EarlyStopping, ThresholdEarlyStopping
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import MLP, classification_data, seeded_loader, single_torch_thread

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "requeue_script.py")
SCORES = [1.0, 0.8, 0.9, 0.85, 0.7, 0.6, 0.5, 0.4]  # patience 1 (mode min): the straight run stops at epoch index 3 ("epoch 4" in messages)


class Scores(AbstractCallback):
    """Records ``SCORES[epoch]`` as ``val_score``, and the epochs trained."""

    def __init__(self):
        super().__init__("scores", execution_order=-10)
        self.trained_epochs = []

    def on_epoch_begin(self):
        self.trained_epochs.append(self.train_loop_obj.epoch)

    def on_epoch_end(self):
        self.train_loop_obj.insert_metric_result_into_history("val_score", SCORES[self.train_loop_obj.epoch])


class CheckpointAt(AbstractCallback):
    """Keeps the epoch-end checkpoint of ``epoch``, taken after the other callbacks (as ModelCheckpoint's is) and
    read back as from a file (``checkpoint_state`` returns the model's live tensors)."""

    def __init__(self, epoch):
        super().__init__("checkpoint", execution_order=100)
        self.epoch, self.checkpoint = epoch, None

    def on_epoch_end(self):
        if self.train_loop_obj.epoch == self.epoch:
            buffer = io.BytesIO()
            torch.save(self.train_loop_obj.checkpoint_state(), buffer)
            buffer.seek(0)
            self.checkpoint = torch.load(buffer, weights_only=True)


def make_loop() -> TrainLoop:
    torch.manual_seed(0)
    model = MLP()
    return TrainLoop(model, seeded_loader(classification_data(40)), None, None,
                     torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), show_progress=False)


def test_a_run_resumed_from_a_checkpoint_stops_at_the_straight_runs_epoch():
    straight, scores, keep = make_loop(), Scores(), CheckpointAt(1)
    straight.fit(num_epochs=len(SCORES), callbacks=[scores, EarlyStopping("val_score", patience=1, mode="min"), keep])
    assert scores.trained_epochs == [0, 1, 2, 3] and straight.early_stop

    resumed, resumed_scores = make_loop(), Scores()
    resumed.load_checkpoint(keep.checkpoint)
    resumed.fit(num_epochs=len(SCORES), callbacks=[resumed_scores, EarlyStopping("val_score", patience=1, mode="min")])
    assert resumed_scores.trained_epochs == [2, 3] and resumed.epoch == 3 and resumed.early_stop
    for name, value in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value)


def test_a_stopped_runs_checkpoint_says_so_and_a_fit_from_it_trains_nothing(caplog):
    tl, keep = make_loop(), CheckpointAt(3)
    tl.fit(num_epochs=len(SCORES), callbacks=[Scores(), EarlyStopping("val_score", patience=1, mode="min"), keep])
    checkpoint = keep.checkpoint
    assert checkpoint["early_stop"] is True and checkpoint["epochs_completed"] == 4
    # After fit the run stands at an epoch boundary: a mid-epoch checkpoint there is the epoch-end one, stop included
    # (it recorded the finished epoch's batches inside a next epoch, and no stop).
    after_fit = tl.checkpoint_state(mid_epoch=True)
    assert after_fit["early_stop"] is True and (after_fit["epochs_completed"], after_fit["iteration"]) == (4, 0)

    requeued, scores = make_loop(), Scores()
    requeued.load_checkpoint(checkpoint)
    weights = {name: value.clone() for name, value in requeued.model.state_dict().items()}
    with caplog.at_level(logging.WARNING, logger="aitoolbox"):
        logging.getLogger("aitoolbox").propagate = True
        try:
            returned = requeued.fit(num_epochs=len(SCORES), callbacks=[scores])
        finally:
            logging.getLogger("aitoolbox").propagate = False
    assert scores.trained_epochs == [] and returned is requeued.model
    assert all(torch.equal(requeued.model.state_dict()[name], value) for name, value in weights.items())
    assert "stopped at epoch 4" in caplog.text and "tl.early_stop = False" in caplog.text

    requeued.early_stop = False  # the documented way to train a stopped run further
    requeued.fit(num_epochs=5, callbacks=[])
    assert scores.trained_epochs == [4]


def test_a_checkpoint_without_the_flag_loads_as_a_run_not_stopped():
    tl, keep = make_loop(), CheckpointAt(3)
    tl.fit(num_epochs=len(SCORES), callbacks=[Scores(), EarlyStopping("val_score", patience=1, mode="min"), keep])
    older = {key: value for key, value in keep.checkpoint.items() if key != "early_stop"}  # as before this flag
    resumed, scores = make_loop(), Scores()
    resumed.load_checkpoint(older)
    resumed.fit(num_epochs=5, callbacks=[scores])
    assert scores.trained_epochs == [4]


def test_a_second_fit_after_a_stop_trains_nothing_as_one_fit_would():
    tl, scores = make_loop(), Scores()
    tl.fit(num_epochs=len(SCORES), callbacks=[scores, EarlyStopping("val_score", patience=1, mode="min")])
    tl.fit(num_epochs=len(SCORES))
    assert scores.trained_epochs == [0, 1, 2, 3]


def test_loading_a_checkpoint_leaves_the_dict_as_it_was():
    tl, keep = make_loop(), CheckpointAt(1)
    tl.fit(num_epochs=2, callbacks=[keep])
    checkpoint = keep.checkpoint
    saved_history = {name: list(values) for name, values in checkpoint["train_history"].items()}
    resumed = make_loop()
    resumed.load_checkpoint(checkpoint)
    resumed.fit(num_epochs=4)
    assert checkpoint["train_history"] == saved_history  # the loop appended to lists of its own


def test_stopping_states_count_against_the_resumed_patience_and_refuse_another_metric(caplog):
    early = EarlyStopping("val_loss", patience=3)
    early.patience_count, early.best_performance, early.best_epoch = 1, 0.5, 4  # two epochs without improvement
    state = early.state_dict()
    assert state["epochs_without_improvement"] == 2
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == state

    longer = EarlyStopping("val_loss", patience=5)
    longer.load_state_dict(state)
    assert (longer.patience_count, longer.best_performance, longer.best_epoch) == (3, 0.5, 4)

    other = EarlyStopping("val_Accuracy", patience=3)
    logging.getLogger("aitoolbox").propagate = True
    try:
        with caplog.at_level(logging.WARNING, logger="aitoolbox"):
            other.load_state_dict(state)
    finally:
        logging.getLogger("aitoolbox").propagate = False
    assert other.best_performance is None and other.patience_count == 3
    assert "starts afresh" in caplog.text

    threshold = ThresholdEarlyStopping("val_loss", 0.3, patience=2)
    threshold.patience_count = 0
    resumed = ThresholdEarlyStopping("val_loss", 0.3, patience=4)
    resumed.load_state_dict(threshold.state_dict())
    assert resumed.patience_count == 2


def run_job(folder, **environment) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPOSITORY, **environment)
    return subprocess.run([sys.executable, SCRIPT, str(folder)], capture_output=True, text=True, env=env,
                          timeout=600)


@pytest.mark.slow
@pytest.mark.extended
def test_a_requeued_job_resumes_to_the_same_stop_and_then_keeps_its_final_model(tmp_path):
    straight = runpy.run_path(SCRIPT)["main"](str(tmp_path / "straight"))
    assert straight["trained_epochs"] == [0, 1, 2, 3]
    straight_model = torch.load(glob.glob(os.path.join(straight["folder"], "model", "*.pth"))[0], weights_only=True)

    preempted = run_job(tmp_path / "job", DIE_AT_EPOCH="2")  # killed after the checkpoint of epoch 1
    assert preempted.returncode == 3, preempted.stderr
    first = run_job(tmp_path / "job")
    assert first.returncode == 0, first.stderr
    resumed = json.loads(first.stdout.strip().splitlines()[-1])
    assert resumed["trained_epochs"] == [2, 3] and resumed["early_stop"]  # stops where the straight run did
    [final_path] = glob.glob(os.path.join(resumed["folder"], "model", "*.pth"))
    final = torch.load(final_path, weights_only=True)
    for name, value in straight_model["model_state_dict"].items():
        assert torch.equal(final["model_state_dict"][name], value)

    with open(final_path, "rb") as file:
        final_bytes = file.read()
    modified = os.stat(final_path).st_mtime_ns
    second = run_job(tmp_path / "job")  # the job is requeued once more after it finished
    assert second.returncode == 0, second.stderr
    again = json.loads(second.stdout.strip().splitlines()[-1])
    assert again["trained_epochs"] == [] and again["folder"] == resumed["folder"]
    with open(final_path, "rb") as file:
        assert file.read() == final_bytes
    assert os.stat(final_path).st_mtime_ns == modified


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_fit_distributed_stops_on_every_rank_and_its_next_call_trains_nothing():
    from tests.torchtrain.distributed.support import make_train_loop
    tl = make_train_loop()
    tl.fit_distributed(num_epochs=len(SCORES), callbacks=[Scores(), EarlyStopping("val_score", patience=1, mode="min")],
                       num_gpus=2, start_method="fork")
    assert tl.epoch == 3 and tl.epochs_completed == 4 and tl.early_stop  # both ranks stopped with rank 0
    weights = {name: value.clone() for name, value in tl.model.state_dict().items()}
    tl.fit_distributed(num_epochs=len(SCORES), num_gpus=2, start_method="fork")  # no process is started
    assert tl.epochs_completed == 4
    assert all(torch.equal(tl.model.state_dict()[name], value) for name, value in weights.items())
    assert tl.checkpoint_state()["early_stop"] is True
