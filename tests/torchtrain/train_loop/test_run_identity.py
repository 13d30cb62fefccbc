"""auto_resume continues only a run of this job: by job id (AITOOLBOX_RUN_ID, SLURM_JOB_ID, torchrun's run id),
or without one by identical hyperparameters; otherwise a new run starts and the log says why."""
import json
import logging
import os

import pytest

from aitoolbox.experiment.local_save.experiment_folder import ExperimentFolder
from aitoolbox.experiment.local_save.run_identity import (
    RUN_IDENTITY_FILE, current_job_id, hyperparams_fingerprint, read_run_identity)
from aitoolbox.torchtrain.train_loop import TrainLoopCheckpoint
from tests.torchtrain.train_loop.test_tracking import preset_arguments

JOB_VARIABLES = ("AITOOLBOX_RUN_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")


@pytest.fixture
def no_job_id(monkeypatch):
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)  # for caplog: the package logger may not
    for name in JOB_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def crashed_run(root, hyperparams):
    """A run with an epoch-0 checkpoint (then the process went away)."""
    tl = TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", str(root), hyperparams, auto_resume=True,
                             show_progress=False)
    tl.fit(num_epochs=1)
    return tl


def restarted(root, hyperparams):
    return TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", str(root), hyperparams, auto_resume=True,
                               show_progress=False)


def test_the_job_id_comes_from_aitoolbox_then_slurm_then_torchrun_never_torchruns_default():
    assert current_job_id({"AITOOLBOX_RUN_ID": "sweep-3", "SLURM_JOB_ID": "77"}) == ("sweep-3", "AITOOLBOX_RUN_ID")
    assert current_job_id({"SLURM_JOB_ID": "77", "TORCHELASTIC_RUN_ID": "abc"}) == ("77", "SLURM_JOB_ID")
    assert current_job_id({"TORCHELASTIC_RUN_ID": "abc"}) == ("abc", "TORCHELASTIC_RUN_ID")
    assert current_job_id({"TORCHELASTIC_RUN_ID": "none"}) == (None, None)
    assert current_job_id({}) == (None, None)


def test_a_run_records_its_job_and_a_fingerprint_that_never_holds_the_values(tmp_path, no_job_id):
    no_job_id.setenv("SLURM_JOB_ID", "4242")
    tl = crashed_run(tmp_path, {"lr": 0.1, "api_token": "hunter2-secret"})
    recorded = read_run_identity(tl.experiment_folder.path)
    assert (recorded.job_id, recorded.job_id_source) == ("4242", "SLURM_JOB_ID")
    assert recorded.fingerprint == hyperparams_fingerprint({"api_token": "hunter2-secret", "lr": 0.1})
    assert recorded.fingerprint != hyperparams_fingerprint({"lr": 0.2, "api_token": "hunter2-secret"})
    # Nothing in it depends on the secret (see tests/experiment/local_save/test_run_identity_secrets.py).
    assert recorded.fingerprint == hyperparams_fingerprint({"lr": 0.1, "api_token": "other"})
    text = open(os.path.join(tl.experiment_folder.path, RUN_IDENTITY_FILE)).read()
    assert "hunter2" not in text and "0.1" not in text
    assert json.loads(text)["job_id"] == "4242"


def test_a_requeued_job_continues_its_run_and_another_job_starts_its_own(tmp_path, no_job_id, caplog):
    no_job_id.setenv("SLURM_JOB_ID", "100")
    first = crashed_run(tmp_path, {"lr": 0.1})
    requeued = restarted(tmp_path, {"lr": 0.1})  # SLURM keeps the job id across a requeue
    assert requeued.experiment_folder.path == first.experiment_folder.path and requeued.resumed_from is not None

    no_job_id.setenv("SLURM_JOB_ID", "101")  # a sweep's other job, same experiment name and hyperparameters
    with caplog.at_level(logging.INFO):
        other = restarted(tmp_path, {"lr": 0.1})
    assert other.resumed_from is None and other.epochs_completed == 0
    assert other.experiment_folder.path != first.experiment_folder.path
    assert "it belongs to another job (SLURM_JOB_ID=100; this job is SLURM_JOB_ID=101)" in caplog.text

    no_job_id.setenv("SLURM_JOB_ID", "100")
    no_job_id.setenv("AITOOLBOX_RUN_ID", "sweep-a")  # the user's id wins over SLURM's
    assert restarted(tmp_path, {"lr": 0.1}).resumed_from is None


