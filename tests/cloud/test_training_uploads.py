"""Training with ``cloud_save_mode``: the presets and callbacks upload every file they write to the bucket under
aitoolbox 1.8's keys, in the background; ``fit`` returns once the uploads are done and reports a failed one
naming bucket and key; ModelLoadContinueTraining and ``auto_resume`` continue bitwise from the bucket.

Against moto's S3 server and the GCS emulator (see conftest.py); a FaultyProxy slows the network or cuts it.
"""
import os
import shutil

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.cloud.layout import list_cloud_checkpoints
from aitoolbox.cloud.staging import STAGING_PREFIX
from aitoolbox.cloud.storage import CloudStorageError
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.basic import LogUpload
from aitoolbox.torchtrain.callbacks.cloud_upload import CloudUploads
from aitoolbox.torchtrain.callbacks.gradient import GradDistributionPlot
from aitoolbox.torchtrain.callbacks.history_output import ModelTrainHistoryFileWriter
from aitoolbox.torchtrain.callbacks.model_load import ModelLoadContinueTraining
from aitoolbox.torchtrain.model_predict import PyTorchModelPredictor
from aitoolbox.torchtrain.train_loop import TrainLoop, TrainLoopCheckpoint, TrainLoopCheckpointEndSave
from aitoolbox.experiment.result_package.basic_packages import ClassificationResultPackage
from tests.cloud.buckets import FAST_RETRY
from tests.cloud.test_uploader import open_files_below
from tests.helpers import MLP, TrainEndCounter, classification_data, single_torch_thread

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")

# aitoolbox 1.x's other names of each service, used here in turn with the short ones.
MODE_ALIASES = {"s3": "aws_s3", "gcs": "google_storage"}


def preset_arguments(train_samples: int = 20, model_seed: int = 0):
    torch.manual_seed(model_seed)
    model = MLP()
    train = DataLoader(classification_data(train_samples), batch_size=4, shuffle=True,
                       generator=torch.Generator().manual_seed(1))
    validation = DataLoader(classification_data(12, seed=3), batch_size=5)
    test = DataLoader(classification_data(10, seed=4), batch_size=5)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, train, validation, test, optimizer, nn.CrossEntropyLoss()


def cloud(service, bucket, prefix="team", **options):
    """The preset arguments of a run uploading to ``bucket``."""
    return dict(cloud_save_mode=service, bucket_name=bucket.bucket_name, cloud_dir_prefix=prefix,
                cloud_storage_options=options or None, show_progress=False)


