"""Pinning a local file (or folder) for an upload that starts later, without holding it open.

A queued upload must carry the file even if it is deleted meanwhile (a checkpoint pruned locally, as aitoolbox
1.8's bucket keeps every checkpoint) or replaced (the next atomic save of the same name), yet an open file per
queued upload lets open files and deleted-but-held disk space grow with the queue. A hard link does both jobs
without a file descriptor: a hidden ``.tmp-upload-*`` name beside the file (same folder, so same file system)
keeps its data until the upload is done, whatever happens to the original name. A folder is pinned as a hidden
copy of its tree made of hard links. The ``.tmp-`` prefix is the one every writer and uploader of this package
ignores, so a process killed before the upload leaves at most such a link, as an interrupted atomic write does.

Where hard links are not possible (some network and FAT file systems), nothing is pinned: the upload opens the
original when it starts.

A pin never follows a symbolic link: a link is pinned as a link (a copy of the link itself), which the upload then
leaves out (:mod:`aitoolbox.cloud.folders`), so its target is neither linked nor read.
"""
import contextlib
import logging
import os
import shutil
import uuid
from typing import Optional

from aitoolbox.experiment.local_save.atomic import TEMP_PREFIX

logger = logging.getLogger(__name__)

STAGING_PREFIX = f"{TEMP_PREFIX}upload-"


class Pinned:
    """A file or folder pinned for its upload.

    Attributes:
        original: the path as submitted.
        path: what the upload reads: the hidden link (or copy of the tree), or ``original`` when it could not be
            pinned.
        pinned: whether ``path`` is a pin of its own.
    """

    def __init__(self, original: str, path: Optional[str]):
        self.original = original
        self.path = path or original
        self.pinned = path is not None

    def release(self, restore: bool = False) -> None:
        """Remove the pin once the upload is over. With ``restore`` (the upload failed or was dropped), a pinned
        file whose original name was removed meanwhile takes that name back, so that the run folder still holds
        every file whose upload did not happen; otherwise the pin is deleted."""
        if not self.pinned or not os.path.lexists(self.path):
            return
        if restore and not os.path.lexists(self.original):
            with contextlib.suppress(OSError):
                os.rename(self.path, self.original)  # same folder: atomic; a name taken meanwhile wins
                logger.warning("Put %s back into the local folder: it was removed before its upload happened",
                               self.original)
                return
        if os.path.isdir(self.path) and not os.path.islink(self.path):
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def pin(local_path: str) -> Pinned:
    """Pin the file or folder ``local_path`` (which exists) with hard links beside it."""
    directory, name = os.path.split(os.path.abspath(local_path))
    target = os.path.join(directory, f"{STAGING_PREFIX}{uuid.uuid4().hex}")
    # The pin's name leaves out the original's, so that no tool matching file names (TensorBoard reads every
    # "*tfevents*" file of a folder) takes it for a file of its own.
    try:
        if os.path.isdir(local_path) and not os.path.islink(local_path):
            _link_tree(local_path, target)
        else:
            os.link(local_path, target, follow_symlinks=False)  # a link swapped in meanwhile stays a link
    except (OSError, NotImplementedError) as error:  # NotImplementedError: no linkat without following
        if os.path.isdir(target):
            shutil.rmtree(target, ignore_errors=True)
        if isinstance(error, FileNotFoundError) and not os.path.lexists(local_path):
            raise
        logger.debug("Cannot pin %s with a hard link (%s): its upload reads it when it starts", local_path, error)
        return Pinned(local_path, None)
    return Pinned(local_path, target)


def _link_tree(source: str, target: str) -> None:
    """A copy of the folder ``source`` at ``target`` made of hard links (``.tmp-*`` entries left out); symbolic
    links, to files or folders, are copied as links (never followed)."""
    os.mkdir(target)
    for root, dirs, names in os.walk(source):  # does not descend into linked folders
        relative = os.path.relpath(root, source)
        here = os.path.normpath(os.path.join(target, relative))
        linked = [entry for entry in dirs if os.path.islink(os.path.join(root, entry))]
        dirs[:] = [entry for entry in dirs if not entry.startswith(TEMP_PREFIX) and entry not in linked]
        for entry in dirs:
            os.mkdir(os.path.join(here, entry))
        for entry in linked + names:
            if entry.startswith(TEMP_PREFIX):
                continue
            path = os.path.join(root, entry)
            if os.path.islink(path):
                os.symlink(os.readlink(path), os.path.join(here, entry))
            else:
                os.link(path, os.path.join(here, entry), follow_symlinks=False)