def test_without_a_job_id_only_a_run_without_one_and_with_the_same_hyperparameters_continues(tmp_path, no_job_id,
                                                                                              caplog):
    first = crashed_run(tmp_path, {"lr": 0.1})
    with caplog.at_level(logging.INFO):
        changed = restarted(tmp_path, {"lr": 0.2})
    assert changed.resumed_from is None
    assert "its hyperparameters differ from this job's" in caplog.text
    same = restarted(tmp_path, {"lr": 0.1})
    assert same.resumed_from is not None and same.experiment_folder.path == first.experiment_folder.path

    # A run of a job with an id is not continued by a job without one, even with the same hyperparameters.
    no_job_id.setenv("SLURM_JOB_ID", "7")
    job_run = crashed_run(tmp_path / "with_id", {"lr": 0.1})
    no_job_id.delenv("SLURM_JOB_ID")
    caplog.clear()
    with caplog.at_level(logging.INFO):
        fresh = restarted(tmp_path / "with_id", {"lr": 0.1})
    assert fresh.resumed_from is None and fresh.experiment_folder.path != job_run.experiment_folder.path
    assert "set AITOOLBOX_RUN_ID to the same value" in caplog.text


def test_torchruns_default_run_id_is_no_job_id(tmp_path, no_job_id):
    no_job_id.setenv("TORCHELASTIC_RUN_ID", "none")
    crashed_run(tmp_path, {"lr": 0.1})
    assert restarted(tmp_path, {"lr": 0.2}).resumed_from is None  # hyperparameters compared, not "none" == "none"


def test_a_run_folder_without_a_record_is_continued_only_by_a_job_without_an_id(tmp_path, no_job_id):
    first = crashed_run(tmp_path, {"lr": 0.1})
    os.remove(os.path.join(first.experiment_folder.path, RUN_IDENTITY_FILE))  # written before identities existed
    no_job_id.setenv("SLURM_JOB_ID", "5")
    assert restarted(tmp_path, {"lr": 0.1}).resumed_from is None
    no_job_id.delenv("SLURM_JOB_ID")
    assert restarted(tmp_path, {"lr": 0.1}).experiment_folder.path == first.experiment_folder.path


def test_a_reserved_name_is_never_taken_by_another_run_and_creating_the_folder_keeps_it(tmp_path):
    lazy = ExperimentFolder(str(tmp_path), "proj", "exp", timestamp="2026-01-01_10-00-00")
    assert lazy.reserve() == "2026-01-01_10-00-00"
    checkpoint_dir = lazy.checkpoint_dir  # a path handed out before the folder exists
    assert not os.path.exists(lazy.path)
    other = ExperimentFolder(str(tmp_path), "proj", "exp", timestamp="2026-01-01_10-00-00")
    other.create()  # the other job, same second: eager
    assert other.timestamp == "2026-01-01_10-00-00_1"
    lazy.ensure(lazy.checkpoint_dir)  # the first file's folder, created with the run folder
    assert lazy.checkpoint_dir == checkpoint_dir and os.path.isdir(checkpoint_dir)
    assert sorted(os.listdir(tmp_path / "proj")) == ["exp_2026-01-01_10-00-00", "exp_2026-01-01_10-00-00_1"]


# --- issue 33 item 4: the job id alone is not enough; the fingerprint is the same in every process --------------
def test_a_run_of_the_same_job_id_with_other_hyperparameters_is_not_continued(tmp_path, no_job_id, caplog):
    """A sweep inside one allocation: every step has the allocation's SLURM_JOB_ID. The lr=0.5 job must not
    continue (and return) the lr=0.05 run."""
    no_job_id.setenv("SLURM_JOB_ID", "900")
    first = crashed_run(tmp_path, {"lr": 0.05})
    with caplog.at_level(logging.INFO):
        other = restarted(tmp_path, {"lr": 0.5})
    assert other.resumed_from is None and other.epochs_completed == 0
    assert other.experiment_folder.path != first.experiment_folder.path
    assert "its hyperparameters differ from this job's (both are SLURM_JOB_ID=900" in caplog.text
    requeued = restarted(tmp_path, {"lr": 0.05})  # the same job again still continues its own run
    assert requeued.resumed_from is not None and requeued.experiment_folder.path == first.experiment_folder.path


def module_level_function(value):
    return value


