"""Secrets in hyperparameters never reach what a run writes or sends: the run folder (hyperparameter files,
checkpoints, ``run_info.json``), W&B offline run files and MLflow's store. The training script's dict keeps them.

Each destination is searched byte for byte for the secret strings; the redaction rules themselves are tested in
tests/experiment/test_redaction.py. The e-mail and the bucket uploads are in tests/cloud/test_secrets_redacted.py.
"""
import copy
import json
import logging
import os

import pytest
import torch

from aitoolbox.experiment.redaction import Secret
from aitoolbox.experiment.result_package.basic_packages import ClassificationResultPackage
from aitoolbox.torchtrain.callbacks.csv_logger import CSVLogger
from aitoolbox.torchtrain.callbacks.model_save import ModelCheckpoint
from aitoolbox.torchtrain.train_loop import TrainLoopCheckpointEndSave
from tests.torchtrain.callbacks import tracking_support as support
from tests.torchtrain.callbacks.tracking_support import WandbRun, make_train_loop, offline_run_dirs

wandb_offline = support.wandb_offline
no_network = support.no_network

API_KEY = "sk-live-4f9a2c7e1b"
DB_PASSWORD = "hunter2-db-pw-93"
WRAPPED = "postgresql://trainer:wrapped-pw-51@db.internal/runs"
SECRETS = (API_KEY, DB_PASSWORD, "wrapped-pw-51")


def secret_hyperparams() -> dict:
    return {"lr": 0.1, "api_key": API_KEY, "max_tokens": 512, "tokenizer": "bpe-32k",
            "database": {"host": "db.internal", "password": DB_PASSWORD}, "results_db": Secret(WRAPPED)}


def files_holding_secrets(folder) -> list:
    """``(path, secret)`` for every file below ``folder`` that holds one of :data:`SECRETS` as bytes."""
    found = []
    for root, _, names in os.walk(str(folder)):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as handle:
                data = handle.read()
            found += [(path, secret) for secret in SECRETS if secret.encode() in data]
    return found


def assert_redacted(written: dict) -> None:
    """The non-secret values as given, the secret ones replaced."""
    assert (written["lr"], written["max_tokens"], written["tokenizer"]) == (0.1, 512, "bpe-32k")
    assert written["api_key"] == "<redacted>" and written["results_db"] == "<redacted>"
    assert written["database"] == {"host": "db.internal", "password": "<redacted>"}


def test_run_folder_files_checkpoints_and_run_info_hold_no_secret(tmp_path):
    hyperparams = secret_hyperparams()
    given = copy.deepcopy(hyperparams)
    package = ClassificationResultPackage()
    tl = make_train_loop(TrainLoopCheckpointEndSave, project_name="proj", experiment_name="exp",
                         local_model_result_folder_path=str(tmp_path / "results"), hyperparams=hyperparams,
                         val_result_package=package, iteration_save_freq=4)
    own_checkpoints = ModelCheckpoint(hyperparams=hyperparams)  # a callback given the dict directly
    tl.fit(num_epochs=2, callbacks=[CSVLogger(), own_checkpoints])

    folder = tl.experiment_folder
    assert files_holding_secrets(folder.path) == []
    with open(os.path.join(folder.path, "hyperparams.json"), encoding="utf-8") as handle:
        assert_redacted(json.load(handle))
    listed = open(os.path.join(folder.path, "hyperparams_list.txt"), encoding="utf-8").read().splitlines()
    assert "api_key:\t<redacted>" in listed and "lr:\t0.1" in listed
    with open(os.path.join(folder.path, "csv_logs", "run_info.json"), encoding="utf-8") as handle:
        assert_redacted(json.load(handle)["hyperparams"])
    checkpoints = [os.path.join(root, name) for root, _, names in os.walk(folder.path) for name in names
                   if name.endswith(".pth")]
    # Epoch checkpoints (twice: the preset's and our callback's), iteration checkpoints and the final model.
    assert len(checkpoints) >= 4 and any("model" + os.sep in path for path in checkpoints)
    for path in checkpoints:
        assert_redacted(torch.load(path, weights_only=True)["hyperparams"])
    assert_redacted(package.get_hyperparameters())

    # The training script's dict, and the loop's and callbacks' copies, keep the real values.
    assert hyperparams == given and hyperparams["results_db"].get_secret_value() == WRAPPED
    assert tl.hyperparams["api_key"] == API_KEY and own_checkpoints.hyperparams["database"]["password"] == DB_PASSWORD


