"""The ``aitoolbox`` logger: messages and reports go through ``logging`` and print cleanly beside tqdm bars."""
import logging

from tqdm.auto import tqdm


class TqdmLoggingHandler(logging.StreamHandler):
    """Writes records with ``tqdm.write`` so that an active progress bar is redrawn below the message."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            # One write of the message with its newline, as logging's own handler makes (tqdm.write makes two): the
            # processes of a distributed run share one stderr, and two ranks' messages written at once would
            # otherwise meet on one line. The bars are cleared first and redrawn below.
            with tqdm.external_write_mode(file=self.stream):
                self.stream.write(self.format(record) + self.terminator)
                self.flush()
        except Exception:  # logging must never take the training run down
            self.handleError(record)


def install_default_handler(logger: logging.Logger) -> None:
    """Show INFO messages of the library unless the application has configured logging itself.

    Reports (metrics per epoch, early stopping) are what the user asked for, so they should be visible
    in a plain script or notebook. An application that sets up the root logger keeps full control.
    """
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = TqdmLoggingHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
