"""Transfers bounded to a size: downloads that cannot write more than an object may hold, uploads that read no
more than the size recorded for a file.

A client downloads into the file it is given as fast as the bucket serves: an object made larger than its folder's
marker lists (by whoever can write to the bucket) would fill the disk, or memory for an object read into memory.
:class:`BoundedWriter` stands between the client and the file and refuses the first write that would end past the
bound; :func:`went_past_the_bound` recognises that refusal however the client wrapped it. :class:`ReadWindow` is
the reading side: what a client uploads from it ends at the size given, however large the file has grown.
"""
from typing import IO, Optional

__all__ = ["BoundedWriter", "PastTheBound", "ReadWindow", "went_past_the_bound"]


class PastTheBound(Exception):
    """Raised by :class:`BoundedWriter` when a client writes past the bound."""


class BoundedWriter:
    """A seekable binary file that refuses writes ending past ``bound`` bytes: what a client downloads into it is
    never written beyond the size the object must have, whatever the bucket serves. The clients write in order
    (GCS) or at offsets (S3's ranged parts), so the check is on where each write ends."""

    def __init__(self, handle: IO[bytes], bound: int):
        self._handle = handle
        self._bound = bound

    def write(self, data: bytes) -> int:
        if self._handle.tell() + len(data) > self._bound:
            raise PastTheBound(f"a write past {self._bound} bytes")
        return self._handle.write(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._handle.seek(offset, whence)

    def tell(self) -> int:
        return self._handle.tell()

    def flush(self) -> None:
        self._handle.flush()

    def truncate(self, size: Optional[int] = None) -> int:
        return self._handle.truncate(size)

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False


class ReadWindow:
    """The first ``size`` bytes of the seekable binary ``handle``, as a file that close() leaves open.

    A file that grows meanwhile (a TensorBoard event file being written) is uploaded as it was when opened,
    matching the size its folder's marker records: the clients read until the end of what they are given (GCS's
    resumable upload of an unknown size) or take the size from seeking to the end (boto3's transfer manager).
    A file that shrinks meanwhile fails the upload (:meth:`read` raises ValueError) instead of storing a shorter
    object. boto3's transfer manager also closes the file it was given, which belongs to the caller (a folder's
    files are closed together, after the marker).
    """

    closed = False

    def __init__(self, handle: IO[bytes], size: int):
        self._handle = handle
        self._size = size
        self._position = 0

    def read(self, size: Optional[int] = -1) -> bytes:
        remaining = max(0, self._size - self._position)
        count = remaining if size is None or size < 0 else min(size, remaining)
        self._handle.seek(self._position)
        data = self._handle.read(count)
        while len(data) < count:  # a raw handle may return less than asked before its end
            more = self._handle.read(count - len(data))
            if not more:
                # Shrunk since its size was taken (rewritten in place): an upload of what is left would be an
                # object shorter than the size its folder's marker records.
                raise ValueError(f"the file to upload ended at byte {self._position + len(data)} of the "
                                 f"{self._size} recorded when it was opened: it was changed during the upload")
            data += more
        self._position += len(data)
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._position, 2: self._size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def tell(self) -> int:
        return self._position

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        pass


def went_past_the_bound(error: BaseException) -> bool:
    """True when ``error``, or an error it was raised from or while handling, is a :class:`PastTheBound`."""
    seen = set()
    cause: Optional[BaseException] = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, PastTheBound):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False
