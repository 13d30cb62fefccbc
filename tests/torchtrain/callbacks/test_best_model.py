"""Keeping and using the best model (issue 35, item 1; issue 32, item 6): ``best_model_path`` / ``best_model_score`` of
the ranking checkpoint callbacks, ``load_best_model()`` and ``best_weights()``, the presets' ``checkpoint_callback``,
and ranking with ``end_auto_eval=N`` (epochs without a new value are not ranked, and not aborted on)."""
import copy
import json
import math
import os
import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.experiment.local_save.checkpoints import RANKING_FILE_NAME, list_checkpoints, prune_checkpoints
from aitoolbox.torchtrain.callbacks import ModelCheckpoint, ModelIterationCheckpoint
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.train_loop import TrainLoop, TrainLoopCheckpoint
from tests.helpers import MLP, classification_data


def loop_arguments():
    torch.manual_seed(0)
    model = MLP()
    train = DataLoader(classification_data(16), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))
    validation = DataLoader(classification_data(8, seed=3), batch_size=4)
    test = DataLoader(classification_data(8, seed=4), batch_size=4)
    return model, train, validation, test, torch.optim.Adam(model.parameters(), lr=1e-2), nn.CrossEntropyLoss()


def folder(root) -> dict:
    return dict(project_name="proj", experiment_name="exp", local_model_result_folder_path=str(root))


class Scripted(AbstractCallback):
    """Record ``values[epoch]`` as ``name`` (before the checkpoints run) and keep the weights of every epoch end."""

    def __init__(self, name, values):
        super().__init__("scripted metric", execution_order=50)
        self.name, self.values = name, values
        self.weights = {}

    def on_epoch_end(self):
        tl = self.train_loop_obj
        tl.insert_metric_result_into_history(self.name, self.values[tl.epoch])
        self.weights[tl.epoch] = copy.deepcopy(tl.model.state_dict())


def epoch_of(path: str) -> int:
    return int(re.search(r"_E(\d+)\.pth$", path).group(1))


def same_weights(state_a, state_b) -> bool:
    return state_a.keys() == state_b.keys() and all(torch.equal(state_a[key], state_b[key]) for key in state_a)


def predictions_with(model, weights, loader):
    probe = copy.deepcopy(model)
    probe.load_state_dict(weights)
    probe.eval()
    with torch.no_grad():
        return torch.cat([probe(x).argmax(dim=1) for x, _ in loader])


# --- best_model_path / best_model_score -----------------------------------------------------------------------
@pytest.mark.parametrize("metric, values, best", [("val_score", [0.5, 0.9, 0.4, 0.7], 1),
                                                  ("val_error", [0.5, 0.9, 0.1, 0.7], 2)],
                         ids=["higher-is-better", "lower-is-better"])
def test_best_model_path_and_score_follow_the_ranking(tmp_path, metric, values, best):
    tl = TrainLoop(*loop_arguments(), show_progress=False)
    checkpoint = ModelCheckpoint(**folder(tmp_path), rm_subopt_local_models=metric, num_best_checkpoints_kept=1)
    assert checkpoint.best_model_path is None and checkpoint.best_model_score is None  # not registered yet
    tl.fit(num_epochs=len(values), callbacks=[Scripted(metric, values), checkpoint])
    assert epoch_of(checkpoint.best_model_path) == best and checkpoint.best_model_score == values[best]
    assert os.path.isfile(checkpoint.best_model_path)
    kept = [epoch_of(path) for path in list_checkpoints(os.path.dirname(checkpoint.best_model_path))]
    assert kept == sorted({best, len(values) - 1})  # the best and the newest (for resuming)


def test_without_ranking_there_is_no_best_model(tmp_path):
    checkpoint = ModelCheckpoint(**folder(tmp_path))
    TrainLoop(*loop_arguments(), show_progress=False).fit(num_epochs=2, callbacks=[checkpoint])
    assert checkpoint.best_model_path is None and checkpoint.best_model_score is None
    with pytest.raises(ValueError, match="rm_subopt_local_models"):
        checkpoint.load_best_model()


