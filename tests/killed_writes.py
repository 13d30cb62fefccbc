"""A write that blocks midway until its process is killed: what a save cut short by SIGKILL (the OOM killer, a
node failure) leaves on disk, made deterministic."""
import time


class BlockWhenPickled:
    """Pickled inside a ``torch.save`` (or DCP's write of a process's file), it marks ``started`` on disk and then
    blocks for good, with the temporary file or folder created and partly written, until the process is killed."""

    def __init__(self, started: str):
        self.started = started

    def __reduce__(self):
        open(self.started, "w").close()
        time.sleep(3600)
        raise AssertionError("not killed")
