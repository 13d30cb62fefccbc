"""aitoolbox 1.x's ``cloud.AWS.simple_email_service``: e-mail notifications through AWS Simple Email Service.

The SES client comes from boto3's standard configuration chain (credentials, ``AWS_ENDPOINT_URL_SES`` /
``AWS_ENDPOINT_URL``, the retry settings ``AWS_RETRY_MODE`` / ``AWS_MAX_ATTEMPTS``); the region is the one given.
Needs ``pip install aitoolbox[aws]``. Its retries, like those of :class:`~aitoolbox.cloud.s3.S3Storage`, wait
times drawn from a generator of their own, not from Python's global ``random``, which training draws from (e-mail
notifications are sent from a background thread while training runs): botocore's ``'legacy'`` retry mode, its
default, is replaced by ``'standard'``, with the configured number of attempts (5 when none is configured; see
:mod:`aitoolbox.cloud.s3_retry`). The sender's address
must be verified in SES. As in aitoolbox 1.x, a failed :meth:`SESSender.send_email` is reported (logged with
SES's message) but not raised: a notification must not stop a training run.

The messages are built with :class:`email.message.EmailMessage` under the SMTP policy and the addresses with
:func:`email.utils.formataddr`, so a display name with a comma (``"Doe, Jane"``) stays one address and a
non-ASCII one is encoded without losing the address.
"""
import email.policy
import logging
import os
import re
from email.message import EmailMessage
from email.utils import formataddr, getaddresses
from typing import Any, List, Optional, Tuple

from aitoolbox.cloud.errors import RetryPolicy
from aitoolbox.cloud.s3 import import_boto3
from aitoolbox.cloud.s3_retry import configured_retries, use_private_jitter

__all__ = ["SESSender", "check_display_name", "check_email_address", "is_transient_ses_error", "single_line"]

logger = logging.getLogger(__name__)

#: SES error codes that say "try again later" rather than "no".
TRANSIENT_SES_CODES = frozenset({"Throttling", "ThrottlingException", "ServiceUnavailable", "InternalFailure",
                                 "RequestTimeout", "RequestTimeoutException"})

_CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f]+")


def single_line(text: str) -> str:
    """``text`` with line breaks and other control characters replaced by a space: a header value made of data
    (a project or experiment name in a subject) can neither fail the e-mail nor add a header."""
    return _CONTROL_CHARACTERS.sub(" ", str(text)).strip()


