"""Checkpoint files of an experiment: names, ordering by training progress, finding the newest, pruning."""
import os

import pytest
import torch

from aitoolbox.experiment.local_save.atomic import TEMP_PREFIX, torch_save_atomic
from aitoolbox.experiment.local_save.checkpoints import (
    checkpoint_file_name, checkpoint_position, find_checkpoint, list_checkpoints, load_checkpoint_file,
    prune_checkpoints, save_checkpoint_file)
from aitoolbox.experiment.local_save.safe_load import CorruptCheckpointError


def test_file_names_follow_aitoolbox():
    assert checkpoint_file_name("exp", "2026-01-02_03-04-05", 3) == "model_exp_2026-01-02_03-04-05_E3.pth"
    # An iteration checkpoint carries the run's iteration index, as aitoolbox 1.x named them.
    assert checkpoint_file_name("exp", "ts", 3, 77) == "model_exp_ts_E3_ITER77.pth"


def test_positions_order_epoch_and_iteration_checkpoints_by_training_progress():
    names = ["model_e_ts_E10.pth", "model_e_ts_E0_ITER4.pth", "model_e_ts_E2.pth", "model_e_ts_E1_ITER18.pth",
             "model_e_ts_E0.pth", "model_e_ts_E9.pth", "model_e_ts_E1_ITER14.pth"]
    ordered = sorted(names, key=checkpoint_position)
    # E<k> is the end of epoch k, after every mid-epoch checkpoint of that epoch; numbers compare as numbers.
    assert ordered == ["model_e_ts_E0_ITER4.pth", "model_e_ts_E0.pth", "model_e_ts_E1_ITER14.pth",
                       "model_e_ts_E1_ITER18.pth", "model_e_ts_E2.pth", "model_e_ts_E9.pth", "model_e_ts_E10.pth"]
    # Names of this package's first format (_I<batches done in the epoch>) still order.
    assert sorted(["model_e_ts_E1.pth", "model_e_ts_E1_I3.pth"], key=checkpoint_position)[0] == "model_e_ts_E1_I3.pth"
    # The final model ModelTrainEndSave writes (model/model_<experiment>_<timestamp>.pth) comes after them all.
    assert sorted(names + ["model_e_ts.pth"], key=checkpoint_position)[-1] == "model_e_ts.pth"
    for other in ("hyperparams.json", "model_e_ts_E1.pth.bak", f"{TEMP_PREFIX}model_e_ts_E3.pth.x1",
                  f"{TEMP_PREFIX}model_e_ts.pth.x2"):
        assert checkpoint_position(other) is None


def _write(folder, name, epoch):
    os.makedirs(folder, exist_ok=True)
    torch_save_atomic({"model": {"w": torch.full((2,), float(epoch))}, "epoch": epoch}, os.path.join(folder, name))


def test_find_checkpoint_takes_the_newest_of_a_run_or_checkpoint_folder(tmp_path):
    run = tmp_path / "exp_ts"
    folder = run / "checkpoint_model"
    for epoch in (0, 1, 2):
        _write(folder, f"model_exp_ts_E{epoch}.pth", epoch)
    _write(folder, "model_exp_ts_E2_I3.pth", 2)  # older than the end of epoch 2
    (folder / f"{TEMP_PREFIX}model_exp_ts_E3.pth.abc").write_bytes(b"half a checkpoint")  # a killed write
    (folder / "notes.txt").write_text("ignored")
    newest = str(folder / "model_exp_ts_E2.pth")
    assert find_checkpoint(str(run)) == newest
    assert find_checkpoint(str(folder)) == newest
    assert find_checkpoint(str(folder / "model_exp_ts_E0.pth")) == str(folder / "model_exp_ts_E0.pth")
    assert [os.path.basename(p) for p in list_checkpoints(str(folder))] == [
        "model_exp_ts_E0.pth", "model_exp_ts_E1.pth", "model_exp_ts_E2_I3.pth", "model_exp_ts_E2.pth"]
    assert load_checkpoint_file(str(run))["epoch"] == 2
    assert list_checkpoints(str(tmp_path / "absent")) == []


def test_missing_checkpoints_are_reported_with_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint file or experiment folder at .*nowhere"):
        find_checkpoint(str(tmp_path / "nowhere"))
    (tmp_path / "empty" / "checkpoint_model").mkdir(parents=True)
    (tmp_path / "empty" / "checkpoint_model" / f"{TEMP_PREFIX}model_e_ts_E0.pth.x").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no checkpoint .* in .*empty"):
        find_checkpoint(str(tmp_path / "empty"))


