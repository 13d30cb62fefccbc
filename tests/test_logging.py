"""The ``aitoolbox`` logger's default handler writes beside tqdm bars, one whole line per record."""
import io
import logging

from tqdm.auto import tqdm

from aitoolbox._logging import TqdmLoggingHandler


class WritesKept(io.StringIO):
    """A stream that keeps each write it is given: what other processes sharing the file could come between."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, text):
        self.writes.append(text)
        return super().write(text)


def test_each_record_is_one_write_holding_its_whole_line():
    """The processes of a distributed run share one stderr: a message and its newline written apart let two ranks'
    messages meet on one line (``Ctrl-C: ...Ctrl-C: ...``)."""
    stream = WritesKept()
    logger = logging.getLogger("tests.logging.one_write")
    logger.propagate = False
    handler = TqdmLoggingHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    try:
        logger.warning("first")
        logger.warning("second")
    finally:
        logger.removeHandler(handler)
    assert stream.writes == ["first\n", "second\n"]


def test_an_active_bar_is_cleared_for_the_message_and_drawn_again():
    stream = WritesKept()
    logger = logging.getLogger("tests.logging.bar")
    logger.propagate = False
    handler = TqdmLoggingHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    try:
        with tqdm(total=3, file=stream, desc="bar", mininterval=0) as bar:
            bar.update(1)
            logger.warning("between")
            bar.update(1)
    finally:
        logger.removeHandler(handler)
    assert "between\n" in stream.writes
    assert "bar" in "".join(stream.writes[stream.writes.index("between\n") + 1:])  # redrawn after the message
