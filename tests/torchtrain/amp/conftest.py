"""Fixtures shared by the amp tests."""
import logging

import pytest


@pytest.fixture(autouse=True)
def quiet_amp_logger():
    """amp logs every initialize and overflow at INFO; the tests trigger hundreds of them."""
    logger = logging.getLogger("aitoolbox.torchtrain.amp")
    level = logger.level
    logger.setLevel(logging.WARNING)
    yield
    logger.setLevel(level)
