"""TrainingHistory: aitoolbox 1.x's API (pre-created lists, appending assignment, +) and our loop's dict-like use."""
import copy
import importlib.util
import json
import logging
import pickle

import pytest
import torch

from aitoolbox.experiment.training_history import TrainingHistory


@pytest.fixture
def history():
    th = TrainingHistory()
    for name, value in [("loss", 0.9), ("val_loss", 1.1), ("loss", 0.7), ("val_Accuracy", 0.5)]:
        th.insert_single_result_into_history(name, value)
    return th


@pytest.fixture
def warnings_log(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    caplog.set_level(logging.WARNING)
    return caplog


def test_starts_with_empty_lists_of_the_loop_metrics():
    assert TrainingHistory().train_history == {"loss": [], "accumulated_loss": [], "val_loss": []}
    without_validation = TrainingHistory(has_validation=False, strict_content_check=True)
    assert without_validation.train_history == {"loss": [], "accumulated_loss": []}
    assert without_validation.empty_train_history == without_validation.train_history
    assert without_validation.strict_content_check and not TrainingHistory().strict_content_check
    # The empty reference is a separate dict: recording values does not change it.
    th = TrainingHistory()
    th.insert_single_result_into_history("loss", 1.0)
    assert th.empty_train_history == {"loss": [], "accumulated_loss": [], "val_loss": []}


def test_insert_appends_in_order(history):
    assert history.train_history == {"loss": [0.9, 0.7], "accumulated_loss": [], "val_loss": [1.1],
                                     "val_Accuracy": [0.5]}
    assert history.get_train_history() is history.train_history


def test_get_train_history_dict_is_a_plain_copy(history):
    exported = history.get_train_history_dict()
    assert type(exported) is dict and exported == history.train_history
    exported["loss"].append(123.0)
    exported["new"] = [1]
    assert history["loss"] == [0.9, 0.7] and "new" not in history
    json.dumps(exported)


def test_exported_dict_loads_with_weights_only(history, tmp_path):
    history.insert_single_result_into_history("val_confusion", torch.eye(2))
    path = tmp_path / "history.pt"
    torch.save(history.get_train_history_dict(), path)
    loaded = torch.load(path, weights_only=True)
    assert loaded["loss"] == [0.9, 0.7] and torch.equal(loaded["val_confusion"][0], torch.eye(2))


def test_exporting_an_empty_history_warns_or_raises_when_strict(warnings_log):
    assert TrainingHistory().get_train_history_dict() == {"loss": [], "accumulated_loss": [], "val_loss": []}
    assert "empty" in warnings_log.text
    with pytest.raises(ValueError, match="empty"):
        TrainingHistory(strict_content_check=True).get_train_history_dict()


@pytest.mark.skipif(importlib.util.find_spec("aitoolbox.utils") is None
                    or importlib.util.find_spec("aitoolbox.utils.dict_util") is None,
                    reason="aitoolbox.utils.dict_util is not there yet")
def test_flattened_export_of_grouped_metrics():
    th = TrainingHistory(has_validation=False)
    th += {"loss": 0.5, "accumulated_loss": 0.6}
    th.insert_single_result_into_history("val_f1", {"cat": 0.1, "dog": {"big": 0.2}})
    th.insert_single_result_into_history("val_f1", {"cat": 0.3, "dog": {"big": 0.4}})
    assert th.get_train_history_dict(flatten_dict=True) == {
        "loss": [0.5], "accumulated_loss": [0.6], "val_f1_cat": [0.1, 0.3], "val_f1_dog_big": [0.2, 0.4]}
    assert th["val_f1"][0] == {"cat": 0.1, "dog": {"big": 0.2}}  # the history itself is left nested


def test_wrap_pre_prepared_history():
    keras_like = {"loss": [1.0, 0.5], "acc": [0.2, 0.6]}
    th = TrainingHistory().wrap_pre_prepared_history(keras_like)
    assert th.train_history is keras_like and th.get_train_history() == keras_like
    th.qa_check_history_records()  # aligned: no complaint
    with pytest.raises(TypeError, match="dict"):
        TrainingHistory().wrap_pre_prepared_history([1.0, 0.5])


def test_qa_check_of_unequal_lengths(warnings_log):
    uneven = {"loss": [1.0, 0.5], "acc": [0.2]}
    TrainingHistory().wrap_pre_prepared_history(uneven).qa_check_history_records()
    assert "'acc': 1" in warnings_log.text
    with pytest.raises(ValueError, match="different numbers of values"):
        TrainingHistory(strict_content_check=True).wrap_pre_prepared_history(uneven).qa_check_history_records()


# --- used like a dict -------------------------------------------------------------------------------------------
def test_reading_like_a_dict(history):
    assert history["val_loss"] == [1.1] and history["accumulated_loss"] == []
    with pytest.raises(KeyError):
        history["missing"]
    assert history.get("missing") is None and history.get("missing", []) == []
    assert history.get("loss", []) == [0.9, 0.7]
    assert "val_Accuracy" in history and "accumulated_loss" in history and "missing" not in history
    assert list(history) == ["loss", "accumulated_loss", "val_loss", "val_Accuracy"]
    assert list(history.keys()) == list(history) and len(history) == 4
    assert dict(history.items()) == history.train_history
    assert list(history.values()) == [[0.9, 0.7], [], [1.1], [0.5]]
    assert dict(history) == history.train_history and sorted(history) == sorted(history.train_history)
    assert str(history) == str(history.train_history) and repr(history).startswith("TrainingHistory({")


def test_equality_with_dicts_and_histories(history):
    assert history == history.get_train_history_dict()
    assert history == copy.deepcopy(history)
    assert TrainingHistory() != {} and TrainingHistory() != TrainingHistory(has_validation=False)
    emptied = TrainingHistory()
    emptied.clear()
    assert emptied == {} and len(emptied) == 0


def test_assignment_appends_as_in_aitoolbox_1x(history):
    history["loss"] = 0.5
    history["brand_new"] = 7
    assert history["loss"] == [0.9, 0.7, 0.5] and history["brand_new"] == [7]


def test_update_replaces_whole_lists_as_when_restoring_a_checkpoint(history):
    saved = history.get_train_history_dict()
    restored = TrainingHistory(has_validation=False)
    restored.clear()
    restored.update(saved)
    assert restored == saved and restored["loss"] == [0.9, 0.7]
    restored.update(loss=[0.1], extra=[2])
    assert restored["loss"] == [0.1] and restored["extra"] == [2]
    del restored["extra"]
    assert "extra" not in restored


def test_pickles_and_deep_copies(history):
    for clone in (pickle.loads(pickle.dumps(history)), copy.deepcopy(history)):
        assert isinstance(clone, TrainingHistory) and clone == history
        clone.insert_single_result_into_history("loss", 0.1)
        assert history["loss"] == [0.9, 0.7]


# --- adding dicts of new values -----------------------------------------------------------------------------------
def test_adding_a_dict_appends_one_value_per_metric(history):
    added = history + {"loss": 0.3, "val_f1": 0.8}
    assert added["loss"] == [0.9, 0.7, 0.3] and added["val_f1"] == [0.8]
    assert history["loss"] == [0.9, 0.7] and "val_f1" not in history  # + copies
    added_left = {"val_f1": 0.1} + history
    assert added_left["val_f1"] == [0.1] and isinstance(added_left, TrainingHistory)
    same = history
    history += {"val_f1": 0.9}
    assert history is same and history["val_f1"] == [0.9]


@pytest.mark.parametrize("other", [[0.1], 0.1, "loss", TrainingHistory()])
def test_adding_anything_but_a_dict_is_a_type_error(history, other):
    with pytest.raises(TypeError, match="dict"):
        history + other
    with pytest.raises(TypeError):
        other + history
    with pytest.raises(TypeError, match="dict"):
        history += other


def test_old_import_path_still_works():
    from aitoolbox.torchtrain.train_loop.history import TrainingHistory as OldPath

    assert OldPath is TrainingHistory