def test_a_checkpoint_the_user_takes_directly_holds_no_secret(tmp_path):
    # Not through a checkpoint callback: tl.checkpoint_state(hyperparams=...) in a script of one's own.
    hyperparams = secret_hyperparams()
    tl = make_train_loop()
    tl.fit(num_epochs=1)
    torch.save(tl.checkpoint_state(hyperparams=hyperparams), tmp_path / "mine.pth")
    assert files_holding_secrets(tmp_path) == []
    assert_redacted(torch.load(tmp_path / "mine.pth", weights_only=True)["hyperparams"])
    assert hyperparams["api_key"] == API_KEY


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_sharded_checkpoints_hold_no_secret(tmp_path):
    from aitoolbox.experiment.local_save.sharded_checkpoints import is_sharded_checkpoint, read_sharded_checkpoint_state
    from tests.torchtrain.distributed.test_fsdp import Tower, fit_fsdp, make_loop
    torch.manual_seed(0)
    hyperparams = secret_hyperparams()
    callback = ModelCheckpoint(project_name="proj", experiment_name="run", hyperparams=hyperparams,
                               local_model_result_folder_path=str(tmp_path))
    fit_fsdp(make_loop("fsdp", Tower()), [callback], num_epochs=1)

    (run_folder,) = os.listdir(tmp_path / "proj")
    (path,) = [entry.path for entry in os.scandir(tmp_path / "proj" / run_folder / "checkpoint_model")
               if entry.is_dir()]
    assert is_sharded_checkpoint(path) and files_holding_secrets(tmp_path) == []
    for rank in (0, 1):
        assert_redacted(read_sharded_checkpoint_state(path, rank)["hyperparams"])


def test_wandb_config_holds_no_secret(tmp_path, wandb_offline, no_network):
    pytest.importorskip("wandb")
    from aitoolbox.torchtrain.callbacks.wandb import WandBTracking
    hyperparams = secret_hyperparams()
    callback = WandBTracking(hyperparams=hyperparams, log_dir=str(tmp_path / "logs"), is_project=False,
                             project_name="p", experiment_name="e",
                             config={"db_password": DB_PASSWORD, "seed": 3})  # a wandb.init() argument
    make_train_loop().fit(num_epochs=1, callbacks=[callback])

    (run_dir,) = offline_run_dirs(tmp_path / "logs")
    assert_redacted(WandbRun(run_dir).config)
    assert (WandbRun(run_dir).config["seed"], WandbRun(run_dir).config["db_password"]) == (3, "<redacted>")
    assert files_holding_secrets(tmp_path) == []  # the run files, wandb's cache, staging and settings folders
    assert hyperparams["api_key"] == API_KEY


def test_wandb_uploads_source_files_only(tmp_path, wandb_offline, no_network):
    pytest.importorskip("wandb")
    from aitoolbox.torchtrain.callbacks.wandb import WandBTracking
    project = tmp_path / "project"
    (project / "pkg").mkdir(parents=True)
    (project / "train.py").write_text("print('train')\n")
    (project / "pkg" / "model.py").write_text("LAYERS = 2\n")
    (project / "config.yaml").write_text("lr: 0.1\n")
    (project / ".env").write_text(f"API_KEY={API_KEY}\n")
    (project / "credentials.json").write_text(json.dumps({"password": DB_PASSWORD}))
    (project / "pkg" / "secrets.py").write_text(f"TOKEN = {WRAPPED!r}\n")

    def code_files(log_dir, **options):
        callback = WandBTracking(source_dirs=[str(project), str(project / ".env")], log_dir=str(log_dir),
                                 is_project=False, project_name="p", experiment_name="e", **options)
        make_train_loop().fit(num_epochs=1, callbacks=[callback])
        (run_dir,) = offline_run_dirs(log_dir)
        return {artifact.name: sorted(entry.path for entry in artifact.manifest.contents)
                for artifact in WandbRun(run_dir).artifacts if artifact.type == "code"}

    assert code_files(tmp_path / "default") == {"project": ["pkg/model.py", "train.py"]}
    # include_fn adds other files; credentials files stay out whatever it says.
    assert code_files(tmp_path / "everything", include_fn=lambda path: True) == \
        {"project": ["config.yaml", "pkg/model.py", "train.py"]}
    assert files_holding_secrets(tmp_path / "wandb_home") == []
    assert files_holding_secrets(tmp_path / "default") == files_holding_secrets(tmp_path / "everything") == []


