"""EmailNotification: real TrainLoop runs e-mailing their reports through moto's SES (see conftest.py).

The e-mails are read back from moto's introspection endpoint. Each test names its own project, so the subjects
of one test are not those of another on the shared server.
"""
import base64
import email
import email.policy
import html
import json
import os
import pickle
import sys
import urllib.request
import uuid

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback, MissingExperimentDetailsError
from aitoolbox.torchtrain.callbacks.basic import EmailNotification
from aitoolbox.torchtrain.callbacks.history_output import (
    FILE_WRITER_PATHS_MESSAGE_KEY, ModelTrainHistoryFileWriter, ModelTrainHistoryPlot)
from aitoolbox.torchtrain.train_loop import TrainLoop, TrainLoopCheckpoint
from tests.cloud.test_ses import sent_messages
from tests.helpers import MLP, classification_data, single_torch_thread

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")

REGION = "eu-west-1"
SENDER = "bot@example.com"
RECIPIENT = "me@example.com"


def loop_arguments():
    torch.manual_seed(0)
    model = MLP()
    train = DataLoader(classification_data(20), batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(1))
    validation = DataLoader(classification_data(10, seed=3), batch_size=5)
    return model, train, validation, None, torch.optim.Adam(model.parameters(), lr=1e-2), nn.CrossEntropyLoss()


def verify_sender(address: str = SENDER) -> None:
    """Verify ``address`` in moto's SES (in the callback's region), as a real account must."""
    import boto3
    boto3.session.Session().client("ses", region_name=REGION).verify_email_identity(EmailAddress=address)


def unique_project() -> str:
    return f"proj-{uuid.uuid4().hex[:12]}"


def html_body(message) -> str:
    """The HTML part, with the e-mail's CRLF line ends read back as ``\\n``."""
    [part] = [part for part in message.walk() if part.get_content_type() == "text/html"]
    return base64.b64decode(part.get_payload()).decode().replace("\r\n", "\n")


def attachments(message) -> dict:
    """``{file name: content}`` of the e-mail's attachments."""
    return {part.get_filename(): part.get_payload(decode=True) for part in message.walk()
            if part.get_content_disposition() == "attachment"}


def one_email(server_url: str, subject: str):
    messages = sent_messages(server_url, subject)
    assert len(messages) == 1, f"{len(messages)} e-mails with the subject {subject!r}"
    return messages[0]


def all_subjects(server_url: str) -> list:
    """The subjects of every e-mail moto's SES accepted so far."""
    with urllib.request.urlopen(f"{server_url}/moto-api/data.json", timeout=10) as response:
        data = json.loads(response.read())
    return [str(email.message_from_string(item["raw_data"], policy=email.policy.default)["Subject"]).strip()
            for item in data["ses"]["RawMessage"]]


class AnnounceMissingFile(AbstractCallback):
    """Announces, under ModelTrainHistoryFileWriter's key, a file that does not exist."""

    def __init__(self, missing: str):
        super().__init__("announce a missing file", execution_order=97)
        self.missing = missing

    def on_epoch_end(self):
        self.message_service.write_message(FILE_WRITER_PATHS_MESSAGE_KEY, [self.missing])


def test_an_email_after_every_epoch_and_at_the_end_of_training(s3_env, tmp_path):
    verify_sender()
    project = unique_project()
    hyperparams = {"lr": 0.01, "note": "<b>bold & brave</b>"}
    tl = TrainLoopCheckpoint(*loop_arguments(), project, "exp", str(tmp_path), hyperparams)
    callback = EmailNotification("Training bot", SENDER, RECIPIENT)
    tl.fit(num_epochs=2, callbacks=[callback])
    assert (callback.project_name, callback.experiment_name) == (project, "exp")  # taken from the loop

    history = tl.train_history
    for epoch in range(2):
        # Epochs counted from 1, as the epoch's summary line counts them.
        message = one_email(s3_env.url, f"End of epoch {epoch + 1} report: {project}: exp")
        assert message["From"] == f"Training bot <{SENDER}>" and message["To"] == RECIPIENT
        body = html_body(message)
        assert f"<h2>End of epoch {epoch + 1}</h2>" in body
        for name in ("loss", "accumulated_loss", "val_loss"):
            assert f"<li><p>{name}: {history[name][epoch]}</p></li>" in body
        assert "hyper parameters" not in body and attachments(message) == {}

    final = html_body(one_email(s3_env.url, f"End of training: {project}: exp"))
    assert "<h2>End of training at epoch 2</h2>" in final
    assert f"<li><p>val_loss: {history['val_loss'][-1]}</p></li>" in final
    assert "<li><p>lr: 0.01</p></li>" in final
    assert f"<li><p>note: {html.escape('<b>bold & brave</b>')}</p></li>" in final  # escaped, not markup
    # One e-mail per epoch and one at the end, nothing else for this project.
    assert len([s for s in all_subjects(s3_env.url) if project in s]) == 3


