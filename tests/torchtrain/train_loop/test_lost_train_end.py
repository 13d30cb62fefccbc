"""Issue 32: a job killed after its last epoch's checkpoint and before its train end finished, restarted with the same
target, runs that end (once); a restarted finished job repeats nothing; other checkpoints resume as before. Each job
runs in a process of its own (train_end_job.py): only the files carry the run from one to the next."""
import glob
import json
import os
import subprocess
import sys

import pytest

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.experiment.local_save.train_end_marker import CHECKPOINT_KEY, MARKER_NAME
from tests.helpers import TrainEndCounter
from tests.torchtrain.distributed.support import REPO_ROOT, script_env


def job(root, num_epochs, mode, checkpoint=None):
    command = [sys.executable, "-m", "tests.torchtrain.train_loop.train_end_job", str(root), str(num_epochs), mode]
    result = subprocess.run(command + ([checkpoint] if checkpoint else []), env=script_env(), capture_output=True,
                            text=True, timeout=240, cwd=str(REPO_ROOT))
    return result


def ends(root):
    path = os.path.join(root, "ends.txt")
    return open(path).read().split() if os.path.exists(path) else []


def final_models(root):
    return glob.glob(os.path.join(root, "proj", "exp_*", "model", "model_*.pth"))


def history(root):
    with open(os.path.join(root, "history.json")) as handle:
        return json.load(handle)


@pytest.mark.slow  # processes of their own: about 40 s
def test_a_job_killed_before_its_train_end_runs_the_end_once_when_restarted(tmp_path):
    killed = job(tmp_path, 2, "kill")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert ends(tmp_path) == [] and final_models(tmp_path) == []  # the end was lost with the process

    restarted = job(tmp_path, 2, "run")
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "records no finished train end" in restarted.stderr
    assert ends(tmp_path) == ["2"]  # the end ran once, after the 2 epochs
    assert len(final_models(tmp_path)) == 1  # ModelTrainEndSave wrote the final model
    assert len(history(tmp_path)["history"]["train_end_test_loss"]) == 1
    assert history(tmp_path)["epochs"] == 2
    assert glob.glob(os.path.join(tmp_path, "proj", "exp_*", MARKER_NAME), include_hidden=True)

    # The finished job started again: nothing is repeated.
    model = final_models(tmp_path)[0]
    written = os.stat(model).st_mtime_ns
    again = job(tmp_path, 2, "run")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Nothing to train" in again.stderr
    assert ends(tmp_path) == ["2"] and os.stat(model).st_mtime_ns == written


@pytest.mark.slow  # processes of their own: about 40 s
def test_a_finished_job_restarted_repeats_nothing(tmp_path):
    first = job(tmp_path, 2, "run")
    assert first.returncode == 0, first.stderr[-3000:]
    assert ends(tmp_path) == ["2"]
    model = final_models(tmp_path)[0]
    written = os.stat(model).st_mtime_ns
    again = job(tmp_path, 2, "run")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Nothing to train" in again.stderr and "records no finished train end" not in again.stderr
    assert ends(tmp_path) == ["2"] and os.stat(model).st_mtime_ns == written
    # A longer target trains on, and its end runs once more.
    longer = job(tmp_path, 3, "run")
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert ends(tmp_path) == ["2", "3"]


@pytest.mark.slow  # processes of their own: about 40 s
def test_an_earlier_epochs_checkpoint_resumes_as_before(tmp_path):
    """Only the last epoch's checkpoint of a fit carries the key: an earlier one, loaded with its own epoch as the
    target, trains nothing and runs no end (as before issue 32's fix); with the run's target it trains on and ends."""
    import torch

    first = job(tmp_path, 2, "run")
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = sorted(glob.glob(os.path.join(tmp_path, "proj", "exp_*", "checkpoint_model", "*.pth")))
    keys = {path: CHECKPOINT_KEY in torch.load(path, weights_only=True) for path in checkpoints}
    assert sorted(keys.values()) == [False, True]  # epoch 1's has none, epoch 2's (the last) has it
    earlier = next(path for path, key in keys.items() if not key)
    os.remove(os.path.join(tmp_path, "ends.txt"))
    nothing = job(tmp_path, 1, "load", earlier)
    assert nothing.returncode == 0, nothing.stderr[-3000:]
    assert "Nothing to train" in nothing.stderr and ends(tmp_path) == []
    trains_on = job(tmp_path, 2, "load", earlier)
    assert trains_on.returncode == 0, trains_on.stderr[-3000:]
    assert ends(tmp_path) == ["2"] and history(tmp_path)["epochs"] == 2


