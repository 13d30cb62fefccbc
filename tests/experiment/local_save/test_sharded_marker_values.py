"""A sharded checkpoint's completion marker (``checkpoint.json``) comes from the folder or a bucket: a value in it
that no save writes (``world_size: 0`` once gave a bare ZeroDivisionError; a negative count, a string, a list
for a dict) is the documented bad-marker ValueError naming the file and the field, before anything is loaded."""
import json
import os

import pytest

from aitoolbox.experiment.local_save.sharded_checkpoints import (
    FORMAT, FORMAT_VERSION, MARKER_FILE, read_sharded_checkpoint_state, sharded_checkpoint_info)

GOOD = {"format": FORMAT, "version": FORMAT_VERSION, "world_size": 2, "num_optimizers": 1,
        "stateless_optimizers": [], "torch_version": "2.13.0"}


def folder_with_marker(tmp_path, content) -> str:
    folder = tmp_path / "model_exp_ts_E1"
    folder.mkdir()
    text = content if isinstance(content, str) else json.dumps(content)
    (folder / MARKER_FILE).write_text(text)
    return str(folder)


@pytest.mark.parametrize("content, field", [
    ({**GOOD, "world_size": 0}, "world_size"),
    ({**GOOD, "world_size": -2}, "world_size"),
    ({**GOOD, "world_size": "2"}, "world_size"),
    ({**GOOD, "world_size": 1.5}, "world_size"),
    ({**GOOD, "world_size": True}, "world_size"),
    ({key: value for key, value in GOOD.items() if key != "world_size"}, "world_size"),
    ({**GOOD, "num_optimizers": -1}, "num_optimizers"),
    ({**GOOD, "num_optimizers": None}, "num_optimizers"),
    ({**GOOD, "stateless_optimizers": 0}, "stateless_optimizers"),
    ({**GOOD, "stateless_optimizers": [3]}, "stateless_optimizers"),
    ({**GOOD, "stateless_optimizers": ["0"]}, "stateless_optimizers"),
    ({**GOOD, "version": "1"}, "version"),
    ([GOOD], "a JSON object"),
    ("{not json", "not JSON"),
    ("\udcff", "not JSON"),
])
def test_a_bad_marker_value_is_the_documented_error_naming_file_and_field(tmp_path, content, field):
    folder = folder_with_marker(tmp_path, content) if content != "\udcff" else None
    if folder is None:  # bytes that are not UTF-8
        folder = str(tmp_path / "model_exp_ts_E1")
        os.mkdir(folder)
        with open(os.path.join(folder, MARKER_FILE), "wb") as handle:
            handle.write(b"\xff\xfe{")
    for read in (sharded_checkpoint_info, read_sharded_checkpoint_state):
        with pytest.raises(ValueError) as refused:
            read(folder)
        assert os.path.join(folder, MARKER_FILE) in str(refused.value) and field in str(refused.value)


def test_a_good_marker_reads_as_before(tmp_path):
    assert sharded_checkpoint_info(folder_with_marker(tmp_path, GOOD)) == GOOD