def test_the_iteration_checkpoint_ranks_its_epoch_checkpoints_too(tmp_path):
    values = [0.2, 0.8, 0.5]
    checkpoint = ModelIterationCheckpoint(3, **folder(tmp_path), rm_subopt_local_models="val_score",
                                          num_best_checkpoints_kept=1)
    TrainLoop(*loop_arguments(), show_progress=False).fit(num_epochs=3, callbacks=[Scripted("val_score", values),
                                                                                     checkpoint])
    assert epoch_of(checkpoint.best_model_path) == 1 and checkpoint.best_model_score == 0.8


# --- using the best model -------------------------------------------------------------------------------------
def test_load_best_model_puts_the_best_epoch_weights_into_the_model_and_predictions_follow(tmp_path):
    values = [0.5, 0.9, 0.4, 0.7]
    model, *rest = loop_arguments()
    tl = TrainLoop(model, *rest, show_progress=False)
    scripted = Scripted("val_score", values)
    checkpoint = ModelCheckpoint(**folder(tmp_path), rm_subopt_local_models="val_score", num_best_checkpoints_kept=1)
    tl.fit(num_epochs=4, callbacks=[scripted, checkpoint])
    y_last, _, _ = tl.predict_on_test_set()  # cached for this iteration: the best weights must not get it
    assert torch.equal(y_last, predictions_with(model, scripted.weights[3], tl.test_loader))
    returned = checkpoint.load_best_model()
    assert returned is model and same_weights(model.state_dict(), scripted.weights[1])
    y_best, _, _ = tl.predict_on_test_set()
    assert torch.equal(y_best, predictions_with(model, scripted.weights[1], tl.test_loader))


def test_best_weights_predicts_with_the_best_and_puts_the_trained_weights_back(tmp_path):
    values = [0.5, 0.9, 0.4]
    model, *rest = loop_arguments()
    tl = TrainLoop(model, *rest, show_progress=False)
    scripted = Scripted("val_score", values)
    checkpoint = ModelCheckpoint(**folder(tmp_path), rm_subopt_local_models="val_score")
    tl.fit(num_epochs=3, callbacks=[scripted, checkpoint])
    trained = copy.deepcopy(model.state_dict())
    with checkpoint.best_weights(): y_best, _, _ = tl.predict_on_test_set()  # noqa: E701 - the one-liner the docs show
    assert torch.equal(y_best, predictions_with(model, scripted.weights[1], tl.test_loader))
    assert same_weights(model.state_dict(), trained)
    y_after, _, _ = tl.predict_on_test_set()
    assert torch.equal(y_after, predictions_with(model, trained, tl.test_loader))
    with pytest.raises(RuntimeError, match="inside"):
        with checkpoint.best_weights():
            raise RuntimeError("inside")
    assert same_weights(model.state_dict(), trained)  # put back after an exception too


def test_a_preset_hands_out_its_checkpoint_callback_and_a_resumed_run_knows_the_earlier_best(tmp_path):
    values = [0.3, 0.9, 0.4, 0.5, 0.6]

    def preset():
        return TrainLoopCheckpoint(*loop_arguments(), **folder(tmp_path), rm_subopt_local_models="val_score",
                                   num_best_checkpoints_kept=1, auto_resume=True, show_progress=False)

    first = preset()
    first.fit(num_epochs=2, callbacks=[Scripted("val_score", values)])
    assert epoch_of(first.checkpoint_callback.best_model_path) == 1
    resumed = preset()  # a new process would do this: it continues the run folder
    assert resumed.experiment_folder.path == first.experiment_folder.path
    assert resumed.checkpoint_callback.best_model_path == first.checkpoint_callback.best_model_path
    assert resumed.checkpoint_callback.best_model_score == 0.9
    resumed.fit(num_epochs=5, callbacks=[Scripted("val_score", values)])
    assert epoch_of(resumed.checkpoint_callback.best_model_path) == 1
    kept = [epoch_of(path) for path in list_checkpoints(first.experiment_folder.checkpoint_dir)]
    assert kept == [1, 4]