# --- in one process: the record removed stands for a job killed before it was written ----------------------------
def _loop(root):
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Subset

    from aitoolbox.torchtrain.callbacks import ModelCheckpoint
    from aitoolbox.torchtrain.train_loop import TrainLoop
    from tests.helpers import MLP, classification_data

    torch.manual_seed(0)
    model, data = MLP(hidden=8), classification_data(24)
    tl = TrainLoop(model, DataLoader(Subset(data, range(16)), batch_size=4), None,
                   DataLoader(Subset(data, range(16, 24)), batch_size=4), torch.optim.SGD(model.parameters(), lr=0.1),
                   nn.CrossEntropyLoss(), show_progress=False)
    return tl, ModelCheckpoint("proj", "exp", str(root))


def test_the_record_is_written_when_the_end_finished_and_read_by_a_load_at_the_target(tmp_path):
    tl, checkpoint = _loop(tmp_path)
    tl.fit(num_epochs=2, callbacks=[checkpoint])
    folder, run = checkpoint.experiment_folder.checkpoint_dir, checkpoint.experiment_folder.path
    with open(os.path.join(run, MARKER_NAME)) as handle:
        assert json.load(handle) == {"train_ends_done": [[2, tl.total_iteration_idx]]}
    final = sorted(glob.glob(os.path.join(folder, "*_E1.pth")))[0]

    # The finished run's final checkpoint: nothing to train, no end.
    again, _ = _loop(tmp_path)
    counter = TrainEndCounter()
    again.load_checkpoint(final)
    again.fit(num_epochs=2, callbacks=[counter])
    assert (counter.begins, counter.ends) == (0, 0) and "train_end_test_loss" not in again.train_history

    # Without the record (the job killed before its end finished): the end runs, on_train_begin first, once.
    os.remove(os.path.join(run, MARKER_NAME))
    lost, _ = _loop(tmp_path)
    counter = TrainEndCounter()
    lost.load_checkpoint(final)
    lost.fit(num_epochs=2, callbacks=[counter])
    assert (counter.begins, counter.ends) == (1, 1) and lost.epochs_completed == 2
    assert len(lost.train_history["train_end_test_loss"]) == 1  # the lost end's evaluation, once
    with open(os.path.join(run, MARKER_NAME)) as handle:  # recorded in the loaded checkpoint's run folder
        assert json.load(handle)["train_ends_done"] == [[2, lost.total_iteration_idx]]
    counter = TrainEndCounter()
    lost.fit(num_epochs=2, callbacks=[counter])  # done now: a second fit trains nothing
    assert (counter.begins, counter.ends) == (0, 0)


def test_a_dict_without_its_file_and_a_mid_epoch_checkpoint_are_treated_as_before(tmp_path):
    """Only a checkpoint read from a file can be matched with the record beside it."""
    import torch

    tl, checkpoint = _loop(tmp_path)
    tl.fit(num_epochs=2, callbacks=[checkpoint])
    folder = checkpoint.experiment_folder.checkpoint_dir
    os.remove(os.path.join(checkpoint.experiment_folder.path, MARKER_NAME))
    final = torch.load(sorted(glob.glob(os.path.join(folder, "*_E1.pth")))[0], weights_only=True)
    assert CHECKPOINT_KEY in final
    loaded, _ = _loop(tmp_path)
    counter = TrainEndCounter()
    loaded.load_checkpoint(final)  # no source: no folder to read a record from
    loaded.fit(num_epochs=2, callbacks=[counter])
    assert counter.ends == 0


