"""EmailNotification and SESSender when SES is slow or unreachable, and with names an e-mail header cannot hold as
they are: training neither stalls nor stops, the e-mails are kept until SES takes them, an outage is reported
once, every address stays one address.

SES is moto's (see conftest.py); a FaultyProxy in front of it holds the traffic for as long as a test needs, a
free port stands for a closed endpoint. No assertion is about time: a ``fit`` that should not wait runs in a
thread joined with a generous hang limit, far below what botocore's own timeouts (60 s per attempt) would take.
"""

import pytest

from aitoolbox.torchtrain.callbacks.basic import EmailNotification
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.hang_limits import HANG_LIMIT_S, fit_within_hang_limit, log_messages, wait_until
from tests.cloud.servers import FaultyProxy, free_port
from tests.cloud.test_email_notification import (
    RECIPIENT, SENDER, all_subjects, html_body, loop_arguments, one_email, unique_project, verify_sender)
from tests.cloud.test_ses import sent_messages



def subjects(project: str) -> list:
    return [f"End of epoch 1 report: {project}: exp", f"End of epoch 2 report: {project}: exp",
            f"End of training: {project}: exp"]


def test_a_held_ses_holds_up_neither_training_nor_its_end_and_the_emails_go_out_later(
        s3_env, s3_server, monkeypatch, aitoolbox_records):
    verify_sender()
    proxy = FaultyProxy(s3_server.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    proxy.hold()  # connections are accepted, nothing is answered
    try:
        project = unique_project()
        tl = TrainLoop(*loop_arguments())
        callback = EmailNotification("Bot", SENDER, RECIPIENT, project, "exp", flush_timeout_s=0.5)
        fit_within_hang_limit(tl, waits_on="SES", num_epochs=2, callbacks=[callback])
        assert len(tl.train_history["loss"]) == 2  # trained to the end

        (report,) = log_messages(aitoolbox_records, "not sent yet")
        assert proxy.url in report and all(subject in report for subject in subjects(project)), report
        proxy.release()
        assert callback.wait_for_queued_emails(HANG_LIMIT_S), callback.unsent()
    finally:
        proxy.close()
    assert sorted(s for s in all_subjects(s3_env.url) if project in s) == sorted(subjects(project))
    assert log_messages(aitoolbox_records, "could not send") == []  # held, not failed


def test_a_closed_endpoint_is_reported_once_and_training_completes(s3_env, monkeypatch, aitoolbox_records):
    # Each request fails at once here; botocore's own retries would only delay the first report.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    url = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", url)
    project = unique_project()
    tl = TrainLoop(*loop_arguments())
    callback = EmailNotification("Bot", SENDER, RECIPIENT, project, "exp", flush_timeout_s=0.2)
    fit_within_hang_limit(tl, waits_on="SES", num_epochs=2, callbacks=[callback])
    assert len(tl.train_history["loss"]) == 2

    wait_until(lambda: callback.outbox.failures >= 3, "tried three times")
    (report,) = log_messages(aitoolbox_records, "could not send")  # one report for the outage, not one per try
    assert url in report and f"End of epoch 1 report: {project}: exp" in report
    assert [record for record in aitoolbox_records.records if record.levelname == "ERROR"] == []
    assert len(callback.unsent()) == 3  # kept while it keeps trying
    callback.discard_unsent()
    assert callback.unsent() == []


@pytest.mark.parametrize("name", ["Doe, Jane", "Jürgen Müller-Łukasiewicz", 'The "best" bot'])
def test_a_display_name_stays_one_address(s3_env, name):
    from aitoolbox.cloud.AWS.simple_email_service import SESSender
    verify_sender()
    sender = SESSender(name, SENDER, '"Me, Myself" <me@example.com>', aws_region="eu-west-1")
    subject = f"names {unique_project()}"
    assert sender.send_email(subject, "<p>hello</p>")
    [message] = sent_messages(s3_env.url, subject)
    (sent_from,) = message["From"].addresses
    assert (sent_from.display_name, sent_from.addr_spec) == (name, SENDER)
    (sent_to,) = message["To"].addresses
    assert (sent_to.display_name, sent_to.addr_spec) == ("Me, Myself", RECIPIENT)


def test_a_line_break_in_a_name_is_refused_when_the_callback_is_made():
    from aitoolbox.cloud.AWS.simple_email_service import SESSender
    with pytest.raises(ValueError, match="sender_name must be one line"):
        EmailNotification("Bot\r\nBcc: someone@example.com", SENDER, RECIPIENT)
    with pytest.raises(ValueError, match="recipient_email must be one e-mail address"):
        EmailNotification("Bot", SENDER, "me@example.com, someone@example.com")
    with pytest.raises(ValueError, match="sender_email must be one e-mail address"):
        EmailNotification("Bot", "Bot <bot@example.com>", RECIPIENT)
    with pytest.raises(ValueError, match="sender_name must be one line"):
        SESSender("Bot\nX", SENDER, RECIPIENT)


def test_a_line_break_in_a_project_name_neither_raises_nor_adds_a_header(s3_env, aitoolbox_records):
    verify_sender()
    project = unique_project()
    tl = TrainLoop(*loop_arguments())
    callback = EmailNotification("Bot", SENDER, RECIPIENT, f"{project}\r\nBcc: someone@example.com", "exp")
    tl.fit(num_epochs=1, callbacks=[callback])  # the names come from data: the hooks must not raise
    message = one_email(s3_env.url, f"End of epoch 1 report: {project} Bcc: someone@example.com: exp")
    assert message["Bcc"] is None and message["To"] == RECIPIENT
    assert "<h2>End of epoch 1</h2>" in html_body(message)
    one_email(s3_env.url, f"End of training: {project} Bcc: someone@example.com: exp")
    assert [record for record in aitoolbox_records.records if record.levelname == "ERROR"] == []
