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
  format characters (Unicode category Cf: the invisible U+200B ZERO WIDTH SPACE and U+FEFF, the bidirectional
  controls such as U+202E RIGHT-TO-LEFT OVERRIDE, which make a name display as another), the line and paragraph
  separators U+2028 and U+2029, private-use characters, lone surrogates (text that cannot be encoded as UTF-8)
  and Unicode's non-characters (U+FFFE, U+FDD0, ...); also the other invisible characters (Unicode's
  default-ignorable code points: U+034F COMBINING GRAPHEME JOINER, the Hangul fillers, variation selectors), blanks
  that look like a space (U+2800 BRAILLE PATTERN BLANK) and look-alikes of ``/`` and ``\\`` (U+2215 DIVISION
  SLASH, U+2044 FRACTION SLASH...). Two invisible characters have a job in some words and are taken there: U+200C
  ZERO WIDTH NON-JOINER and U+200D ZERO WIDTH JOINER between two letters of a script that joins (Persian
  ``می‌خواهم``, Devanagari) or two emoji (``👩‍🔬``), and a variation selector after an emoji or a CJK ideograph;
- text that Unicode's NFKC normalization changes (:func:`nfkc_change`): the full-width solidus U+FF0F, which
  becomes ``/``, ligatures, full-width letters, an ``e`` followed by a combining accent. Such a name looks like
  another, and a file system or bucket that normalizes names (macOS's, some sync tools) stores it as that other
  one (a name in NFD, as macOS's HFS+ lists ``Café``, is refused too: the message gives its NFKC form to use);
- a Latin word holding a Cyrillic or Greek letter drawn like a Latin one (``rаn`` with a Cyrillic ``а``), which
  reads as another name (:func:`mixed_scripts`); Greek or Cyrillic words of their own are fine (``α_sweep``,
  ``опыт``), and so are letters that look like no Latin one (``μP``);
- more than 255 bytes in UTF-8 (the longest file name file systems take).

``cloud_dir_prefix`` is a folder inside the bucket and may have several ``/``-separated components; none may be
``.`` or ``..`` or hold those characters, and it must be NFKC-stable as well.

Names read from storage (a folder's marker, a bucket listing) go through :func:`check_relative_path` before they
are joined onto a local folder, see :mod:`aitoolbox.cloud.folders`.
"""
import re
import unicodedata
from typing import Any, Optional

from aitoolbox.experiment.secret_names import as_latin_letters

#: The longest name, in bytes of UTF-8, that a file system takes for one folder.
MAX_NAME_BYTES = 255
_ALLOWED = ("a plain name: any text except '/', '\\', control and format characters (newlines, tabs, U+0085, "
            "zero-width spaces, bidirectional overrides, ...) and other invisible characters, look-alikes of '/' "
            "and '\\', line separators, private-use characters, lone surrogates and non-characters, text that NFKC "
            "normalization changes (full-width or look-alike characters, ligatures, accents written apart), a Latin "
            "word with a Cyrillic or Greek look-alike letter, '.' and '..', at most 255 bytes in UTF-8 (spaces, dots, "
            "'-', '_' and unicode letters are fine)")
# Unicode's categories of characters a name never holds: control, format (invisible: zero-width, bidirectional
# controls, the byte order mark), line and paragraph separators, private use, surrogates.
_FORBIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Co", "Cs"})
# Invisible characters of allowed categories (Unicode's default-ignorable code points that are not format
# characters), blanks drawn like a space, and look-alikes of the path separators.
_INVISIBLE = ((0x034F, 0x034F), (0x115F, 0x1160), (0x17B4, 0x17B5), (0x180B, 0x180F), (0x3164, 0x3164),
              (0xFE00, 0xFE0F), (0xFFA0, 0xFFA0), (0xE0100, 0xE01EF), (0x2800, 0x2800))
_SEPARATOR_LOOK_ALIKES = frozenset("\u2044\u2215\u2216\u2571\u2572\u27cb\u27cd\u29f5\u29f8\u29f9")
_JOINERS = frozenset("\u200c\u200d")
_VARIATION_SELECTORS = ((0xFE00, 0xFE0F), (0xE0100, 0xE01EF))
# Scripts whose words never need a zero-width joiner or non-joiner.
_LOOK_ALIKE_SCRIPTS = ("LATIN", "CYRILLIC", "GREEK")
_UNNAMED = {"Cc": "a control character", "Co": "a private-use character", "Cs": "a lone surrogate"}


def _describe(char: str) -> str:
    code = f"U+{ord(char):04X}"
    category = unicodedata.category(char)
    if category == "Cs":
        return f"{code} (a lone surrogate)"
    return f"{code} ({unicodedata.name(char, _UNNAMED.get(category, 'a non-character'))})"


def _in(code: int, ranges: tuple) -> bool:
    return any(low <= code <= high for low, high in ranges)


def _script(char: str) -> str:
    """The first word of the character's Unicode name (``LATIN``, ``CYRILLIC``, ``ARABIC``, ``CJK``...)."""
    return unicodedata.name(char, "").split(" ", 1)[0]


def _joins(char: str) -> bool:
    """Whether a zero-width joiner or non-joiner next to ``char`` may have a job: a letter or mark of a script
    whose words use them (not Latin, Cyrillic or Greek), an emoji or its modifier, an emoji's variation selector."""
    category = unicodedata.category(char)
    if char.isascii():
        return False
    if category in ("So", "Sk") or char == "\ufe0f":
        return True
    return category[0] in "LM" and _script(char) not in _LOOK_ALIKE_SCRIPTS


def _has_a_job(value: str, position: int) -> bool:
    """Whether the invisible character at ``position`` does something there (see the module): a joiner between two
    characters that join, a variation selector after an emoji or a CJK ideograph."""
    char = value[position]
    before = value[position - 1] if position > 0 else ""
    after = value[position + 1] if position + 1 < len(value) else ""
    if char in _JOINERS:
        return bool(before) and bool(after) and _joins(before) and _joins(after)
    if _in(ord(char), _VARIATION_SELECTORS) and before:
        return unicodedata.category(before) == "So" or _script(before) == "CJK" or \
            (before in "0123456789#*" and after == "\u20e3")  # a keycap: "1", U+FE0F, U+20E3
    return False


def forbidden_character(value: str) -> Optional[str]:
    """The first character of ``value`` that a name must not hold, described with its position (``'U+2028 (LINE
    SEPARATOR) at position 3'``); None when there is none. See the module for the characters."""
    for position, char in enumerate(value):
        code = ord(char)
        if char in _SEPARATOR_LOOK_ALIKES:
            return f"{_describe(char)} at position {position}, which looks like a path separator"
        if (unicodedata.category(char) in _FORBIDDEN_CATEGORIES or _in(code, _INVISIBLE)) \
                and not _has_a_job(value, position):
            return f"{_describe(char)} at position {position}"
        if 0xFDD0 <= code <= 0xFDEF or (code & 0xFFFE) == 0xFFFE:
            return f"{_describe(char)} at position {position}"
    return None


def mixed_scripts(value: str) -> Optional[str]:
    """Where a word of ``value`` (a run of letters and marks) with Latin letters holds a Cyrillic or Greek letter
    drawn like a Latin one, described (``"U+0430 (CYRILLIC SMALL LETTER A) at position 1 in the Latin word
    'rаn'"``); None when no word does. Such a word reads as another: ``rаn`` with a Cyrillic ``а`` is not
    ``ran``. Letters that look like no Latin one mix freely (``μP``, ``βeta``)."""
    for word in re.finditer(r"[^\W\d_]+", value):
        if not any(_script(char) == "LATIN" for char in word.group()):
            continue
        for offset, char in enumerate(word.group()):
            if _script(char) in ("CYRILLIC", "GREEK") and as_latin_letters(char).isascii():
                return f"{_describe(char)} at position {word.start() + offset} in the Latin word " \
                       f"{word.group()!r}, which reads as another name"
    return None


def nfkc_change(value: str) -> Optional[str]:
    """Where NFKC normalization changes ``value``, described (``"U+FF0F (FULLWIDTH SOLIDUS) at position 3, which
    NFKC normalization writes as '/'"``); None when ``value`` is NFKC-stable. ``value`` must hold no lone
    surrogate (:func:`forbidden_character` first)."""
    normalized = unicodedata.normalize("NFKC", value)
    if normalized == value:
        return None
    for position, char in enumerate(value):
        if unicodedata.normalize("NFKC", char) != char:  # a look-alike, a ligature, a full-width letter
            return f"{_describe(char)} at position {position}, which NFKC normalization writes as " \
                   f"{unicodedata.normalize('NFKC', char)!r}"
    # Each character is stable alone: a sequence composes (an "e" then U+0301 COMBINING ACUTE ACCENT is "é", Hangul
    # jamo a syllable). The shortest span from the first difference that normalizes to what the name becomes.
    differences = [position for position, (given, stable) in enumerate(zip(value, normalized)) if given != stable]
    start = differences[0] if differences else min(len(value), len(normalized)) - 1
    end = start + 1
    while end < len(value) and (unicodedata.normalize("NFKC", value[start:end]) == value[start:end] or
                                unicodedata.normalize("NFKC", value[:end]) + unicodedata.normalize(
                                    "NFKC", value[end:]) != normalized):
        end += 1
    codes = " ".join(_describe(char) for char in value[start:end])
    return f"{codes} at position {start}, which NFKC normalization writes as " \
           f"{unicodedata.normalize('NFKC', value[start:end])!r}"


def check_name(value: Any, what: str) -> str:
    """Return ``value`` when it can be one component of a folder path and bucket key.

    Args:
        value: the name (a project name, an experiment name, a timestamp).
        what: the argument it came from, named in the error (e.g. ``'project_name'``).

    Raises:
        ValueError: ``value`` is not a string, is empty, ``.`` or ``..``, holds ``/``, ``\\`` or a character of
            :func:`forbidden_character`, is changed by NFKC normalization (:func:`nfkc_change`), or is longer than
            255 bytes in UTF-8; the message names the value, the offending character (its code point and name)
            and what is allowed.
    """
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}: it names a folder and a bucket key")
    problem = forbidden_character(value)
    if problem is None:
        problem = nfkc_change(value)
        if problem is not None:
            problem += f" (the whole name so written: {unicodedata.normalize('NFKC', value)!r}; use that)"
    if problem is None:
        problem = mixed_scripts(value)
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
        ValueError: a ``/``-separated component is ``.`` or ``..``, the prefix holds a character of
            :func:`forbidden_character`, or NFKC normalization changes it (:func:`nfkc_change`).
    """
    if value is None or value == "":
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string (a folder inside the bucket), got {value!r}")
    problem = forbidden_character(value) or nfkc_change(value) or mixed_scripts(value)
    if problem is not None or any(part in (".", "..") for part in value.split("/")):
        detail = f" (it holds {problem})" if problem else ""
        raise ValueError(f"{what}={value!r} cannot be a folder inside the bucket{detail}: its '/'-separated parts "
                         "must not be '.' or '..' nor hold control or format characters (zero-width spaces, "
                         "bidirectional overrides), line separators, private-use characters, lone surrogates or "
                         "non-characters, and it must read the same after NFKC normalization (no full-width or "
                         "look-alike characters)")
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
