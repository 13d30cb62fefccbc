"""The names that become folder names and bucket keys, checked in one place.

A run's files live in ``<root>/<project>/<experiment>_<timestamp>/`` and, in a bucket, under
``<cloud_dir_prefix>/<project>/<experiment>_<timestamp>/``. The project name, experiment name and timestamp are
each one component of that path: a ``/`` in one of them would nest folders (or, as ``..``, climb out of the
root), and the same name must give the same folder on every system and the same key in every bucket. So each is
a plain name: any text (spaces, dots, unicode included, as aitoolbox 1.x allowed) except

- empty, ``.`` and ``..``;
- ``/`` and ``\\`` (the path separators of POSIX and Windows);
- characters that no file system, bucket, log or e-mail header takes or shows faithfully
  (:func:`forbidden_character`): control characters, C0 and C1 (newlines, tabs, NUL, U+0085 NEXT LINE, ...),
  the line and paragraph separators U+2028 and U+2029, lone surrogates (text that cannot be encoded as UTF-8),
  Unicode's non-characters (U+FFFE, U+FDD0, ...) and the bidirectional formatting controls (U+202E
  RIGHT-TO-LEFT OVERRIDE and its kin, which make a name display as another);
- more than 255 bytes in UTF-8 (the longest file name file systems take).

``cloud_dir_prefix`` is a folder inside the bucket and may have several ``/``-separated components; none may be
``.`` or ``..`` or hold those characters.

Names read from storage (a folder's marker, a bucket listing) go through :func:`check_relative_path` before they
are joined onto a local folder, see :mod:`aitoolbox.cloud.folders`.
"""
import re
import unicodedata
from typing import Any, Optional

#: The longest name, in bytes of UTF-8, that a file system takes for one folder.
MAX_NAME_BYTES = 255
_ALLOWED = ("a plain name: any text except '/', '\\', control characters (newlines, tabs, U+0085, ...), line "
            "separators, lone surrogates, non-characters and bidirectional overrides, '.' and '..', at most 255 bytes "
            "in UTF-8 (spaces, dots, '-', '_' and unicode letters are fine)")
# The bidirectional formatting controls: embeddings, overrides and isolates, and the marks.
_BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _describe(char: str) -> str:
    code = f"U+{ord(char):04X}"
    if unicodedata.category(char) == "Cs":
        return f"{code} (a lone surrogate)"
    unnamed = "a control character" if unicodedata.category(char) == "Cc" else "a non-character"
    return f"{code} ({unicodedata.name(char, unnamed)})"


def forbidden_character(value: str) -> Optional[str]:
    """The first character of ``value`` that a name must not hold, described with its position (``'U+2028 (LINE
    SEPARATOR) at position 3'``); None when there is none. See the module for the characters."""
    for position, char in enumerate(value):
        code = ord(char)
        if unicodedata.category(char) in ("Cc", "Cs", "Zl", "Zp") or char in _BIDI_CONTROLS \
                or 0xFDD0 <= code <= 0xFDEF or (code & 0xFFFE) == 0xFFFE:
            return f"{_describe(char)} at position {position}"
    return None


def check_name(value: Any, what: str) -> str:
    """Return ``value`` when it can be one component of a folder path and bucket key.

    Args:
        value: the name (a project name, an experiment name, a timestamp).
        what: the argument it came from, named in the error (e.g. ``'project_name'``).

    Raises:
        ValueError: ``value`` is not a string, is empty, ``.`` or ``..``, holds ``/``, ``\\`` or a character of
            :func:`forbidden_character`, or is longer than 255 bytes in UTF-8; the message names the value, the
            offending character and what is allowed.
    """
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}: it names a folder and a bucket key")
    problem = forbidden_character(value)
    if problem is None and value in (".", ".."):
        problem = "it is a path's own folder or its parent"
    if problem is None and ("/" in value or "\\" in value):
        problem = "it holds a path separator"
    if problem is None and len(value.encode("utf-8")) > MAX_NAME_BYTES:
        problem = f"it is {len(value.encode('utf-8'))} bytes in UTF-8; a file system takes at most {MAX_NAME_BYTES}"
    if problem is not None:
        prefix = "" if problem.startswith("it ") else "it holds "
        raise ValueError(f"{what}={value!r} cannot name a folder or a bucket key: it must be {_ALLOWED}; "
                         f"{prefix}{problem}")
    return value


def check_key_prefix(value: Any, what: str = "cloud_dir_prefix") -> str:
    """Return the bucket folder ``value`` (``''`` or ``None``: the bucket's top) when its components are safe.

    Raises:
        ValueError: a ``/``-separated component is ``.`` or ``..``, or the prefix holds a character of
            :func:`forbidden_character`.
    """
    if value is None or value == "":
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string (a folder inside the bucket), got {value!r}")
    problem = forbidden_character(value)
    if problem is not None or any(part in (".", "..") for part in value.split("/")):
        detail = f" (it holds {problem})" if problem else ""
        raise ValueError(f"{what}={value!r} cannot be a folder inside the bucket{detail}: its '/'-separated parts "
                         "must not be '.' or '..' nor hold control characters, line separators, lone surrogates, "
                         "non-characters or bidirectional overrides")
    return value


def check_relative_path(value: Any, where: str) -> str:
    """Return ``value``, a ``/``-separated path read from storage, when it stays inside the folder it is joined to.

    Args:
        value: a path inside a folder, as a folder marker or a bucket listing gives it (``'shard/0.distcp'``).
        where: where it was read (a marker's URI), named in the error.

    Raises:
        ValueError: ``value`` is empty, absolute (``/x``, ``C:...``, ``\\\\server``), holds ``\\`` or a character of
            :func:`forbidden_character`, or has an empty, ``.`` or ``..`` component.
    """
    problem = None
    if not isinstance(value, str) or not value:
        problem = "it is empty"
    elif value.startswith("/") or re.match(r"^[A-Za-z]:", value):
        problem = "it is absolute"
    elif "\\" in value:
        problem = "it holds '\\'"
    elif forbidden_character(value) is not None:
        problem = f"it holds {forbidden_character(value)}"
    elif any(part in ("", ".", "..") for part in value.split("/")):
        problem = "a part of it is '..', '.' or empty"
    if problem is not None:
        raise ValueError(f"{where} names the file {value!r}, which is refused because {problem}: a name read from "
                         "storage must be a relative '/'-separated path that stays inside the folder it is "
                         "downloaded into")
    return value