def test_a_plain_train_loop_with_names_given_reports_no_hyperparameters(s3_env):
    verify_sender()
    project = unique_project()
    tl = TrainLoop(*loop_arguments())
    tl.fit(num_epochs=1, callbacks=[EmailNotification("Bot", SENDER, RECIPIENT, project, "plain")])
    one_email(s3_env.url, f"End of epoch 1 report: {project}: plain")
    final = html_body(one_email(s3_env.url, f"End of training: {project}: plain"))
    assert "<h3>Used hyper parameters:</h3>\nNot given" in final
    assert f"<li><p>loss: {tl.train_history['loss'][-1]}</p></li>" in final


def test_the_history_callbacks_files_are_attached_and_a_missing_one_is_skipped(s3_env, tmp_path,
                                                                              aitoolbox_records):
    pytest.importorskip("matplotlib")
    verify_sender()
    project = unique_project()
    tl = TrainLoopCheckpoint(*loop_arguments(), project, "exp", str(tmp_path))
    writer = ModelTrainHistoryFileWriter()
    missing = str(tmp_path / "deleted_meanwhile.txt")
    tl.fit(num_epochs=2, callbacks=[ModelTrainHistoryPlot(), writer, AnnounceMissingFile(missing),
                                    EmailNotification("Bot", SENDER, RECIPIENT)])

    for epoch in range(2):
        message = one_email(s3_env.url, f"End of epoch {epoch + 1} report: {project}: exp")
        files = attachments(message)
        # Each epoch's e-mail has that epoch's files once (the messages last until the end of the epoch).
        names = [part.get_filename() for part in message.walk() if part.get_content_disposition() == "attachment"]
        assert sorted(names) == ["accumulated_loss.png", "loss.png", "results.txt", "val_loss.png"]
        with open(writer.output_path(), "rb") as handle:
            if epoch == 1:
                assert files["results.txt"] == handle.read()
    warnings = [record.getMessage() for record in aitoolbox_records.records if record.levelname == "WARNING"]
    assert any(missing in text and "no such file" in text for text in warnings)


def test_an_unverified_sender_does_not_stop_training(s3_env, aitoolbox_records):
    project = unique_project()
    tl = TrainLoop(*loop_arguments())
    tl.fit(num_epochs=2, callbacks=[EmailNotification("Bot", "nobody-verified@example.com", RECIPIENT, project,
                                                      "exp")])
    assert tl.epoch == 1 and len(tl.train_history["loss"]) == 2  # trained to the end
    assert not [s for s in all_subjects(s3_env.url) if project in s]
    errors = [record.getMessage() for record in aitoolbox_records.records if record.levelname == "ERROR"]
    assert len([text for text in errors if "nobody-verified@example.com" in text]) == 3  # 2 epochs + the end


def test_missing_project_names_are_a_clear_error_at_registration():
    tl = TrainLoop(*loop_arguments())
    with pytest.raises(MissingExperimentDetailsError, match="experiment_name is None and the TrainLoop has none"):
        tl.fit(num_epochs=1, callbacks=[EmailNotification("Bot", SENDER, RECIPIENT, project_name="p")])
    assert tl.train_history["loss"] == []  # nothing trained
    with pytest.raises(AttributeError, match="pass project_name and experiment_name to EmailNotification"):
        tl.fit(num_epochs=1, callbacks=[EmailNotification("Bot", SENDER, RECIPIENT)])


def test_arguments_are_checked_when_the_callback_is_made():
    with pytest.raises(ValueError, match="sender_email must be a non-empty string, got ''"):
        EmailNotification("Bot", "", RECIPIENT)
    with pytest.raises(ValueError, match="project_name must be a non-empty string or None, got 3"):
        EmailNotification("Bot", SENDER, RECIPIENT, project_name=3)