FINGERPRINT_IN_ANOTHER_PROCESS = """
import sys, torch
from torch import nn
from aitoolbox.experiment.local_save.run_identity import hyperparams_fingerprint
from tests.torchtrain.train_loop.test_run_identity import module_level_function, stable_hyperparams
print(hyperparams_fingerprint(stable_hyperparams()))
"""


def stable_hyperparams() -> dict:
    """Values whose repr names a memory address, next to plain ones: each has a form every process computes."""
    import functools
    import pathlib
    import numpy as np
    import torch
    from torch import nn
    return {"activation": torch.tanh, "loss": nn.MSELoss, "init": module_level_function,
            "schedule": functools.partial(module_level_function, 3), "layer": nn.Linear(4, 2),
            "scale": np.float32(0.5), "mask": torch.tensor([1.0, 2.0]), "path": pathlib.Path("/data"),
            "groups": {3, 1, 2}, "lr": 0.1}


def test_the_fingerprint_of_functions_classes_and_objects_is_the_same_in_another_process():
    """json.dumps(default=repr) wrote memory addresses: a job without a job id never recognised its own run."""
    import subprocess
    import sys
    from tests.torchtrain.distributed.support import script_env
    here = hyperparams_fingerprint(stable_hyperparams())
    there = subprocess.run([sys.executable, "-c", FINGERPRINT_IN_ANOTHER_PROCESS], env=script_env(),
                           capture_output=True, text=True, timeout=120)
    assert there.returncode == 0, there.stderr
    assert there.stdout.strip() == here


class Opaque:
    """An object whose repr is the default one, with its memory address."""


@pytest.mark.parametrize("value, where", [(Opaque(), "hyperparams['collate']"),
                                          (lambda x: x, "hyperparams['collate']"),
                                          ({"inner": [1, Opaque()]}, "hyperparams['collate']['inner'][1]")])
def test_a_value_without_a_stable_form_is_refused_at_construction_with_auto_resume(tmp_path, no_job_id, value,
                                                                                     where):
    with pytest.raises(TypeError, match="has no value that is the same in every process") as error:
        restarted(tmp_path, {"lr": 0.1, "collate": value})
    assert str(error.value).startswith(where + " = ")
    assert "auto_resume" in str(error.value)
    assert not (tmp_path / "proj").exists()  # nothing was created
    # Without auto_resume the run never needs to be recognised: the preset is built as before.
    TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", str(tmp_path), {"collate": value}, show_progress=False)


def test_a_job_requeued_across_an_upgrade_still_continues_its_run():
    """A record of an earlier fingerprint format (1: PBKDF2 of the real values; 2: SHA-256 of a repr form) cannot be
    compared with this version's: the same job continues its run, a job of another id still does not."""
    import hashlib
    from aitoolbox.experiment.local_save.run_identity import (
        FINGERPRINT_VERSION, RunIdentity, adoption_refusal, parse_run_identity)
    hyperparams = {"lr": 0.1, "layers": [16, {"dropout": 0.3}], "name": "x", "flag": None, "pair": (1, 2),
                   "epochs": {10: 0.1, 9: 0.2}}
    canonical = json.dumps(hyperparams, sort_keys=True, default=repr).encode("utf-8")
    version_1 = hashlib.pbkdf2_hmac("sha256", canonical, b"aitoolbox-run-fingerprint-v1", 50_000).hex()
    this = RunIdentity("77", "SLURM_JOB_ID", hyperparams_fingerprint(hyperparams))
    assert this.fingerprint_version == FINGERPRINT_VERSION > 2 and this.fingerprint != version_1
    for version, fingerprint in ((None, version_1), (2, hashlib.sha256(canonical).hexdigest())):
        record = {"job_id": "77", "job_id_source": "SLURM_JOB_ID", "fingerprint": fingerprint}
        if version is not None:
            record["fingerprint_version"] = version
        recorded = parse_run_identity(json.dumps(record), "aitoolbox_run.json")
        assert adoption_refusal(this, recorded) is None
        other_job = RunIdentity("78", "SLURM_JOB_ID", this.fingerprint)
        assert "another job" in adoption_refusal(other_job, recorded)
    # The same format with other hyperparameters is refused, also for the same job id (a sweep in one allocation).
    other = RunIdentity("77", "SLURM_JOB_ID", hyperparams_fingerprint(dict(hyperparams, lr=0.2)))
    assert "hyperparameters differ" in adoption_refusal(this, other)