def _finished_run(root):
    """A finished 2-epoch run: its final epoch-end checkpoint and its run folder."""
    tl, checkpoint = _loop(root)
    tl.fit(num_epochs=2, callbacks=[checkpoint])
    folder = checkpoint.experiment_folder.checkpoint_dir
    return sorted(glob.glob(os.path.join(folder, "*_E1.pth")))[0], checkpoint.experiment_folder.path


def _ends_after_loading(root, path):
    loaded, _ = _loop(root)
    counter = TrainEndCounter()
    loaded.load_checkpoint(path)
    loaded.fit(num_epochs=2, callbacks=[counter])
    return counter.begins, counter.ends


@pytest.mark.parametrize("where", ["a shared folder", "another run's checkpoint folder"])
def test_a_finished_runs_final_checkpoint_copied_elsewhere_trains_nothing_and_writes_no_record(tmp_path, where):
    """The copy's folder has no record of that run (review 50e F1: its end ran again, and a record was written
    beside the folder above the copy, outside any run folder): nothing to train, as before this record existed."""
    import shutil

    final, _ = _finished_run(tmp_path / "runs")
    target = tmp_path / "share" if where == "a shared folder" else tmp_path / "other" / "exp_x" / "checkpoint_model"
    target.mkdir(parents=True)
    copy = shutil.copy(final, target)
    assert _ends_after_loading(tmp_path / "runs", copy) == (0, 0)
    assert not os.path.exists(os.path.join(os.path.dirname(os.path.dirname(copy)), MARKER_NAME))


@pytest.mark.parametrize("given", ["home-relative file", "run folder", "checkpoint folder", "link to the run folder"])
def test_every_form_of_naming_the_final_checkpoint_finds_its_run_folders_record(tmp_path, monkeypatch, given):
    """load_checkpoint's forms of the final checkpoint (a '~' path, the run folder or its checkpoint_model/ folder:
    the newest checkpoint, a link to the run folder) read the run folder's record: a finished end is not run again
    (review 50f G1: a '~' path ran it at every load), a lost one runs once (G4: the folder forms skipped it)."""
    final, run = _finished_run(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    if given == "link to the run folder":
        os.symlink(run, tmp_path / "latest")
    source = {"home-relative file": os.path.join("~", os.path.relpath(final, tmp_path)), "run folder": run,
              "checkpoint folder": os.path.dirname(final),
              "link to the run folder": str(tmp_path / "latest")}[given]
    assert _ends_after_loading(tmp_path, source) == (0, 0)
    os.remove(os.path.join(run, MARKER_NAME))  # the job killed before its end finished
    assert _ends_after_loading(tmp_path, source) == (1, 1)
    assert _ends_after_loading(tmp_path, source) == (0, 0)  # recorded now


def test_a_full_record_drops_its_oldest_points_and_stays_readable(tmp_path):
    """The writer keeps the record under the reader's limit (review 50f G2: past it, no end was recorded any more and
    a lost end counted as finished)."""
    from aitoolbox.experiment.local_save.train_end_marker import MAX_RECORD_BYTES, _read, record_train_end_done

    path = str(tmp_path / MARKER_NAME)
    points, size = [], len(json.dumps({"train_ends_done": []})) + 1  # (+1: the newline)
    while size + len(json.dumps([len(points), 10 * len(points)])) + 2 <= MAX_RECORD_BYTES - 4:
        size += len(json.dumps([len(points), 10 * len(points)])) + (2 if points else 0)
        points.append([len(points), 10 * len(points)])
    with open(path, "w") as handle:
        json.dump({"train_ends_done": points}, handle)
        handle.write("\n")
    assert os.path.getsize(path) == size <= MAX_RECORD_BYTES
    last = [10 ** 12, 7]  # one more point than the limit holds
    assert size + len(json.dumps(last)) + 2 > MAX_RECORD_BYTES
    assert record_train_end_done(path, *last) == path
    assert record_train_end_done(path, last[0] + 1, 7) == path
    assert os.path.getsize(path) <= MAX_RECORD_BYTES
    recorded = _read(path)
    assert recorded[-2:] == [last, [last[0] + 1, 7]] and points[-1] in recorded and points[0] not in recorded


@pytest.mark.parametrize("record", ["fifo", "nested", "huge"])
def test_a_record_that_is_not_a_small_file_of_points_counts_as_finished_without_hanging(tmp_path, record):
    """A planted record (review 50e F3): a FIFO made fit hang on its read, a deeply nested one raised
    RecursionError; one over the size limit is not read either. Each is taken as "finished" and left as it is."""
    from aitoolbox.experiment.local_save.train_end_marker import MAX_RECORD_BYTES

    final, run = _finished_run(tmp_path)
    path = os.path.join(run, MARKER_NAME)
    os.remove(path)
    if record == "fifo":
        os.mkfifo(path)
    else:
        with open(path, "w") as handle:
            handle.write("[" * 100_000 + "]" * 100_000 if record == "nested" else " " * (MAX_RECORD_BYTES + 1))
    before = os.stat(path)
    assert _ends_after_loading(tmp_path, final) == (0, 0)
    after = os.stat(path)
    assert (after.st_mode, after.st_size, after.st_mtime_ns) == (before.st_mode, before.st_size, before.st_mtime_ns)


def test_a_malformed_entry_of_the_record_keeps_the_other_points(tmp_path):
    """An entry that is not two integers is passed over; the points beside it stay (review 50e F4: the record was
    rewritten with the new point alone, so an end that had finished counted as lost)."""
    from aitoolbox.experiment.local_save.train_end_marker import record_train_end_done

    path = str(tmp_path / MARKER_NAME)
    with open(path, "w") as handle:
        json.dump({"train_ends_done": [[1, 7], "garbage", [2], [2, 15]]}, handle)
    assert record_train_end_done(path, 3, 23) == path
    with open(path) as handle:
        assert json.load(handle) == {"train_ends_done": [[1, 7], [2, 15], [3, 23]]}


def _ddp_loop():
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Subset

    from aitoolbox.torchtrain.train_loop import TrainLoop
    from tests.helpers import MLP, classification_data

    torch.manual_seed(0)
    model, data = MLP(hidden=8), classification_data(24)
    return TrainLoop(model, DataLoader(Subset(data, range(16)), batch_size=4), None,
                     DataLoader(Subset(data, range(16, 24)), batch_size=4),
                     torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), show_progress=False,
                     gpu_mode="ddp")