def test_wandb_never_uploads_credentials_files_nor_symbolic_links(tmp_path, wandb_offline, no_network, caplog,
                                                                   monkeypatch):
    pytest.importorskip("wandb")
    from aitoolbox.torchtrain.callbacks.wandb import WandBTracking
    project, outside = tmp_path / "project", tmp_path / "outside"
    for folder in (project / "pkg", project / ".kube", project / ".aws", outside / "lib"):
        folder.mkdir(parents=True)
    (project / "train.py").write_text("print('train')\n")
    (project / "config.yaml").write_text("lr: 0.1\n")
    planted = {"service-account.json": '{"private_key": "%s"}', ".s3cfg": "secret_key = %s", ".boto": "pw = %s",
               "kubeconfig": "token: %s", ".dockercfg": '{"auth": "%s"}', ".envrc": "export TOKEN=%s",
               ".my.cnf": "password=%s", ".kube/config": "token: %s", ".aws/config": "key = %s",
               "prod.tfvars": 'db_password = "%s"', ".netrc": "machine x password %s", "id_rsa": "%s"}
    for name, content in planted.items():
        (project / name).write_text(content % API_KEY)
    (outside / "credentials").write_text(f"aws_secret_access_key = {API_KEY}\n")
    (outside / "lib" / "helpers.py").write_text(f"TOKEN = {API_KEY!r}\n")
    os.symlink(outside / "credentials", project / "pkg" / "utils.py")  # a link named like code
    os.symlink(outside / "lib", project / "linked_lib")
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    caplog.set_level("WARNING", logger="aitoolbox")
    callback = WandBTracking(source_dirs=[str(project)], log_dir=str(tmp_path / "logs"), is_project=False,
                             project_name="p", experiment_name="e", include_fn=lambda path: True)
    make_train_loop().fit(num_epochs=1, callbacks=[callback])

    (run_dir,) = offline_run_dirs(tmp_path / "logs")
    code = {artifact.name: sorted(entry.path for entry in artifact.manifest.contents)
            for artifact in WandbRun(run_dir).artifacts if artifact.type == "code"}
    assert code == {"project": ["config.yaml", "train.py"]}
    assert files_holding_secrets(tmp_path / "logs") == files_holding_secrets(tmp_path / "wandb_home") == []
    # (a set: pytest 9.2 captures a record both at the logger given to caplog.set_level and at the root)
    (warning,) = {record.getMessage() for record in caplog.records if "symbolic link" in record.getMessage()}
    assert "linked_lib" in warning and "pkg/utils.py" in warning and str(outside) not in warning


def test_wandb_include_fn_is_checked():
    pytest.importorskip("wandb")
    from aitoolbox.torchtrain.callbacks.wandb import WandBTracking
    with pytest.raises(TypeError, match="include_fn must be a function"):
        WandBTracking(include_fn="*.py")


def test_mlflow_params_hold_no_secret(tmp_path, monkeypatch, no_network):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from aitoolbox.torchtrain.callbacks.mlflow import MLflowTracking
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps file stores behind this switch
    store = (tmp_path / "mlruns").as_uri()
    hyperparams = secret_hyperparams()
    tags = {"repo": f"https://x-access-token:{API_KEY}@github.com/org/repo.git", "deploy_token": DB_PASSWORD,
            "team": "vision"}
    make_train_loop().fit(num_epochs=1, callbacks=[MLflowTracking(store, hyperparams=hyperparams, tags=tags,
                                                                  project_name="secrets")])

    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("secrets").experiment_id])
    assert run.data.params == {"lr": "0.1", "api_key": "<redacted>", "max_tokens": "512", "tokenizer": "bpe-32k",
                               "database.host": "db.internal", "database.password": "<redacted>",
                               "results_db": "<redacted>"}
    assert (run.data.tags["repo"], run.data.tags["deploy_token"], run.data.tags["team"]) == \
        ("https://<redacted>@github.com/org/repo.git", "<redacted>", "vision")
    assert files_holding_secrets(tmp_path) == []
    assert hyperparams["database"]["password"] == DB_PASSWORD