def test_without_boto3_registration_names_the_aws_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)  # as if not installed
    callback = EmailNotification("Bot", SENDER, RECIPIENT, "p", "e")  # made without boto3
    tl = TrainLoop(*loop_arguments())
    with pytest.raises(ImportError, match=r"pip install aitoolbox\[aws\]"):
        tl.callbacks_handler.register_callbacks([callback])


def test_a_pickled_callback_makes_its_own_sender(s3_env):
    # Distributed training sends the callbacks to the training processes: the boto3 client stays behind.
    verify_sender()
    project = unique_project()
    tl = TrainLoop(*loop_arguments())
    callback = EmailNotification("Bot", SENDER, RECIPIENT, project, "exp")
    tl.callbacks_handler.register_callbacks([callback])
    assert callback.ses_sender is not None
    clone = pickle.loads(pickle.dumps(callback))
    assert clone.ses_sender is None and callback.ses_sender is not None
    clone.train_loop_obj = tl
    assert clone.send_report(f"sent from a copy {project}", "<p>hello</p>")
    assert "<p>hello</p>" in html_body(one_email(s3_env.url, f"sent from a copy {project}"))


def test_values_are_html_escaped_and_tensors_shown_as_numbers():
    tl = TrainLoop(*loop_arguments())
    callback = EmailNotification("Bot", SENDER, RECIPIENT, "p", "e")
    callback.train_loop_obj = tl
    tl.train_history["acc<1>"] = torch.tensor(0.5)
    tl.train_history["note"] = "a & b"
    metrics = callback.get_metric_list_html()
    assert "<li><p>acc&lt;1&gt;: 0.5</p></li>" in metrics and "<li><p>note: a &amp; b</p></li>" in metrics
    assert "loss" not in metrics  # metrics without values are left out
    assert callback.get_hyperparams_html() == "Not given"


class RemovesAttachmentsAfterTheCheck(EmailNotification):
    """Deletes the attachments between their check and the send (another process cleaning up, say)."""

    def get_attachment_paths(self):
        paths = super().get_attachment_paths()
        for path in paths:
            os.remove(path)
        return paths


def test_an_attachment_gone_before_the_send_does_not_stop_training(s3_env, tmp_path, aitoolbox_records):
    verify_sender()
    project = unique_project()
    tl = TrainLoop(*loop_arguments())
    announced = tmp_path / "plot.png"
    announced.write_bytes(b"png")
    tl.message_service.write_message("ModelTrainHistoryPlot_results_file_local_paths", [str(announced)])
    tl.fit(num_epochs=2, callbacks=[RemovesAttachmentsAfterTheCheck("Bot", SENDER, RECIPIENT, project, "exp")])
    assert len(tl.train_history["loss"]) == 2  # trained to the end
    # The first e-mail failed (logged); later ones go out without the file, which is no longer there.
    assert sorted(s for s in all_subjects(s3_env.url) if project in s) == [
        f"End of epoch 2 report: {project}: exp", f"End of training: {project}: exp"]
    errors = [record.getMessage() for record in aitoolbox_records.records if record.levelname == "ERROR"]
    assert len([text for text in errors if "could not attach" in text and str(announced) in text]) == 1


@pytest.mark.filterwarnings("ignore:CUDA is not available")
@pytest.mark.parametrize("given_to", ["fit_distributed", "the loop before"])
def test_under_distributed_training_only_rank_0_sends(s3_env, given_to):
    from tests.torchtrain.distributed.support import make_model, regression_data
    verify_sender()
    project = unique_project()
    model = make_model()
    train, validation = DataLoader(regression_data(16), batch_size=4), DataLoader(regression_data(8, seed=1))
    tl = TrainLoop(model, train, validation, None, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(),
                   gpu_mode="ddp", show_progress=False)
    callback = EmailNotification("Bot", SENDER, RECIPIENT, project, "ddp")
    if given_to == "fit_distributed":
        tl.fit_distributed(num_epochs=2, num_cpu_processes=2, start_method="fork", callbacks=[callback])
    else:  # registered in this process, then sent to both training processes
        tl.callbacks_handler.register_callbacks([callback])
        tl.fit_distributed(num_epochs=2, num_cpu_processes=2, start_method="fork")
    assert sorted(s for s in all_subjects(s3_env.url) if project in s) == [
        f"End of epoch 1 report: {project}: ddp", f"End of epoch 2 report: {project}: ddp",
        f"End of training: {project}: ddp"]
