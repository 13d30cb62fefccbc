"""aitoolbox 1.8's SESSender against moto's SES (the same standalone server as the S3 tests)."""
import base64
import email
import email.policy
import json
import logging
import urllib.request
import uuid

import pytest


def sent_messages(server_url: str, subject: str) -> list:
    """The e-mails moto's SES accepted with ``subject`` (moto's own introspection endpoint), parsed as a mail
    client would (folded headers unfolded, encoded words decoded)."""
    with urllib.request.urlopen(f"{server_url}/moto-api/data.json", timeout=10) as response:
        data = json.loads(response.read())
    raw = [email.message_from_string(item["raw_data"], policy=email.policy.default)
           for item in data["ses"]["RawMessage"]]
    # str.strip: a subject folded onto its own line ("Subject:\r\n End of ...") reads back with a leading space.
    return [message for message in raw if str(message["Subject"]).strip() == subject]


def test_an_email_with_an_attachment_goes_out_through_ses(s3_env, tmp_path):
    from aitoolbox.cloud.AWS.simple_email_service import SESSender
    sender = SESSender("Training bot", "bot@example.com", "me@example.com", aws_region="eu-west-1")
    sender.client.verify_email_identity(EmailAddress="bot@example.com")
    attachment = tmp_path / "loss.png"
    attachment.write_bytes(b"\x89PNG plot")
    subject = f"Epoch 3 done {uuid.uuid4().hex}"

    message_id = sender.send_email(subject, "<p>loss 0.12</p>", [str(attachment)])
    assert message_id
    [message] = sent_messages(s3_env.url, subject)
    assert message["To"] == "me@example.com" and message["From"] == "Training bot <bot@example.com>"
    parts = {part.get_content_type(): part for part in message.walk()}
    assert "loss 0.12" in base64.b64decode(parts["text/html"].get_payload()).decode()
    assert parts["application/octet-stream"].get_filename() == "loss.png"
    assert parts["application/octet-stream"].get_payload(decode=True) == b"\x89PNG plot"


def test_a_refused_email_is_logged_not_raised(s3_env, monkeypatch, caplog):
    from aitoolbox.cloud.AWS.simple_email_service import SESSender
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    sender = SESSender("Bot", "unverified@example.com", "me@example.com")
    subject = f"never sent {uuid.uuid4().hex}"
    assert sender.send_email(subject, "body") is None
    assert any("unverified@example.com" in record.getMessage() and record.levelname == "ERROR"
               for record in caplog.records)
    assert sent_messages(s3_env.url, subject) == []
    with pytest.raises(FileNotFoundError):
        sender.send_email("with a missing attachment", "body", ["/no/such/file.png"])
