"""WandBTracking on real TrainLoop runs with W&B in offline mode; the run files (``run-<id>.wandb``) are read
back and compared with what the loop computed."""
import os
import shutil
import subprocess
import sys

import pytest

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback, MissingExperimentDetailsError
from aitoolbox.torchtrain.callbacks.wandb import AlertConfig, WandBTracking
from aitoolbox.torchtrain.train_loop import TrainLoopEndSave
from tests.torchtrain.callbacks import tracking_support as support
from tests.torchtrain.callbacks.tracking_support import BatchRecorder, WandbRun, make_train_loop, offline_run_dirs

pytest.importorskip("wandb")

no_network = support.no_network
wandb_offline = support.wandb_offline
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_batches_epoch_metrics_config_and_final_model(tmp_path, wandb_offline, no_network):
    tl = make_train_loop(TrainLoopEndSave, test=True, project_name="proj", experiment_name="exp",
                         local_model_result_folder_path=str(tmp_path / "results"), hyperparams={"lr": 0.1, "depth": 2})
    recorder = BatchRecorder()
    callback = WandBTracking(batch_log_frequency=2, tags=["baseline"])
    tl.fit(num_epochs=2, callbacks=[callback, recorder])

    folder = tl.experiment_folder
    (run_dir,) = offline_run_dirs(folder.path)  # is_project: wandb's files are in the experiment folder
    run = WandbRun(run_dir)
    assert (run.run.project, run.run.display_name, list(run.run.tags)) == ("proj", "exp", ["baseline"])
    assert run.run.run_id == callback.run_id and run.exit_code == 0 and callback.run is None
    assert {key: run.config[key] for key in ("lr", "depth")} == {"lr": 0.1, "depth": 2}

    steps = [0, 2, 4, 6, 8]
    assert run.values("train_loss/last_batch_loss") == {step: recorder.batches[step]["loss"] for step in steps}
    assert run.values("train_loss/accumulated_batch_loss") == {step: recorder.running_mean(step) for step in steps}
    assert run.values("learning_rate/optimizer_0_group_0") == {step: 0.1 for step in steps}
    # Epoch metrics at the step of the epoch's last batch; the end-of-training test loss joins the last row.
    assert run.values("epoch") == {4: 0, 9: 1}
    history = tl.train_history
    for name in ("loss", "accumulated_loss", "val_loss"):
        assert run.values(f"loss_at_epoch_end/{name}") == {4: history[name][0], 9: history[name][1]}, name
    assert run.values("loss_at_epoch_end/train_end_test_loss") == {9: history["train_end_test_loss"][0]}
    model_path = os.path.join(folder.model_dir, f"model_exp_{folder.timestamp}.pth")
    assert run.summary["final_model_path"] == model_path and os.path.isfile(model_path)


def test_alerts_and_source_code_with_a_plain_train_loop(tmp_path, wandb_offline):
    source = tmp_path / "src"
    (source / "pkg").mkdir(parents=True)
    (source / "pkg" / "module.py").write_text("VALUE = 1\n")
    (source / "train.py").write_text("print('train')\n")
    alerts = [AlertConfig("val_loss", 0.0, "minimize"),  # above 0: fires every epoch
              AlertConfig("loss_at_epoch_end/val_loss", 100.0, "minimize"),  # never above 100
              AlertConfig("val_loss", 100.0, "maximize", wandb_alert_level="ERROR"),  # always below 100
              AlertConfig("never_recorded", 1.0)]
    callback = WandBTracking(alerts=alerts, source_dirs=[str(source / "pkg"), str(source / "train.py")],
                             log_dir=str(tmp_path / "logs"), is_project=False, project_name="p",
                             experiment_name="e")
    tl = make_train_loop()
    tl.fit(num_epochs=2, callbacks=[callback])

    (run_dir,) = offline_run_dirs(tmp_path / "logs")
    run = WandbRun(run_dir)
    assert (run.run.project, run.run.display_name) == ("p", "e")
    assert run.values("metrics/val_loss") == {} and len(run.values("loss_at_epoch_end/val_loss")) == 2
    assert run.values("train_loss/last_batch_loss") == {}  # batch_log_frequency=None (1.x's default)
    sent = [(alert.title, alert.level, alert.text) for alert in run.alerts]
    val_loss = tl.train_history["val_loss"]
    assert [(title, level) for title, level, _ in sent] == [("val_loss is too high", "INFO"),
                                                            ("val_loss is too low", "ERROR")] * 2
    assert str(val_loss[0]) in sent[0][2] and str(val_loss[1]) in sent[2][2]
    code = {artifact.name: sorted(entry.path for entry in artifact.manifest.contents) for artifact in run.artifacts
            if artifact.type == "code"}
    assert code == {"pkg": ["module.py"], "train.py": ["train.py"]}


