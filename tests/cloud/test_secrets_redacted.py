"""Secrets in hyperparameters never leave the machine through the bucket uploads nor the final e-mail (moto's S3
and SES, see conftest.py); the training script keeps the real values. The other destinations are tested in
tests/torchtrain/callbacks/test_secrets_redacted.py."""
import html
import json
import time
import traceback

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.callbacks.basic import EmailNotification
from aitoolbox.torchtrain.callbacks.csv_logger import CSVLogger
from aitoolbox.torchtrain.train_loop import TrainLoopCheckpoint, TrainLoopCheckpointEndSave
from tests.cloud.buckets import create_bucket, unique_bucket_name
from tests.cloud.test_email_notification import (
    RECIPIENT, SENDER, html_body, loop_arguments, unique_project, verify_sender)
from tests.cloud.test_ses import sent_messages
from tests.helpers import single_torch_thread

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")

API_KEY = "sk-live-4f9a2c7e1b"
DB_PASSWORD = "hunter2-db-pw-93"
# How long an e-mail may take to reach moto's SES after fit returned (it may be sent in the background).
EMAIL_WAIT_S = 60


def secret_hyperparams() -> dict:
    return {"lr": 0.01, "api_key": API_KEY, "database": {"host": "db.internal", "password": DB_PASSWORD}}


def wait_for_email(server_url: str, subject: str):
    deadline = time.monotonic() + EMAIL_WAIT_S
    while True:
        messages = sent_messages(server_url, subject)
        if messages or time.monotonic() > deadline:
            assert len(messages) == 1, f"{len(messages)} e-mails with the subject {subject!r}"
            return messages[0]
        time.sleep(0.1)


def test_the_final_email_shows_secrets_redacted(s3_env, tmp_path):
    verify_sender()
    project = unique_project()
    hyperparams = secret_hyperparams()
    tl = TrainLoopCheckpoint(*loop_arguments(), project, "exp", str(tmp_path), hyperparams)
    tl.fit(num_epochs=1, callbacks=[EmailNotification("Training bot", SENDER, RECIPIENT)])

    message = wait_for_email(s3_env.url, f"End of training: {project}: exp")
    body = html_body(message)
    assert "<li><p>lr: 0.01</p></li>" in body and "<li><p>api_key: &lt;redacted&gt;</p></li>" in body
    assert html.escape("database: {'host': 'db.internal', 'password': '<redacted>'}") in body
    for part in message.walk():  # the decoded text of every part, and the message as sent
        payload = part.get_payload(decode=True) or b""
        for secret in (API_KEY, DB_PASSWORD):
            assert secret.encode() not in payload and secret not in message.as_string()
    assert hyperparams["api_key"] == API_KEY and tl.hyperparams["database"]["password"] == DB_PASSWORD


def test_uploaded_run_files_hold_no_secret(s3_env, tmp_path):
    import boto3
    bucket = unique_bucket_name("s3")
    create_bucket("s3", bucket)
    model, train, validation, _, optimizer, criterion = loop_arguments()
    test = DataLoader(validation.dataset, batch_size=5)
    hyperparams = secret_hyperparams()
    tl = TrainLoopCheckpointEndSave(model, train, validation, test, optimizer, criterion, "proj", "exp",
                                    str(tmp_path), hyperparams, cloud_save_mode="s3", bucket_name=bucket,
                                    show_progress=False)
    tl.fit(num_epochs=2, callbacks=[CSVLogger()])

    client = boto3.session.Session().client("s3")
    keys = [item["Key"] for item in client.list_objects_v2(Bucket=bucket)["Contents"]]
    uploaded = {key: client.get_object(Bucket=bucket, Key=key)["Body"].read() for key in keys}
    names = {key.rsplit("/", 1)[-1] for key in keys}
    assert {"hyperparams.json", "hyperparams_list.txt", "run_info.json"} <= names
    assert sum(name.endswith(".pth") for name in names) >= 3  # two epoch checkpoints and the final model
    assert [(key, secret) for key, data in uploaded.items() for secret in (API_KEY, DB_PASSWORD)
            if secret.encode() in data] == []
    [hyperparams_json] = [data for key, data in uploaded.items() if key.endswith("/hyperparams.json")]
    assert json.loads(hyperparams_json) == {"lr": 0.01, "api_key": "<redacted>",
                                            "database": {"host": "db.internal", "password": "<redacted>"}}
    assert hyperparams["api_key"] == API_KEY


def test_a_storage_error_never_shows_credentials_the_clients_message_quotes(s3_env, tmp_path):
    from aitoolbox.cloud.storage import CloudStorageError
    from tests.cloud.buckets import FAST_RETRY, make_storage
    from tests.cloud.servers import free_port
    password = "pw-endpoint-5521"
    storage = make_storage("s3", "bucket", retry=FAST_RETRY,
                           endpoint_url=f"http://user:{password}@127.0.0.1:{free_port()}")
    with pytest.raises(CloudStorageError) as raised:
        storage.download_bytes("key")
    shown = "".join(traceback.format_exception(raised.type, raised.value, raised.tb))  # the chain included
    assert "127.0.0.1" in shown and "<redacted>" in shown and password not in shown