class _EndsFile(AbstractCallback):
    """Each on_train_end appends a line to a file of its process (the processes' callbacks are copies)."""

    def __init__(self, root):
        super().__init__("ends file")
        self.root = root

    def on_train_end(self):
        with open(os.path.join(self.root, f"ends_{os.getpid()}.txt"), "a") as handle:
            handle.write("end\n")


def _ends_written(root):
    return sum(len(open(path).readlines()) for path in glob.glob(os.path.join(root, "ends_*.txt")))


@pytest.mark.slow  # three fit_distributed calls of 2 CPU processes: about 60 s
def test_fit_distributed_runs_a_lost_train_end_in_every_process_and_a_finished_one_not_again(tmp_path):
    from aitoolbox.torchtrain.callbacks import ModelCheckpoint

    root = str(tmp_path)
    tl = _ddp_loop()
    tl.fit_distributed(num_epochs=2, callbacks=[ModelCheckpoint("proj", "exp", root), _EndsFile(root)],
                       num_cpu_processes=2)
    assert _ends_written(root) == 2  # one on_train_end in each process
    record = glob.glob(os.path.join(root, "proj", "exp_*", MARKER_NAME))
    final = sorted(glob.glob(os.path.join(root, "proj", "exp_*", "checkpoint_model", "*_E1.pth")))[0]
    assert len(record) == 1

    finished = _ddp_loop()
    finished.load_checkpoint(final)
    finished.fit_distributed(num_epochs=2, callbacks=[_EndsFile(root)], num_cpu_processes=2)
    assert _ends_written(root) == 2  # nothing to train, no end

    os.remove(record[0])  # as if the job had been killed before its end finished
    lost = _ddp_loop()
    lost.load_checkpoint(final)
    lost.fit_distributed(num_epochs=2, callbacks=[_EndsFile(root)], num_cpu_processes=2)
    assert _ends_written(root) == 4 and os.path.exists(record[0])