def local_files(folder: str) -> dict:
    """``{path inside folder ('/'-separated): content}`` of every file below ``folder``."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as handle:
                files[os.path.relpath(path, folder).replace(os.sep, "/")] = handle.read()
    return files


def bucket_files(bucket, prefix: str) -> dict:
    return {obj.key[len(prefix) + 1:]: bucket.download_bytes(obj.key) for obj in bucket.list(prefix + "/")}


class CrashAt(AbstractCallback):
    """Raises at the start of a batch, as a crashed or preempted job stops."""

    def __init__(self, epoch: int, iteration: int):
        super().__init__("crash")
        self.epoch, self.iteration = epoch, iteration

    def on_batch_begin(self):
        tl = self.train_loop_obj
        if (tl.epoch, tl.iteration) == (self.epoch, self.iteration):
            raise RuntimeError("the machine went away")


class Probe(AbstractCallback):
    """After the checkpoints of each epoch (and before the uploads are waited for): runs ``at_epoch_end(tl)``
    and records the uploads still pending then."""

    def __init__(self, at_epoch_end=None, at_train_end=None):
        super().__init__("probe", execution_order=500)
        self.at_epoch_end, self.at_train_end = at_epoch_end, at_train_end
        self.pending_at_epoch_end, self.pending_at_train_end = [], None

    def on_epoch_end(self):
        self.pending_at_epoch_end.append(CloudUploads.of(self.train_loop_obj).pending)
        if self.at_epoch_end is not None:
            self.at_epoch_end(self.train_loop_obj)

    def on_train_end(self):
        self.pending_at_train_end = CloudUploads.of(self.train_loop_obj).pending
        if self.at_train_end is not None:
            self.at_train_end(self.train_loop_obj)


def test_a_preset_run_uploads_every_file_under_1_8s_keys(service, bucket, tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("matplotlib")
    from aitoolbox.torchtrain.callbacks.tensorboard import TensorboardTrainHistoryMetric
    script = tmp_path / "my_experiment.py"
    script.write_text("# the experiment script\n")
    hyperparams = {"lr": 1e-2, "experiment_file_path": str(script)}
    tl = TrainLoopCheckpointEndSave(
        *preset_arguments(), "proj", "exp", str(tmp_path / "results"), hyperparams,
        val_result_package=ClassificationResultPackage(), rm_subopt_local_models=True, num_best_checkpoints_kept=1,
        **cloud(MODE_ALIASES[service], bucket))
    log_file = tmp_path / "training.log"
    log_file.write_text("epoch 0\nepoch 1\n")
    tl.fit(num_epochs=3, callbacks=[TensorboardTrainHistoryMetric(), ModelTrainHistoryFileWriter(),
                                    LogUpload(str(log_file)),
                                    # its own arguments: the same bucket, another folder in it
                                    GradDistributionPlot(lambda model: [model.fc1], cloud_save_mode=service,
                                                         bucket_name=bucket.bucket_name, cloud_dir_prefix="grads")])
    run_key = f"team/proj/exp_{tl.experiment_timestamp}"
    uploaded = bucket_files(bucket, run_key)
    local = local_files(tl.experiment_folder.path)
    name = f"exp_{tl.experiment_timestamp}"

    # Everything of the run folder is in the bucket at its path inside the folder (TensorBoard's events under
    # 1.8's tensorboard/<project>_<experiment>/), the gradient plots under their own prefix.
    events = {path: data for path, data in local.items() if path.startswith("tensorboard/")}
    assert events and all(path.startswith("tensorboard/events.out.tfevents.") for path in events)
    grads = {path: data for path, data in local.items() if path.startswith("results/grad_distribution/")}
    assert sorted(grads) == [f"results/grad_distribution/epoch_{epoch}/layer_0.png" for epoch in range(3)]
    expected = {path: data for path, data in local.items() if path not in events and path not in grads}
    expected.update({f"tensorboard/proj_exp/{path[len('tensorboard/'):]}": data for path, data in events.items()})
    expected["training.log"] = log_file.read_bytes()
    # Pruning removes local checkpoints only: the bucket keeps every one, as in aitoolbox 1.8.
    checkpoints = {f"checkpoint_model/model_{name}_E{epoch}.pth" for epoch in range(3)}
    assert checkpoints - set(local) and checkpoints <= set(uploaded)
    assert {path: data for path, data in uploaded.items() if path not in checkpoints - set(local)} == expected
    assert {"hyperparams_list.txt", "hyperparams.json", "my_experiment.py", "results/results.json",
            "results/results.txt", "results/plots/loss.png", f"model/model_{name}.pth"} <= set(uploaded)
    assert bucket_files(bucket, f"grads/proj/{name}") == grads

    # aitoolbox 1.8's loader (at its 1.8 import path) downloads and loads a checkpoint of the run.
    if service == "s3":
        from aitoolbox.cloud.AWS.model_load import PyTorchS3ModelLoader as Loader
    else:
        from aitoolbox.cloud.GoogleCloud.model_load import PyTorchGoogleStorageModelLoader as Loader
    loader = Loader(str(tmp_path / "elsewhere"), bucket_name=bucket.bucket_name, cloud_dir_prefix="team")
    loaded = loader.load_model("proj", "exp", tl.experiment_timestamp, "checkpoint_model", epoch_num=0)
    assert loaded["epoch"] == 0 and set(loaded["model_state_dict"]) == set(tl.model.state_dict())
    assert not CloudUploads.of(tl).pending


def test_uploads_do_not_stall_training_and_fit_returns_once_they_are_done(service, bucket, proxy, tmp_path):
    # The network stalls for the whole training, up to the last epoch's end (the end of training waits for the
    # uploads, in the checkpoint callback's on_train_end): training that went on through three epochs with
    # uploads pending at each epoch's end never waited for one.
    proxy.hold()

    def release_after_the_last_epoch(tl):
        if tl.epoch == 2:
            proxy.release()

    probe = Probe(at_epoch_end=release_after_the_last_epoch)
    tl = TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", str(tmp_path), {}, **cloud(service, bucket))
    tl.fit(num_epochs=3, callbacks=[probe])
    assert len(probe.pending_at_epoch_end) == 3 and all(pending >= 1 for pending in probe.pending_at_epoch_end)
    assert CloudUploads.of(tl).pending == 0  # fit returned only once they were done
    keys = list_cloud_checkpoints(bucket, f"team/proj/exp_{tl.experiment_timestamp}/checkpoint_model")
    assert [os.path.basename(key) for key in keys] == [f"model_exp_{tl.experiment_timestamp}_E{epoch}.pth"
                                                       for epoch in range(3)]


def test_uploads_slower_than_checkpointing_hold_one_file_open_drop_superseded_versions_and_end_with_the_newest(
        service, bucket, proxy, tmp_path, aitoolbox_records):
    # The network stalls for three epochs: checkpoints pile up behind the first upload while the best-1 pruning
    # deletes the older ones locally.
    proxy.hold()
    open_at_epoch_end, pending_at_epoch_end = [], []

    def look(tl):
        open_at_epoch_end.append(open_files_below(tl.experiment_folder.path))
        pending_at_epoch_end.append(CloudUploads.of(tl).pending)
        if tl.epoch == 2:
            proxy.release()

    tl = TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", str(tmp_path), {}, rm_subopt_local_models="loss",
                             num_best_checkpoints_kept=1, **cloud(service, bucket))
    tl.fit(num_epochs=4, callbacks=[Probe(look)])
    name = f"exp_{tl.experiment_timestamp}"
    # Only the upload in progress held a file open, however many waited (the old uploader held each queued file).
    assert all(len(held) <= 1 for held in open_at_epoch_end[:3]) and pending_at_epoch_end[2] >= 4
    dropped = [record.getMessage() for record in aitoolbox_records.records
               if record.getMessage().startswith("Dropped the queued upload")]
    assert any(".aitoolbox-checkpoint-ranking.json" in message for message in dropped)  # older versions dropped

    local = local_files(tl.experiment_folder.path)
    uploaded = bucket_files(bucket, f"team/proj/{name}")
    checkpoints = [f"checkpoint_model/model_{name}_E{epoch}.pth" for epoch in range(4)]
    assert set(checkpoints) - set(local)  # pruned locally while their uploads waited ...
    assert set(checkpoints) <= set(uploaded)  # ... they still reached the bucket, as in aitoolbox 1.8
    newest = list_cloud_checkpoints(bucket, f"team/proj/{name}/checkpoint_model")[-1]
    assert newest.endswith(checkpoints[-1]) and uploaded[checkpoints[-1]] == local[checkpoints[-1]]
    ranking = "checkpoint_model/.aitoolbox-checkpoint-ranking.json"
    assert uploaded[ranking] == local[ranking]  # the newest version of a file submitted again
    assert not [path for path in local if os.path.basename(path).startswith(STAGING_PREFIX)]  # no pin left


# The GCS run (about 30 s: the emulator's retries) in the extended tier; S3 in the suite.
@pytest.mark.parametrize("service", ["s3", pytest.param("gcs", marks=[pytest.mark.slow, pytest.mark.extended])],
                         indirect=True)
def test_a_bucket_gone_mid_run_fails_fit_at_the_end_naming_bucket_and_key_and_keeps_every_local_file(
        service, bucket, proxy, tmp_path, aitoolbox_records):
    def network_down_after_epoch_0(tl):
        if tl.epoch == 0:
            CloudUploads.of(tl).wait()  # epoch 0's files are in the bucket
            proxy.cut_after_bytes = proxy.forwarded_bytes  # then nothing more gets through

    tl = TrainLoopCheckpointEndSave(*preset_arguments(), "proj", "exp", str(tmp_path), {},
                                    **cloud(service, bucket, retry=FAST_RETRY))
    with pytest.raises(CloudStorageError) as raised:
        tl.fit(num_epochs=3, callbacks=[Probe(network_down_after_epoch_0)])
    name = f"exp_{tl.experiment_timestamp}"
    error = raised.value
    assert error.bucket == bucket.bucket_name and error.key.startswith(f"team/proj/{name}/")
    assert bucket.bucket_name in str(error) and error.key in str(error) and "upload it again" in str(error)
    assert tl.epochs_completed == 3  # training went on to the end
    failures = [record.getMessage() for record in aitoolbox_records.records if record.levelname == "ERROR"]
    assert any("the local file is kept" in message for message in failures)  # logged when they happened

    local = local_files(tl.experiment_folder.path)
    written = {f"checkpoint_model/model_{name}_E{epoch}.pth" for epoch in range(3)}
    assert written | {f"model/model_{name}.pth", "results/results.json"} <= set(local)
    proxy.cut_after_bytes, proxy._down = None, False  # the network is back: look at what the bucket holds
    uploaded = bucket_files(bucket, f"team/proj/{name}")
    assert f"checkpoint_model/model_{name}_E0.pth" in uploaded
    assert f"checkpoint_model/model_{name}_E1.pth" not in uploaded
    assert all(local[path] == data for path, data in uploaded.items())  # nothing half-uploaded is visible


def crash_a_cloud_run(service, bucket, root, **options):
    """A run uploading to ``bucket`` that crashes in epoch 1 (its newest checkpoint: E1_ITER7)."""
    tl = TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", root, {}, iteration_save_freq=2,
                             **cloud(service, bucket), **options)
    with pytest.raises(RuntimeError, match="went away"):
        tl.fit(num_epochs=3, callbacks=[CrashAt(epoch=1, iteration=4)])
    return tl


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """Three epochs without a crash, local files only: the reference of the resumed runs."""
    tl = TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", str(tmp_path_factory.mktemp("straight")), {},
                             iteration_save_freq=2, show_progress=False)
    tl.fit(num_epochs=3)
    return tl


def assert_same_training(tl, reference):
    for key, value in reference.model.state_dict().items():
        assert torch.equal(tl.model.state_dict()[key], value), key
    assert tl.train_history == reference.train_history


def test_model_load_continue_training_resumes_from_the_bucket_bitwise(service, bucket, tmp_path, straight_run):
    crashed = crash_a_cloud_run(service, bucket, str(tmp_path / "machine_1"))
    shutil.rmtree(tmp_path / "machine_1")  # the machine is gone with its disk

    # Other initial weights: only the checkpoint's make it train like the straight run.
    tl = TrainLoopCheckpoint(*preset_arguments(model_seed=7), "proj", "resumed", str(tmp_path / "machine_2"), {},
                             iteration_save_freq=2, show_progress=False)
    load = ModelLoadContinueTraining(crashed.experiment_timestamp, project_name="proj", experiment_name="exp",
                                     local_model_result_folder_path=str(tmp_path / "machine_2"),
                                     cloud_save_mode=service, bucket_name=bucket.bucket_name, cloud_dir_prefix="team")
    tl.fit(num_epochs=3, callbacks=[load])
    assert load.checkpoint["iteration_idx"] == 7  # the newest checkpoint in the bucket: E1_ITER7
    downloaded = tmp_path / "machine_2" / "proj" / f"exp_{crashed.experiment_timestamp}" / "checkpoint_model"
    assert os.listdir(downloaded) == [f"model_exp_{crashed.experiment_timestamp}_E1_ITER7.pth"]
    assert_same_training(tl, straight_run)

    # An epoch named: that checkpoint (1.x's way), downloaded beside the other.
    again = TrainLoop(*preset_arguments(), show_progress=False)
    again.fit(num_epochs=1, callbacks=[ModelLoadContinueTraining(
        crashed.experiment_timestamp, epoch_num=0, project_name="proj", experiment_name="exp",
        local_model_result_folder_path=str(tmp_path / "machine_2"), cloud_save_mode=service,
        bucket_name=bucket.bucket_name, cloud_dir_prefix="team")])
    assert again.epochs_completed == 1 and (downloaded / f"model_exp_{crashed.experiment_timestamp}_E0.pth").exists()


def test_auto_resume_continues_the_newest_run_in_the_bucket_bitwise(service, bucket, tmp_path, straight_run):
    root = str(tmp_path / "results")
    first = crash_a_cloud_run(service, bucket, root, auto_resume=True)
    assert first.resumed_from is None
    shutil.rmtree(root)  # restarted on a new machine: no local run

    again = TrainLoopCheckpoint(*preset_arguments(model_seed=7), "proj", "exp", root, {}, iteration_save_freq=2,
                                auto_resume=True, **cloud(service, bucket))
    assert again.experiment_timestamp == first.experiment_timestamp
    assert again.resumed_from == os.path.join(again.experiment_folder.checkpoint_dir,
                                              f"model_exp_{first.experiment_timestamp}_E1_ITER7.pth")
    again.fit(num_epochs=3)
    assert_same_training(again, straight_run)
    assert os.listdir(os.path.join(root, "proj")) == [f"exp_{first.experiment_timestamp}"]
    newest = list_cloud_checkpoints(bucket, f"team/proj/exp_{first.experiment_timestamp}/checkpoint_model")[-1]
    assert newest.endswith(f"model_exp_{first.experiment_timestamp}_E2.pth")  # the continued run uploads on

    # Nothing in the bucket for another experiment: a new run starts.
    fresh = TrainLoopCheckpoint(*preset_arguments(), "proj", "other", root, {}, auto_resume=True,
                                **cloud(service, bucket))
    assert fresh.resumed_from is None and fresh.epochs_completed == 0
    # A bucket that cannot be read is an error, not a new run beside the one to continue.
    with pytest.raises(CloudStorageError, match="aitoolbox-no-such-bucket"):
        TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", str(tmp_path / "new_machine"), {}, auto_resume=True,
                            cloud_save_mode=service, bucket_name="aitoolbox-no-such-bucket")
    assert not os.path.exists(tmp_path / "new_machine" / "proj")


def test_auto_resume_from_the_bucket_continues_only_a_run_of_this_job(service, bucket, tmp_path, monkeypatch):
    """The run folder's aitoolbox_run.json goes up with the run: a job restarted on a new machine continues the
    bucket's run only when it is the same job (SLURM_JOB_ID here), another job starts its own run."""
    for name in ("AITOOLBOX_RUN_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "31")
    first = crash_a_cloud_run(service, bucket, str(tmp_path / "machine_1"), auto_resume=True)
    assert bucket.exists(f"team/proj/exp_{first.experiment_timestamp}/aitoolbox_run.json")

    monkeypatch.setenv("SLURM_JOB_ID", "32")  # another job of the sweep, on another machine
    other = TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", str(tmp_path / "machine_2"), {},
                                iteration_save_freq=2, auto_resume=True, **cloud(service, bucket))
    # (Its folder may get the same timestamp when it starts within the same second: another machine's disk.)
    assert other.resumed_from is None and other.epochs_completed == 0

    monkeypatch.setenv("SLURM_JOB_ID", "31")  # the requeued job, on a third machine
    again = TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", str(tmp_path / "machine_3"), {},
                                iteration_save_freq=2, auto_resume=True, **cloud(service, bucket))
    assert again.experiment_timestamp == first.experiment_timestamp and again.resumed_from is not None


