"""JSON records read back from a shared run folder or bucket, planted (issue 31's review): each one that is not what
aitoolbox writes gives the documented outcome (a logged warning and "no record", or the documented ValueError),
never a bare RecursionError, OverflowError or TypeError."""
import json
import logging

import pytest

from aitoolbox.cloud.folders import FOLDER_MARKER_FORMAT, parse_folder_marker
from aitoolbox.experiment.local_save.checkpoints import RANKING_FILE_NAME, read_checkpoint_ranking
from aitoolbox.experiment.local_save.run_identity import RUN_IDENTITY_FILE, parse_run_identity, read_run_identity

@pytest.fixture
def caplog(caplog, monkeypatch):
    """caplog with the aitoolbox logger's records (it does not propagate to the root by default)."""
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    return caplog


DEEP = "[" * 50000  # under every size bound, deeper than json's recursion limit


@pytest.mark.parametrize("text", [DEEP, "[" * 100000, '{"job_id": ' + DEEP + "}", "x" * (1 << 20)],
                         ids=["deep", "deeper_and_large", "deep_field", "large"])
def test_a_planted_run_record_counts_as_none_with_a_warning(tmp_path, caplog, text):
    (tmp_path / RUN_IDENTITY_FILE).write_text(text)
    with caplog.at_level(logging.WARNING, logger="aitoolbox"):
        assert read_run_identity(str(tmp_path)) is None
    assert RUN_IDENTITY_FILE in caplog.text
    assert parse_run_identity(DEEP, "s3://bucket/run/aitoolbox_run.json") is None  # as the bucket loaders read it


@pytest.mark.parametrize("record", [
    '{"metric": "val_loss", "checkpoints": [[1' + "0" * 400 + ', "model_x_y_E1.pth"]]}',  # beyond a float
    '{"metric": "val_loss", "checkpoints": ' + DEEP + "}",
    DEEP,
], ids=["score_beyond_a_float", "deep_entries", "deep"])
def test_a_planted_ranking_record_ranks_nothing_with_a_warning(tmp_path, caplog, record):
    (tmp_path / RANKING_FILE_NAME).write_text(record)
    (tmp_path / "model_x_y_E1.pth").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="aitoolbox"):
        assert read_checkpoint_ranking(str(tmp_path), "val_loss") == []
    assert "Not pruning" in caplog.text


@pytest.mark.parametrize("marker", [
    DEEP.encode(),
    json.dumps({"format": FOLDER_MARKER_FORMAT, "files": {}}).encode()[:-1] + b', "x": ' + DEEP.encode() + b"}",
    json.dumps({"format": FOLDER_MARKER_FORMAT, "version": "1", "files": {}}).encode(),
    json.dumps({"format": FOLDER_MARKER_FORMAT, "version": [1], "files": {}}).encode(),
], ids=["deep", "deep_field", "version_as_text", "version_as_list"])
def test_a_planted_folder_marker_is_the_documented_value_error(marker):
    with pytest.raises(ValueError, match="s3://b/x/_COMPLETE") as refused:
        parse_folder_marker(marker, "s3://b/x/_COMPLETE")
    assert type(refused.value) is ValueError