def test_a_run_started_by_the_user_is_used_and_left_open(tmp_path, wandb_offline):
    import wandb
    own_run = wandb.init(project="mine", dir=str(tmp_path), mode="offline")
    try:
        callback = WandBTracking(wandb_pre_initialized=True, hyperparams={"lr": 0.1}, tags=["extra"],
                                 is_project=False)
        tl = make_train_loop()
        tl.fit(num_epochs=1, callbacks=[callback])
        assert wandb.run is own_run  # not finished by the callback
        own_run.log({"after_training": 1.0}, step=10)
    finally:
        own_run.finish()
    run = WandbRun(offline_run_dirs(tmp_path)[0])
    assert run.config["lr"] == 0.1
    assert run.values("loss_at_epoch_end/val_loss") == {4: tl.train_history["val_loss"][0]}
    assert run.values("after_training") == {10: 1.0}


class FailOnce(AbstractCallback):
    def __init__(self, at_step: int):
        super().__init__("fail once")
        self.at_step = at_step

    def on_batch_end(self):
        if self.train_loop_obj.total_iteration_idx == self.at_step:
            self.at_step = None
            raise RuntimeError("simulated failure")


def test_an_exception_finishes_the_run_as_failed_and_the_next_fit_resumes_it(tmp_path, wandb_offline):
    callback = WandBTracking(batch_log_frequency=1, log_dir=str(tmp_path), is_project=False)
    tl = make_train_loop()
    with pytest.raises(RuntimeError, match="simulated failure"):
        tl.fit(num_epochs=2, callbacks=[callback, FailOnce(at_step=6)])
    tl.fit(num_epochs=2)
    first, second = [WandbRun(path) for path in offline_run_dirs(tmp_path)]
    assert first.exit_code == 1 and second.exit_code == 0
    assert first.run.run_id == second.run.run_id == callback.run_id  # resumed: one W&B run
    assert sorted(first.values("train_loss/last_batch_loss")) == [0, 1, 2, 3, 4, 5]
    # batch 6 stepped before the failure: the next fit finishes its batch end, which logs it
    assert sorted(second.values("train_loss/last_batch_loss")) == [6, 7, 8, 9]
    assert second.values("loss_at_epoch_end/val_loss") == {9: tl.train_history["val_loss"][1]}


def test_a_ctrl_c_in_the_runs_finish_closes_it_as_interrupted_and_the_next_fit_finishes_it(tmp_path, wandb_offline,
                                                                                          monkeypatch):
    """Review 49l F5: end_run let go of the run before run.finish(), so a Ctrl-C during the final sync left it to
    nobody: on_exception did not close it as interrupted (as the docs say), and the next fit's wandb.init ran while
    it was still active (an empty offline-run folder)."""
    import wandb
    from wandb.sdk.wandb_run import Run

    finish, exit_codes = Run.finish, []

    def finish_interrupted_once(run, *args, **kwargs):
        exit_codes.append(kwargs.get("exit_code"))
        if len(exit_codes) == 1:
            raise KeyboardInterrupt  # during the final sync
        return finish(run, *args, **kwargs)

    monkeypatch.setattr(Run, "finish", finish_interrupted_once)
    callback = WandBTracking(log_dir=str(tmp_path), is_project=False)
    tl = make_train_loop(test=True)
    with pytest.raises(KeyboardInterrupt):
        tl.fit(num_epochs=2, callbacks=[callback])
    tl.fit(num_epochs=2)  # finishes the train end
    assert exit_codes == [0, 1, 0] and wandb.run is None and callback.run is None
    first, second = [WandbRun(path) for path in offline_run_dirs(tmp_path)]  # each holds its run's file
    assert first.exit_code == 1 and second.exit_code == 0
    # logged before the Ctrl-C, with the run's other values: once
    assert first.values("loss_at_epoch_end/train_end_test_loss") == {9: tl.train_history["train_end_test_loss"][0]}
    assert second.values("loss_at_epoch_end/train_end_test_loss") == {}