def test_model_predict_uploads_its_results_file(service, bucket, tmp_path):
    torch.manual_seed(0)
    predictor = PyTorchModelPredictor(MLP(), DataLoader(classification_data(10), batch_size=5))
    path = predictor.evaluate_model(ClassificationResultPackage(), "proj", "eval", str(tmp_path),
                                    cloud_save_mode=service, bucket_name=bucket.bucket_name, cloud_dir_prefix="team")
    run_folder = os.path.dirname(os.path.dirname(path))
    key = f"team/proj/{os.path.basename(run_folder)}/results/{os.path.basename(path)}"
    with open(path, "rb") as handle:
        assert bucket.download_bytes(key) == handle.read()


def test_an_unreachable_bucket_at_the_end_of_model_predict_names_it(service, tmp_path):
    from aitoolbox.cloud.storage import CloudNotFoundError
    predictor = PyTorchModelPredictor(MLP(), DataLoader(classification_data(10), batch_size=5))
    with pytest.raises(CloudNotFoundError, match="aitoolbox-no-such-bucket"):
        predictor.evaluate_model(ClassificationResultPackage(), "proj", "eval", str(tmp_path),
                                 cloud_save_mode=service, bucket_name="aitoolbox-no-such-bucket")
    assert os.listdir(tmp_path / "proj")  # the local results file is kept