def test_loading_a_damaged_or_foreign_file_names_it(tmp_path):
    folder = tmp_path / "checkpoint_model"
    _write(folder, "model_e_ts_E0.pth", 0)
    newest = folder / "model_e_ts_E1.pth"
    _write(folder, newest.name, 1)
    newest.write_bytes(newest.read_bytes()[:100])  # truncated by something that did not write atomically
    with pytest.raises(CorruptCheckpointError, match=f"cannot read checkpoint {newest}: it is corrupt"):
        load_checkpoint_file(str(tmp_path))
    torch.save([1, 2, 3], str(newest))
    with pytest.raises(ValueError, match=f"cannot read checkpoint {newest}: .* not an aitoolbox checkpoint"):
        load_checkpoint_file(str(tmp_path))


def test_save_checkpoint_file_creates_the_folder(tmp_path):
    path = save_checkpoint_file({"model_state_dict": {}}, str(tmp_path / "a" / "b"), "model_e_ts_E0.pth")
    assert path == str(tmp_path / "a" / "b" / "model_e_ts_E0.pth")
    assert load_checkpoint_file(path) == {"model_state_dict": {}}


def test_files_of_the_first_format_load_with_the_1x_key_names(tmp_path):
    weights, optimizer_state = {"w": torch.ones(2)}, {"state": {}, "param_groups": []}
    path = save_checkpoint_file({"model": weights, "optimizers": [optimizer_state], "total_iteration_idx": 12},
                                str(tmp_path), "model_e_ts_E0.pth")
    loaded = load_checkpoint_file(path)
    assert set(loaded) == {"model_state_dict", "optimizer_state_dict", "total_iteration_idx", "iteration_idx"}
    assert torch.equal(loaded["model_state_dict"]["w"], weights["w"])
    assert loaded["optimizer_state_dict"] == optimizer_state and loaded["iteration_idx"] == 11


@pytest.mark.parametrize("higher_is_better, kept", [(False, {"e1", "e3", "e4"}), (True, {"e2", "e4"})])
def test_prune_keeps_the_best_and_the_always_kept(tmp_path, higher_is_better, kept):
    scores = [0.5, 0.2, 0.9, 0.1, 0.7]
    scored = []
    for index, score in enumerate(scores):
        path = tmp_path / f"e{index}"
        path.write_bytes(b"x")
        scored.append((score, str(path)))
    deleted = prune_checkpoints(scored, keep_best=2, keep_always=[str(tmp_path / "e4")],
                                higher_is_better=higher_is_better)
    assert set(os.listdir(tmp_path)) == kept
    assert {os.path.basename(p) for p in deleted} == {f"e{i}" for i in range(5)} - kept


def test_the_checkpoint_ranking_is_read_back_for_its_metric_and_existing_checkpoints_only(tmp_path, caplog,
                                                                                         monkeypatch):
    import logging

    from aitoolbox.experiment.local_save.checkpoints import (
        RANKING_FILE_NAME, read_checkpoint_ranking, write_checkpoint_ranking)
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    folder = str(tmp_path)
    kept, pruned = os.path.join(folder, "model_e_t_E1.pth"), os.path.join(folder, "model_e_t_E0.pth")
    torch.save({}, kept)
    write_checkpoint_ranking(folder, "val_loss", [(0.5, pruned), (0.25, kept), (0.1, "/elsewhere/model_e_t_E9.pth")])
    assert read_checkpoint_ranking(folder, "val_loss") == [(0.25, kept)]  # E0 is gone; other folders not recorded
    assert read_checkpoint_ranking(folder, "val_acc") == []  # ranked by another metric: nothing is pruned
    assert read_checkpoint_ranking(str(tmp_path / "empty"), "val_loss") == []

    with open(os.path.join(folder, RANKING_FILE_NAME), "w") as handle:
        handle.write('{"metric": "val_loss", "checkpoints": [[0.2')  # cut off
    with caplog.at_level(logging.WARNING, logger="aitoolbox"):
        assert read_checkpoint_ranking(folder, "val_loss") == []
    assert "cannot be read" in caplog.text and os.path.isfile(kept)


def test_a_ranking_record_naming_other_paths_never_leads_pruning_outside_the_checkpoints(tmp_path):
    import json

    from aitoolbox.experiment.local_save.checkpoints import RANKING_FILE_NAME, read_checkpoint_ranking

    run = tmp_path / "run"
    folder = run / "checkpoint_model"
    folder.mkdir(parents=True)
    checkpoint = folder / "model_e_t_E1.pth"
    torch.save({}, str(checkpoint))
    (run / "results.json").write_text("{}")
    record = {"metric": "val_loss", "checkpoints": [[0.9, ".."], [0.8, "../results.json"], [0.7, "."],
                                                    [0.6, "hyperparams.json"], [0.1, "model_e_t_E1.pth"]]}
    (folder / RANKING_FILE_NAME).write_text(json.dumps(record))
    (folder / "hyperparams.json").write_text("{}")
    assert read_checkpoint_ranking(str(folder), "val_loss") == [(0.1, str(checkpoint))]