def test_arguments_are_checked_and_a_missing_package_is_named(tmp_path, monkeypatch):
    with pytest.raises(TypeError, match="AlertConfig"):
        WandBTracking(alerts=[{"metric_name": "val_loss"}])
    with pytest.raises(ValueError, match="objective"):
        WandBTracking(alerts=[AlertConfig("val_loss", 1.0, objective="lower")])
    with pytest.raises(ValueError, match="do not exist"):
        WandBTracking(source_dirs=[str(tmp_path / "missing")])
    with pytest.raises(TypeError, match="tags"):
        WandBTracking(tags="baseline")
    with pytest.raises(ValueError, match="batch_log_frequency"):
        WandBTracking(batch_log_frequency=0)
    # is_project (the default) with a plain TrainLoop and some of the experiment details only: refused at
    # registration (with none, the loop's default run folder is taken).
    with pytest.raises(MissingExperimentDetailsError, match="WandBTracking"):
        make_train_loop().fit(num_epochs=1, callbacks=[WandBTracking(project_name="p")])
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"aitoolbox\[wandb\]"):
        make_train_loop().fit(num_epochs=1, callbacks=[WandBTracking(is_project=False)])


NO_NETWORK_SCRIPT = """
import os, sys, torch
sys.path.insert(0, {repo!r})
from tests.torchtrain.callbacks.tracking_support import make_train_loop
from aitoolbox.torchtrain.callbacks.csv_logger import CSVLogger
from aitoolbox.torchtrain.callbacks.mlflow import MLflowTracking
from aitoolbox.torchtrain.callbacks.wandb import WandBTracking
folder = {folder!r}
callbacks = [WandBTracking(batch_log_frequency=1, log_dir=folder, is_project=False, project_name="p"),
             CSVLogger(log_dir=folder, is_project=False)]
try:
    import sqlalchemy  # noqa: F401  (the SQLite store)
    callbacks.append(MLflowTracking("sqlite:///" + folder + "/mlflow.db", project_name="p"))
except ImportError:
    pass
make_train_loop().fit(num_epochs=1, callbacks=callbacks)
print("trained", len(callbacks))
"""


def network_namespace_available() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    return subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux" or not network_namespace_available(),
                    reason="needs a Linux network namespace (unshare -n, as root)")
def test_training_with_every_tracker_needs_no_network(tmp_path, wandb_offline):
    """In a network namespace with only the loopback interface: any attempt to reach another host fails, in
    Python and in wandb's own service process alike, yet the run completes and all files are written."""
    script = tmp_path / "train.py"
    script.write_text(NO_NETWORK_SCRIPT.format(repo=REPO_ROOT, folder=str(tmp_path)))
    command = f"ip link set lo up && exec {sys.executable} {script}"
    completed = subprocess.run(["unshare", "-n", "sh", "-c", command], capture_output=True, text=True,
                               timeout=300, env=dict(os.environ, WANDB_BASE_URL="https://api.wandb.ai"))
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.strip().startswith("trained")
    (run_dir,) = offline_run_dirs(tmp_path)
    assert len(WandbRun(run_dir).values("train_loss/last_batch_loss")) == 5
    assert (tmp_path / "batch_log.csv").is_file()