def test_background_saves_upload_once_written_and_a_second_fit_uploads_on(service, bucket, tmp_path):
    pytest.importorskip("tensorboard")
    from aitoolbox.torchtrain.callbacks.tensorboard import TensorboardTrainBatchLoss
    seen_after_epoch_0 = {}

    def tensorboard_up_after_epoch_0(tl):
        if tl.epoch == 0:  # the event files went up at the end of the epoch, as they were then
            CloudUploads.of(tl).wait()
            run_key = f"team/proj/exp_{tl.experiment_timestamp}"
            seen_after_epoch_0.update(bucket=bucket_files(bucket, f"{run_key}/tensorboard/proj_exp"),
                                      local=local_files(os.path.join(tl.experiment_folder.path, "tensorboard")))

    tl = TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", str(tmp_path), {}, background_save=True,
                             **cloud(service, bucket))
    tl.fit(num_epochs=2, callbacks=[TensorboardTrainBatchLoss(), Probe(tensorboard_up_after_epoch_0)])
    assert seen_after_epoch_0["bucket"] and seen_after_epoch_0["bucket"] == seen_after_epoch_0["local"]
    tl.fit(num_epochs=3)  # the uploads of a later fit start anew
    run_key = f"team/proj/exp_{tl.experiment_timestamp}"
    uploaded = bucket_files(bucket, run_key)
    local = local_files(tl.experiment_folder.path)
    for epoch in range(3):
        path = f"checkpoint_model/model_exp_{tl.experiment_timestamp}_E{epoch}.pth"
        assert uploaded[path] == local[path]
    events = {path[len("tensorboard/"):]: data for path, data in local.items() if path.startswith("tensorboard/")}
    assert len(events) == 2  # one event file per fit, both up to date in the bucket
    assert bucket_files(bucket, f"{run_key}/tensorboard/proj_exp") == events


