"""Small text helpers: ASCII folding, sentence normalisation, parsing yes/no flags, finding a token span."""
import re
import unicodedata
from typing import Optional, Sequence, Tuple

# Sentence-ending punctuation is kept as a token of its own; everything else that is not a letter or a
# digit separates tokens.
_SENTENCE_PUNCTUATION = re.compile(r"([.!?])")
_NOT_KEPT = re.compile(r"[^0-9a-zA-Z.!?]+")
_WHITESPACE = re.compile(r"\s+")

_TRUE_WORDS = frozenset({"yes", "true", "t", "y", "1"})
_FALSE_WORDS = frozenset({"no", "false", "f", "n", "0"})


def unicode_to_ascii(text_string: str) -> str:
    """Drop the accents of a Unicode string: ``'Crème brûlée'`` becomes ``'Creme brulee'``.

    The text is decomposed (NFD) and the combining marks removed; characters without an ASCII base
    (e.g. CJK) are kept as they are.

    Args:
        text_string: the text.

    Returns:
        The text without combining accents.
    """
    decomposed = unicodedata.normalize("NFD", text_string)
    return "".join(char for char in decomposed if unicodedata.category(char) != "Mn")


def normalize_string(text_string: str, unicode_to_ascii_convert: bool = True) -> str:
    """Lowercase, fold accents, split off ``. ! ?`` and replace every other non-alphanumeric run by a space.

    ``'For this purpose, we propose a 2-level model.'`` becomes
    ``'for this purpose we propose a 2 level model .'``.

    Args:
        text_string: the text.
        unicode_to_ascii_convert: fold accented letters to ASCII first (:func:`unicode_to_ascii`); without it
            accented letters are treated as separators.

    Returns:
        The normalised text, tokens separated by single spaces.
    """
    text = text_string.lower().strip()
    if unicode_to_ascii_convert:
        text = unicode_to_ascii(text)
    text = _SENTENCE_PUNCTUATION.sub(r" \1", text)
    text = _NOT_KEPT.sub(" ", text)
    return _WHITESPACE.sub(" ", text).strip()


def str2bool(w: str) -> bool:
    """Parse a yes/no command-line value: ``yes/true/t/y/1`` or ``no/false/f/n/0`` (any case).

    Args:
        w: the value.

    Returns:
        The boolean it stands for.

    Raises:
        ValueError: ``w`` is none of those words.
    """
    word = w.lower()
    if word in _TRUE_WORDS:
        return True
    if word in _FALSE_WORDS:
        return False
    raise ValueError(f"Boolean value expected: one of {sorted(_TRUE_WORDS)} or {sorted(_FALSE_WORDS)}, got {w!r}")


def find_sub_list(sub_list: Sequence, main_list: Sequence) -> Optional[Tuple[int, int]]:
    """Where ``sub_list`` first occurs as a contiguous run in ``main_list``, e.g. an answer span in a paragraph.

    Args:
        sub_list: the elements to look for, e.g. the answer's tokens.
        main_list: the longer sequence, e.g. the paragraph's tokens.

    Returns:
        ``(start, end)``, the indices of the first and the last element of the first occurrence (both
        inclusive), or None when ``sub_list`` does not occur.

    Raises:
        ValueError: ``sub_list`` is empty or longer than ``main_list``.
    """
    sub, main = list(sub_list), list(main_list)
    if len(sub) > len(main):
        raise ValueError(f"sub_list is longer than main_list ({len(sub)} > {len(main)} elements); "
                         "it cannot occur in it")
    if not sub:
        raise ValueError("sub_list is empty: give at least one element to look for")
    length = len(sub)
    for start in range(len(main) - length + 1):
        if main[start] == sub[0] and main[start:start + length] == sub:
            return start, start + length - 1
    return None
