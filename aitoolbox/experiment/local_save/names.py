"""The names that become folder names and bucket keys, checked in one place.

A run's files live in ``<root>/<project>/<experiment>_<timestamp>/`` and, in a bucket, under
``<cloud_dir_prefix>/<project>/<experiment>_<timestamp>/``. The project name, experiment name and timestamp are
each one component of that path: a ``/`` in one of them would nest folders (or, as ``..``, climb out of the
root), and the same name must give the same folder on every system and the same key in every bucket. So each is
a plain name: any text (spaces, dots, unicode included, as aitoolbox 1.x allowed) except

- empty, ``.`` and ``..``;
- ``/`` and ``\\`` (the path separators of POSIX and Windows);
- control characters (newlines, tabs, NUL, ...), which no file system or log shows faithfully.

``cloud_dir_prefix`` is a folder inside the bucket and may have several ``/``-separated components; none may be
``.`` or ``..`` or hold control characters.

Names read from storage (a folder's marker, a bucket listing) go through :func:`check_relative_path` before they
are joined onto a local folder, see :mod:`aitoolbox.cloud.folders`.
"""
import re
from typing import Any

_FORBIDDEN_IN_NAME = re.compile(r"[/\\\x00-\x1f\x7f]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_ALLOWED = ("a plain name: any text except '/', '\\', control characters (newlines, tabs, ...), '.' and '..' "
            "(spaces, dots, '-', '_' and unicode are fine)")


def check_name(value: Any, what: str) -> str:
    """Return ``value`` when it can be one component of a folder path and bucket key.

    Args:
        value: the name (a project name, an experiment name, a timestamp).
        what: the argument it came from, named in the error (e.g. ``'project_name'``).

    Raises:
        ValueError: ``value`` is not a string, is empty, ``.`` or ``..``, or holds ``/``, ``\\`` or a control
            character; the message names the value and what is allowed.
    """
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}: it names a folder and a bucket key")
    if value in (".", "..") or _FORBIDDEN_IN_NAME.search(value):
        raise ValueError(f"{what}={value!r} cannot name a folder or a bucket key: it must be {_ALLOWED}")
    return value


def check_key_prefix(value: Any, what: str = "cloud_dir_prefix") -> str:
    """Return the bucket folder ``value`` (``''`` or ``None``: the bucket's top) when its components are safe.

    Raises:
        ValueError: a ``/``-separated component is ``.`` or ``..``, or the prefix holds a control character.
    """
    if value is None or value == "":
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string (a folder inside the bucket), got {value!r}")
    if _CONTROL.search(value) or any(part in (".", "..") for part in value.split("/")):
        raise ValueError(f"{what}={value!r} cannot be a folder inside the bucket: its '/'-separated parts must not "
                         "be '.' or '..' nor hold control characters")
    return value


def check_relative_path(value: Any, where: str) -> str:
    """Return ``value``, a ``/``-separated path read from storage, when it stays inside the folder it is joined to.

    Args:
        value: a path inside a folder, as a folder marker or a bucket listing gives it (``'shard/0.distcp'``).
        where: where it was read (a marker's URI), named in the error.

    Raises:
        ValueError: ``value`` is empty, absolute (``/x``, ``C:...``, ``\\\\server``), holds ``\\`` or a control
            character, or has an empty, ``.`` or ``..`` component.
    """
    problem = None
    if not isinstance(value, str) or not value:
        problem = "it is empty"
    elif value.startswith("/") or re.match(r"^[A-Za-z]:", value):
        problem = "it is absolute"
    elif "\\" in value or _CONTROL.search(value):
        problem = "it holds '\\' or a control character"
    elif any(part in ("", ".", "..") for part in value.split("/")):
        problem = "a part of it is '..', '.' or empty"
    if problem is not None:
        raise ValueError(f"{where} names the file {value!r}, which is refused because {problem}: a name read from "
                         "storage must be a relative '/'-separated path that stays inside the folder it is "
                         "downloaded into")
    return value