# --- issue 32, item 6: ranking with end_auto_eval=N -------------------------------------------------------------
def test_ranking_by_val_loss_with_end_auto_eval_every_two_epochs(tmp_path):
    tl = TrainLoop(*loop_arguments(), end_auto_eval=2, show_progress=False)
    checkpoint = ModelCheckpoint(**folder(tmp_path), rm_subopt_local_models=True, num_best_checkpoints_kept=1)
    tl.fit(num_epochs=5, callbacks=[checkpoint])  # used to abort at the first epoch end: val_loss not recorded yet
    val_loss = tl.train_history["val_loss"]  # epochs 1 and 3
    assert len(val_loss) == 2
    folder_path = checkpoint.experiment_folder.checkpoint_dir
    with open(os.path.join(folder_path, RANKING_FILE_NAME)) as handle:
        ranking = json.load(handle)
    scored = {epoch_of(name): score for score, name in ranking["checkpoints"] if not math.isnan(score)}
    # Each checkpoint has its own epoch's value, never an earlier epoch's still at the end of the history.
    best = 1 if val_loss[0] <= val_loss[1] else 3
    assert scored == {best: min(val_loss)}
    assert checkpoint.best_model_score == min(val_loss) and epoch_of(checkpoint.best_model_path) == best
    kept = [epoch_of(path) for path in list_checkpoints(folder_path)]
    assert kept == sorted({best, 4})  # the unranked checkpoints of epochs 0 and 2 went once newer ones were saved


def test_a_metric_recorded_every_other_epoch_is_ranked_at_its_own_epochs(tmp_path):
    class EveryOther(AbstractCallback):
        def __init__(self):
            super().__init__("every other epoch")

        def on_epoch_end(self):
            tl = self.train_loop_obj
            if tl.epoch % 2 == 0:  # a metric recorded at epochs 0, 2, 4 (0-based)
                tl.insert_metric_result_into_history("val_score", [0.7, 0.1, 0.2, 0.3, 0.5][tl.epoch])

    checkpoint = ModelCheckpoint(**folder(tmp_path), rm_subopt_local_models="val_score", num_best_checkpoints_kept=2)
    TrainLoop(*loop_arguments(), show_progress=False).fit(num_epochs=5, callbacks=[EveryOther(), checkpoint])
    assert sorted((epoch_of(path), score) for score, path in checkpoint.saved_checkpoints
                  if not math.isnan(score)) == [(0, 0.7), (4, 0.5)]
    # The two best (epochs 0 and 4, the newest too); epoch 2 (0.2) and the unranked 1 and 3 went.
    assert [epoch_of(path) for path in list_checkpoints(checkpoint.experiment_folder.checkpoint_dir)] == [0, 4]


def test_a_nan_score_is_never_the_best(tmp_path):
    paths = []
    for epoch in range(3):
        path = tmp_path / f"model_x_ts_E{epoch}.pth"
        path.write_bytes(b"x")
        paths.append(str(path))
    deleted = prune_checkpoints([(float("nan"), paths[0]), (0.5, paths[1]), (0.2, paths[2])], keep_best=2,
                                keep_always=[paths[2]], higher_is_better=True)
    assert deleted == [paths[0]]  # two places for the best, and still the NaN one goes


# --- fit_distributed: the launching process knows the best checkpoint -------------------------------------------
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_after_fit_distributed_the_launching_process_has_the_best_checkpoint_and_weights(tmp_path, monkeypatch):
    """Two CPU processes rank the checkpoints in the default run folder; the launcher reads the ranking, and
    EarlyStopping(restore_best_weights=True) returned the best epoch's weights, those of the best checkpoint."""
    from aitoolbox.torchtrain.callbacks import EarlyStopping
    monkeypatch.chdir(tmp_path)
    tl = TrainLoop(*loop_arguments(), show_progress=False)
    checkpoint = ModelCheckpoint(rm_subopt_local_models="val_score", num_best_checkpoints_kept=1)
    tl.fit_distributed(num_epochs=3, num_gpus=2, start_method="fork",
                       callbacks=[Scripted("val_score", [0.2, 0.9, 0.5]), checkpoint,
                                  EarlyStopping("val_score", patience=5, restore_best_weights=True)])
    assert checkpoint.best_model_path.startswith(str(tmp_path / "aitoolbox_runs" / "run_"))
    assert epoch_of(checkpoint.best_model_path) == 1 and checkpoint.best_model_score == 0.9
    saved = torch.load(checkpoint.best_model_path, weights_only=True)["model_state_dict"]
    assert same_weights(tl.model.state_dict(), saved)
