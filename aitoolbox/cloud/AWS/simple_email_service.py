"""aitoolbox 1.x's ``cloud.AWS.simple_email_service``: e-mail notifications through AWS Simple Email Service.

The SES client comes from boto3's standard configuration chain (credentials, ``AWS_ENDPOINT_URL_SES`` /
``AWS_ENDPOINT_URL``); the region is the one given. Needs ``pip install aitoolbox[aws]``. The sender's address
must be verified in SES. As in aitoolbox 1.x, a failed send is reported (logged with SES's message) but not
raised: a notification must not stop a training run.
"""
import logging
import os
from email.mime.application import MIMEApplication
from email.mime.multipart import MIMEMultipart
from email.mime.text import MIMEText
from typing import Any, List, Optional

from aitoolbox.cloud.s3 import import_boto3

__all__ = ["SESSender"]

logger = logging.getLogger(__name__)


class SESSender:
    """Send HTML e-mails, with attachments, through AWS SES.

    Args:
        sender_name: the name shown as the sender.
        sender_email: the sender's address (verified in SES).
        recipient_email: where the e-mails go.
        aws_region: the SES region.
    """

    CHARSET = "UTF-8"

    def __init__(self, sender_name: str, sender_email: str, recipient_email: str, aws_region: str = "eu-west-1"):
        boto3, _ = import_boto3()
        self.sender_name = sender_name
        self.sender_email = sender_email
        self.sender = f"{sender_name} <{sender_email}>"
        self.recipient_email = recipient_email
        self.aws_region = aws_region
        self.client: Any = boto3.session.Session().client("ses", region_name=aws_region)

    def build_message(self, subject: str, body: str, attachment_file_paths: Optional[List[str]] = None) -> MIMEMultipart:
        """The MIME message: ``body`` as HTML, each file attached under its base name."""
        message = MIMEMultipart("mixed")
        message["Subject"] = subject
        message["From"] = self.sender
        message["To"] = self.recipient_email
        alternative = MIMEMultipart("alternative")
        html = f"<html>\n<head></head>\n<body>\n{body}\n</body>\n</html>\n"
        alternative.attach(MIMEText(html.encode(self.CHARSET), "html", self.CHARSET))
        message.attach(alternative)
        for path in attachment_file_paths or []:
            with open(os.path.expanduser(path), "rb") as handle:
                attachment = MIMEApplication(handle.read())
            attachment.add_header("Content-Disposition", "attachment", filename=os.path.basename(path))
            message.attach(attachment)
        return message

    def send_email(self, subject: str, body: str, attachment_file_paths: Optional[List[str]] = None) -> Optional[str]:
        """Send an e-mail.

        Args:
            subject: the subject.
            body: the HTML body (put inside ``<body>``).
            attachment_file_paths: local files to attach.

        Returns:
            SES's message id; None when SES refused or could not be reached (the reason is logged).

        Raises:
            FileNotFoundError: an attachment does not exist.
        """
        _, botocore = import_boto3()
        message = self.build_message(subject, body, attachment_file_paths)
        try:
            response = self.client.send_raw_email(Source=self.sender, Destinations=[self.recipient_email],
                                                  RawMessage={"Data": message.as_string()})
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as error:
            logger.error("AWS SES could not send the e-mail %r from %s to %s (region %s): %s", subject,
                         self.sender_email, self.recipient_email, self.aws_region, error)
            return None
        logger.info("E-mail %r sent to %s", subject, self.recipient_email)
        return response["MessageId"]
