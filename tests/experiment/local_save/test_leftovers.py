"""Owner records of temporary folders planted in a shared checkpoint folder (issue 31's review): the cleanup at the
start of every save neither waits on them nor fails on them; a folder whose record is not one aitoolbox writes
counts as a folder of unknown owner."""
import json
import os
import threading
import time

import pytest

from aitoolbox.experiment.local_save.leftovers import OWNER_FILE, STALE_AFTER_S, remove_stale_temporaries

PLANTED = {
    "empty_object": "{}",
    "list": "[]",
    "text": '"host"',
    "pid_too_large_for_a_float": '{"host": "h", "pid": 1' + "0" * 400 + "}",
    "pid_too_large_for_kill": '{"host": "h", "pid": 99999999999999999999}',
    "pid_of_every_process": '{"host": "h", "pid": -1}',
    "pid_as_bool": '{"host": "h", "pid": true}',
    "token_as_list": '{"host": "h", "pid": 1, "token": []}',
    "nested_deep": "[" * 100000,
    "not_utf8": b"\xff\xfe{",
    "too_large": '{"host": "' + "h" * 100000 + '", "pid": 1}',
}


def _plant(folder, content) -> str:
    temporary = folder / ".tmp-model_x_E1"
    temporary.mkdir()
    record = temporary / OWNER_FILE
    if content == "fifo":
        os.mkfifo(record)
    elif content == "link":
        os.symlink("/dev/zero", record)
    else:
        record.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return str(temporary)


def _age(temporary: str) -> None:
    """Make the temporary look untouched for longer than STALE_AFTER_S."""
    old = time.time() - 2 * STALE_AFTER_S
    for path in (os.path.join(temporary, OWNER_FILE), temporary):
        os.utime(path, (old, old), follow_symlinks=False)


def _clean_within(folder, seconds: float = 10.0) -> list:
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(remove_stale_temporaries(str(folder))), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), "remove_stale_temporaries blocked on a planted owner record"
    return outcome[0]


@pytest.mark.parametrize("content", ["fifo", "link"] + list(PLANTED), ids=["fifo", "link"] + list(PLANTED))
@pytest.mark.parametrize("old", [False, True], ids=["recent", "old"])
def test_a_planted_owner_record_neither_blocks_nor_fails_the_cleanup(tmp_path, content, old):
    temporary = _plant(tmp_path, PLANTED.get(content, content))
    if old:
        _age(temporary)
    # Not one aitoolbox writes: its owner is unknown, so it goes only once nothing in it changed for a long time.
    assert _clean_within(tmp_path) == ([temporary] if old else [])
    assert os.path.exists(temporary) is not old


def test_an_owner_record_of_a_live_process_still_keeps_its_folder(tmp_path):
    import socket
    temporary = _plant(tmp_path, json.dumps({"host": socket.gethostname(), "pid": os.getppid(), "token": "ab",
                                             "job": ""}))
    _age(temporary)
    assert _clean_within(tmp_path) == [] and os.path.isdir(temporary)


def _pid_of_a_finished_process() -> int:
    import subprocess
    import sys
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_temporary_folder_is_never_without_its_writer_s_name(tmp_path):
    """A save killed while it creates its temporary folder (before the owner record is in it) or after it removed
    the record (before the rename) left a folder kept for STALE_AFTER_S (an extended-tier test caught one): the
    folder is made under a name that says whose it is and renamed with the record in it."""
    import socket
    from aitoolbox.experiment.local_save.leftovers import create_temporary_folder
    folder = tmp_path / "checkpoint_model"
    folder.mkdir()
    dead = _pid_of_a_finished_process()
    killed_while_created = folder / f".tmp-model_x_ts_E0.{dead}-0badc0de@{socket.gethostname()}.a1b2c3d4"
    killed_while_created.mkdir()  # no record yet
    create_temporary_folder(str(folder / ".tmp-model_x_ts_E1"))
    assert json.loads((folder / ".tmp-model_x_ts_E1" / OWNER_FILE).read_text())["pid"] == os.getpid()
    assert sorted(os.listdir(folder)) == sorted([killed_while_created.name, ".tmp-model_x_ts_E1"])
    removed = remove_stale_temporaries(str(folder))
    assert removed == [str(killed_while_created)]  # this process's own folder (a save in flight) is kept


def test_the_run_folder_and_every_folder_in_it_are_cleaned_by_the_same_rules(tmp_path, monkeypatch):
    """Hyperparameters, results, plots and logs are written through temporaries too: what a killed process left
    in the run folder (or a folder in it) goes as a checkpoint folder's leftovers go; another job's recent ones on
    another host stay; a temporary folder is judged whole, not entered; a link to a folder is not followed."""
    from aitoolbox.experiment.local_save.leftovers import _job_tag, remove_stale_temporaries_under
    monkeypatch.setenv("AITOOLBOX_RUN_ID", "requeued-job")
    run = tmp_path / "run"
    (run / "results" / "plots").mkdir(parents=True)
    (run / "checkpoint_model").mkdir()
    same_job, other_job = _job_tag("requeued-job"), _job_tag("another-job")
    left = {  # what the killed processes of this job left on the host it ran on before
        run / f".tmp-hyperparams.json.4242-deadbeef-j{same_job}@nodeB.abc127",
        run / "results" / f".tmp-results.json.4242-deadbeef-j{same_job}@nodeB.abc128",
        run / "results" / "plots" / f".tmp-loss.png.4242-deadbeef-j{same_job}@nodeB.abc129",
        run / "checkpoint_model" / f".tmp-model_E1.pth.4242-deadbeef-j{same_job}@nodeB.abc130",
    }
    kept = {run / f".tmp-hyperparams.json.4242-deadbeef-j{other_job}@nodeB.abc131",  # another job, recent
            run / "results" / ".tmp-results.json.4242-deadbeef@nodeB.abc132"}  # no job recorded, recent
    for path in left | kept:
        path.write_bytes(b"\0" * 1000)
    writing = run / "checkpoint_model" / ".tmp-model_E2"  # a live process's sharded save: judged whole, not entered
    writing.mkdir()
    (writing / OWNER_FILE).write_text(json.dumps({"host": "nodeB", "pid": 1, "token": "ab", "job": "another-job"}))
    inside = writing / f".tmp-part.4242-deadbeef-j{same_job}@nodeB.abc133"
    inside.write_bytes(b"x")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    outside = elsewhere / f".tmp-theirs.4242-deadbeef-j{same_job}@nodeB.abc134"
    outside.write_bytes(b"x")
    os.symlink(elsewhere, run / "linked")
    removed = remove_stale_temporaries_under(str(run))
    assert sorted(removed) == sorted(map(str, left))
    assert all(path.exists() for path in kept | {inside, outside})