def check_display_name(name: Any, argument: str = "sender_name") -> str:
    """``name`` if it can be a display name: a non-empty string on one line; else a ValueError that says why."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{argument} must be a non-empty string, got {name!r}")
    if _CONTROL_CHARACTERS.search(name):
        raise ValueError(f"{argument} must be one line of text without control characters (a line break would end "
                         f"the e-mail header), got {name!r}")
    return name


def check_email_address(address: Any, argument: str, allow_name: bool = False) -> Tuple[str, str]:
    """``(display name, address)`` of ``address``, one e-mail address (``'me@example.com'``, or with
    ``allow_name`` also ``'Me <me@example.com>'``); else a ValueError that says what is wrong."""
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"{argument} must be a non-empty string, got {address!r}")
    addresses = getaddresses([address])
    name, parsed = addresses[0] if len(addresses) == 1 else ("", "")
    if _CONTROL_CHARACTERS.search(address) or re.search(r"\s", parsed) or parsed.count("@") != 1 \
            or parsed.startswith("@") or parsed.endswith("@") or (name and not allow_name) \
            or (not name and parsed != address.strip().strip("<>")):
        example = "'me@example.com' or 'Me <me@example.com>'" if allow_name else \
            "'me@example.com' (the sender's name goes into sender_name)"
        raise ValueError(f"{argument} must be one e-mail address such as {example}, got {address!r}")
    return name, parsed


def is_transient_ses_error(error: BaseException) -> bool:
    """True for a failure worth trying again (no connection, a timeout, throttling, a server error); False for a
    refusal (an unverified sender, a bad address) or missing credentials."""
    _, botocore = import_boto3()
    exceptions = botocore.exceptions
    if isinstance(error, exceptions.ClientError):
        response = getattr(error, "response", {}) or {}
        code = response.get("Error", {}).get("Code", "")
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0
        return code in TRANSIENT_SES_CODES or status >= 500
    if isinstance(error, (exceptions.ConnectionError, exceptions.HTTPClientError)):
        return True
    if isinstance(error, exceptions.BotoCoreError):
        return False  # no credentials, no region, a bad parameter: the same on every try
    return isinstance(error, OSError)


class SESSender:
    """Send HTML e-mails, with attachments, through AWS SES.

    Args:
        sender_name: the name shown as the sender (any text on one line, commas and non-ASCII letters included).
        sender_email: the sender's address (verified in SES).
        recipient_email: where the e-mails go.
        aws_region: the SES region.

    Raises:
        ValueError: a name with a line break, or an address that is not one plain address.
        ImportError: boto3 is not installed.
    """

    CHARSET = "UTF-8"

    #: Tells a failure of :meth:`send_message` worth trying again from a refusal.
    is_transient_error = staticmethod(is_transient_ses_error)

    def __init__(self, sender_name: str, sender_email: str, recipient_email: str, aws_region: str = "eu-west-1"):
        check_display_name(sender_name)
        _, sender_email = check_email_address(sender_email, "sender_email")
        recipient_name, recipient_address = check_email_address(recipient_email, "recipient_email", allow_name=True)
        boto3, botocore = import_boto3()
        self.sender_name = sender_name
        self.sender_email = sender_email
        # Quoted when needed ("Doe, Jane" <jane@...>), RFC 2047-encoded when not ASCII: one address either way.
        self.sender = formataddr((sender_name, sender_email), charset=self.CHARSET)
        self.recipient_email = recipient_email
        self.recipient_address = recipient_address  # without the display name, for SES's Destinations
        self.recipient = formataddr((recipient_name, recipient_address), charset=self.CHARSET)
        self.aws_region = aws_region
        # A session of its own (boto3's default one is not thread-safe to create clients from), whose configuration
        # gives the retry settings; the retries then leave Python's global random alone.
        session = botocore.session.get_session()
        retries = configured_retries(session, default_attempts=RetryPolicy().attempts)
        self.client: Any = boto3.session.Session(botocore_session=session).client(
            "ses", region_name=aws_region, config=botocore.config.Config(retries=retries))
        use_private_jitter(self.client, retries["total_max_attempts"])

    @property
    def endpoint(self) -> str:
        """The SES endpoint the client talks to, for messages."""
        return str(self.client.meta.endpoint_url)

    def build_message(self, subject: str, body: str, attachment_file_paths: Optional[List[str]] = None) -> EmailMessage:
        """The MIME message: ``body`` as HTML, each file attached under its base name.

        Line breaks in ``subject`` become spaces. Raises OSError when an attachment cannot be read.
        """
        message = EmailMessage(policy=email.policy.SMTP)
        message["Subject"] = single_line(subject)
        message["From"] = self.sender
        message["To"] = self.recipient
        html = f"<html>\n<head></head>\n<body>\n{body}\n</body>\n</html>\n"
        message.set_content(html, subtype="html", charset=self.CHARSET.lower(), cte="base64")
        for path in attachment_file_paths or []:
            with open(os.path.expanduser(path), "rb") as handle:
                data = handle.read()
            message.add_attachment(data, maintype="application", subtype="octet-stream",
                                   filename=os.path.basename(path))
        return message

    def send_message(self, message: EmailMessage) -> str:
        """Send a built message; returns SES's message id. Raises botocore's error when SES refuses it or cannot
        be reached (see :func:`is_transient_ses_error`)."""
        response = self.client.send_raw_email(Source=self.sender, Destinations=[self.recipient_address],
                                              RawMessage={"Data": message.as_bytes()})
        logger.info("E-mail %r sent to %s", message["Subject"], self.recipient_email)
        return response["MessageId"]

    def send_email(self, subject: str, body: str, attachment_file_paths: Optional[List[str]] = None) -> Optional[str]:
        """Send an e-mail now, on the calling thread.

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
            return self.send_message(message)
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as error:
            logger.error("AWS SES could not send the e-mail %r from %s to %s (region %s): %s", subject,
                         self.sender_email, self.recipient_email, self.aws_region, error)
            return None
