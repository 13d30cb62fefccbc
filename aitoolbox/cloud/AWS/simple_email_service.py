"""aitoolbox 1.x's ``cloud.AWS.simple_email_service``: AWS Simple Email Service is not supported yet."""
from aitoolbox.cloud.unsupported import not_supported

SESSender = not_supported(
    "SESSender", "AWS Simple Email Service",
    "Python's smtplib", __name__)

__all__ = ["SESSender"]