def test_a_missing_client_library_or_a_bad_option_fails_before_training(monkeypatch, tmp_path):
    import sys
    pytest.importorskip("boto3")
    with pytest.raises(TypeError, match="cloud_storage_options"):
        TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", str(tmp_path), {}, cloud_save_mode="s3",
                            cloud_storage_options={"endpoint": "http://127.0.0.1:1"})
    monkeypatch.setitem(sys.modules, "boto3", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install aitoolbox\[aws\]"):
        TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", str(tmp_path), {}, cloud_save_mode="s3")
    tl = TrainLoop(*preset_arguments())
    callback = ModelTrainHistoryFileWriter(project_name="proj", experiment_name="exp",
                                           local_model_result_folder_path=str(tmp_path), cloud_save_mode="aws",
                                           bucket_name="my-bucket")
    with pytest.raises(ImportError, match=r"pip install aitoolbox\[aws\]"):
        tl.callbacks_handler.register_callbacks([callback])


def test_the_csv_logs_go_to_the_bucket_after_each_epoch_and_when_fit_stops(service, bucket, tmp_path):
    from aitoolbox.torchtrain.callbacks.csv_logger import CSVLogger
    tl = TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", str(tmp_path / "results"), {"lr": 1e-2},
                             **cloud(service, bucket))
    outside = CSVLogger(log_dir=str(tmp_path / "elsewhere"))
    with pytest.raises(RuntimeError, match="went away"):
        tl.fit(num_epochs=3, callbacks=[CSVLogger(), outside, CrashAt(epoch=1, iteration=2)])
    run_key = f"team/proj/exp_{tl.experiment_timestamp}"
    csv_folder = os.path.join(tl.experiment_folder.path, "csv_logs")
    local = local_files(csv_folder)
    assert set(local) == {"batch_log.csv", "epoch_log.csv", "run_info.json"}
    # The batches of the interrupted epoch are in the bucket too: the files were uploaded when fit stopped.
    assert local["batch_log.csv"].count(b"\n") == 1 + 5 + 2
    assert bucket_files(bucket, f"{run_key}/csv_logs") == local
    # A log folder outside the run folder stays local only.
    assert os.path.isfile(tmp_path / "elsewhere" / "batch_log.csv")
    assert not [item.key for item in bucket.list(f"{run_key}/") if "elsewhere" in item.key]


def test_a_finished_run_continued_from_the_bucket_on_a_new_machine_runs_no_train_end_again(service, bucket, tmp_path):
    """Issue 32: the record of the finished train ends (``.train_end_done.json``) goes to the bucket and comes back with
    the checkpoint: without it a finished run's final checkpoint looks like one whose job was killed before its end,
    and the end (test evaluation, final saves, uploads) would run again."""
    root = str(tmp_path / "results")
    first = TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", root, {}, auto_resume=True,
                                **cloud(service, bucket))
    counter = TrainEndCounter()
    first.fit(num_epochs=2, callbacks=[counter])
    assert counter.ends == 1
    shutil.rmtree(root)  # restarted on a new machine: no local run

    again = TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", root, {}, auto_resume=True,
                                **cloud(service, bucket))
    assert again.experiment_timestamp == first.experiment_timestamp and again.epochs_completed == 2
    counter = TrainEndCounter()
    again.fit(num_epochs=2, callbacks=[counter])
    assert counter.ends == 0
    assert os.path.exists(os.path.join(again.experiment_folder.path, ".train_end_done.json"))
