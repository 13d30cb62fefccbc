"""A word vocabulary: token strings to indices and back, with reserved indices for padding and sentence marks."""
import logging
from collections.abc import Mapping
from typing import Any, Dict, Iterable, List

logger = logging.getLogger(__name__)


def _as_index_list(idx_sent: Any) -> List[int]:
    """Plain ints from a list, a numpy array or a tensor of token indices (tensor elements do not hash as ints)."""
    if hasattr(idx_sent, "tolist"):
        idx_sent = idx_sent.tolist()
    return [int(idx) for idx in idx_sent]


class Vocabulary:
    """Token indices of the words seen in a corpus, built sentence by sentence.

    Indices 0-3 are reserved: ``PAD_token`` (0, padding), ``OOV_token`` (1, out of vocabulary),
    ``SOS_token`` (2, start of sentence) and ``EOS_token`` (3, end of sentence). A document-level
    vocabulary also reserves ``SOD_token`` (4) and ``EOD_token`` (5), marking the start and the end of a
    document of several sentences. Words get the next free index in the order they are first added.

    Attributes:
        word2index: ``{word: index}`` of the added words (reserved tokens not included).
        word2count: ``{word: number of times added}``.
        index2word: ``{index: word}``, reserved tokens included (``'PAD'``, ``'OOV'``, ``'SOS'``, ...). It may be
            replaced by a list of words indexed by position (e.g. another library's index-to-word list), with
            ``default_tokens`` set to that list's reserved indices.
        num_words: the number of indices in use, reserved ones included.
        default_tokens: the reserved indices.

    Args:
        name: a name for the vocabulary (e.g. the language), for your own bookkeeping.
        document_level: also reserve the start- and end-of-document tokens.
    """

    PAD_token = 0
    OOV_token = 1
    SOS_token = 2
    EOS_token = 3
    SOD_token = 4
    EOD_token = 5

    def __init__(self, name: str, document_level: bool = False):
        self.name = name
        self.document_level = document_level
        self.trimmed = False
        self.word2index: Dict[str, int] = {}
        self.word2count: Dict[str, int] = {}
        self.index2word: Dict[int, str] = {}
        self.default_tokens: List[int] = []
        self.num_words = 0
        self._reset_to_reserved_tokens()

    def _reset_to_reserved_tokens(self) -> None:
        reserved = {self.PAD_token: "PAD", self.OOV_token: "OOV", self.SOS_token: "SOS", self.EOS_token: "EOS"}
        if self.document_level:
            reserved.update({self.SOD_token: "SOD", self.EOD_token: "EOD"})
        self.word2index, self.word2count = {}, {}
        self.index2word = dict(reserved)
        self.default_tokens = list(reserved)
        self.num_words = len(reserved)

    def add_sentence(self, sentence_tokens: Iterable[Any]) -> None:
        """Add every token of a tokenized sentence (tokens are turned into strings).

        Args:
            sentence_tokens: the sentence's tokens, e.g. ``['today', 'the', 'sun', 'shines', '.']``.
        """
        for word in sentence_tokens:
            self.add_word(str(word))

    def add_word(self, word: str) -> None:
        """Add one word: a new word gets the next free index, a known one has its count raised.

        Args:
            word: the word.
        """
        if word in self.word2index:
            self.word2count[word] += 1
            return
        self.word2index[word] = self.num_words
        self.word2count[word] = 1
        self.index2word[self.num_words] = word
        self.num_words += 1

    def trim(self, min_count: int) -> None:
        """Keep only the words added at least ``min_count`` times, re-indexed from the first free index.

        The kept words keep their order of first appearance and their counts. Trimming happens once: later
        calls do nothing (the counts of removed words are gone).

        Args:
            min_count: the smallest count of a word that stays.
        """
        if self.trimmed:
            return
        self.trimmed = True
        kept = {word: count for word, count in self.word2count.items() if count >= min_count}
        total = len(self.word2index)
        logger.info("Vocabulary %r: keeping %d of %d words (%.4f) seen at least %d times", self.name, len(kept),
                    total, len(kept) / total if total else 1.0, min_count)
        self._reset_to_reserved_tokens()
        for word, count in kept.items():
            self.add_word(word)
            self.word2count[word] = count

    def convert_sent2idx_sent(self, sent_tokens: Iterable[Any], start_end_token: bool = True) -> List[int]:
        """Turn a tokenized sentence into indices; unknown words become ``OOV_token``.

        Args:
            sent_tokens: the sentence's tokens (turned into strings, as :meth:`add_sentence` does).
            start_end_token: put ``SOS_token`` before and ``EOS_token`` after the sentence.

        Returns:
            The token indices.

        Raises:
            ValueError: no word has been added to the vocabulary yet.
        """
        if not self.word2index:
            raise ValueError(f"Vocabulary {self.name!r} has no words yet: add sentences with add_sentence() first")
        indices = [self.word2index.get(str(word), self.OOV_token) for word in sent_tokens]
        if start_end_token:
            indices = [self.SOS_token] + indices + [self.EOS_token]
        return indices

    def convert_idx_sent2sent(self, idx_sent: Any, rm_default_tokens: bool = False) -> List[str]:
        """Turn token indices back into words.

        Args:
            idx_sent: the indices (a list, a numpy array or a 1-D tensor).
            rm_default_tokens: leave out the reserved tokens (padding, out-of-vocabulary, start and end marks).

        Returns:
            The words, reserved tokens shown as ``'PAD'``, ``'OOV'``, ``'SOS'``, ... when kept.

        Raises:
            KeyError: an index that is not in the vocabulary.
        """
        indices = _as_index_list(idx_sent)
        if rm_default_tokens:
            reserved = set(self.default_tokens)
            indices = [idx for idx in indices if idx not in reserved]
        unknown = sorted({idx for idx in indices if not self._known_index(idx)})
        if unknown:
            raise KeyError(f"indices {unknown} are not in vocabulary {self.name!r} "
                           f"({len(self.index2word)} words, reserved tokens included)")
        return [self.index2word[idx] for idx in indices]

    def _known_index(self, idx: int) -> bool:
        # index2word may have been replaced by a list (e.g. torchtext's itos), as aitoolbox 1.x's examples did.
        if isinstance(self.index2word, Mapping):
            return idx in self.index2word
        return 0 <= idx < len(self.index2word)
