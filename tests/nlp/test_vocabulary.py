"""aitoolbox.nlp.core.vocabulary.Vocabulary: indices of words, the reserved tokens, trimming and converting."""
import logging

import numpy as np
import pytest
import torch

from aitoolbox.nlp.core.vocabulary import Vocabulary

SENT_1 = ["today", "the", "sun", "shines", "."]
SENT_2 = ["but", "tomorrow", "the", "sun", "will", "be", "gone", "and", "it", "will", "rain", "."]


@pytest.fixture
def vocab():
    vocabulary = Vocabulary("test")
    vocabulary.add_sentence(SENT_1)
    vocabulary.add_sentence(SENT_2)
    return vocabulary


def test_reserved_tokens_sentence_level():
    vocabulary = Vocabulary("test", document_level=False)
    assert (vocabulary.PAD_token, vocabulary.OOV_token, vocabulary.SOS_token, vocabulary.EOS_token) == (0, 1, 2, 3)
    assert vocabulary.name == "test" and vocabulary.document_level is False
    assert vocabulary.num_words == 4
    assert vocabulary.index2word == {0: "PAD", 1: "OOV", 2: "SOS", 3: "EOS"}
    assert vocabulary.default_tokens == [0, 1, 2, 3]
    assert vocabulary.word2index == {} and vocabulary.word2count == {}


def test_reserved_tokens_document_level():
    vocabulary = Vocabulary("test", document_level=True)
    assert (vocabulary.SOD_token, vocabulary.EOD_token) == (4, 5)
    assert vocabulary.num_words == 6
    assert vocabulary.index2word == {0: "PAD", 1: "OOV", 2: "SOS", 3: "EOS", 4: "SOD", 5: "EOD"}
    vocabulary.add_word("first")
    assert vocabulary.word2index == {"first": 6}


def test_words_get_indices_in_order_of_first_appearance(vocab):
    assert vocab.word2index == {"today": 4, "the": 5, "sun": 6, "shines": 7, ".": 8, "but": 9, "tomorrow": 10,
                                "will": 11, "be": 12, "gone": 13, "and": 14, "it": 15, "rain": 16}
    assert vocab.index2word[16] == "rain" and vocab.index2word[0] == "PAD"
    assert vocab.num_words == 4 + len(set(SENT_1 + SENT_2)) == 17
    assert vocab.word2count["the"] == 2 and vocab.word2count["will"] == 2 and vocab.word2count["today"] == 1


def test_add_sentence_stores_tokens_as_strings():
    vocabulary = Vocabulary("numbers")
    vocabulary.add_sentence([1, 2, 2])
    assert vocabulary.word2index == {"1": 4, "2": 5} and vocabulary.word2count == {"1": 1, "2": 2}
    assert vocabulary.convert_sent2idx_sent([2, 1, 3], start_end_token=False) == [5, 4, 1]


def test_convert_sent2idx_sent(vocab):
    assert vocab.convert_sent2idx_sent(SENT_1) == [2, 4, 5, 6, 7, 8, 3]
    assert vocab.convert_sent2idx_sent(SENT_2) == [2, 9, 10, 5, 6, 11, 12, 13, 14, 15, 11, 16, 8, 3]
    new_sent = ["today", "actually", "the", "sun", "is", "not", "shine", "but", "tomorrow", "it", "will", "rain", "."]
    assert vocab.convert_sent2idx_sent(new_sent) == [2, 4, 1, 5, 6, 1, 1, 1, 9, 10, 15, 11, 16, 8, 3]
    assert vocab.convert_sent2idx_sent(SENT_1, start_end_token=False) == [4, 5, 6, 7, 8]


def test_convert_sent2idx_sent_on_an_empty_vocabulary_is_a_clear_error():
    with pytest.raises(ValueError, match="has no words yet"):
        Vocabulary("empty").convert_sent2idx_sent(["a"])


def test_convert_idx_sent2sent_round_trip(vocab):
    assert vocab.convert_idx_sent2sent([2, 4, 5, 6, 7, 8, 3]) == ["SOS"] + SENT_1 + ["EOS"]
    assert vocab.convert_idx_sent2sent(vocab.convert_sent2idx_sent(SENT_2)) == ["SOS"] + SENT_2 + ["EOS"]
    back = vocab.convert_idx_sent2sent([2, 4, 1, 5, 6, 1, 3, 0, 0])
    assert back == ["SOS", "today", "OOV", "the", "sun", "OOV", "EOS", "PAD", "PAD"]
    assert vocab.convert_idx_sent2sent([2, 4, 1, 5, 6, 1, 3, 0, 0], rm_default_tokens=True) == ["today", "the", "sun"]


def test_convert_idx_sent2sent_takes_tensors_and_arrays(vocab):
    expected = ["today", "the", "sun"]
    assert vocab.convert_idx_sent2sent(torch.tensor([2, 4, 5, 6, 3, 0]), rm_default_tokens=True) == expected
    assert vocab.convert_idx_sent2sent(np.array([4, 5, 6])) == expected


def test_convert_idx_sent2sent_unknown_index(vocab):
    with pytest.raises(KeyError, match=r"indices \[99\] are not in vocabulary 'test' \(17 words"):
        vocab.convert_idx_sent2sent([4, 99])


def test_index2word_replaced_by_a_list():
    # As aitoolbox 1.x's translation example did with torchtext's index-to-word list.
    vocabulary = Vocabulary("itos")
    vocabulary.index2word = ["<unk>", "<pad>", "<eos>", "hello", "world"]
    vocabulary.default_tokens = [1, 2]
    assert vocabulary.convert_idx_sent2sent(torch.tensor([3, 4, 2, 1]), rm_default_tokens=True) == ["hello", "world"]
    assert vocabulary.convert_idx_sent2sent([0, 3]) == ["<unk>", "hello"]
    with pytest.raises(KeyError, match=r"indices \[-1, 5\]"):
        vocabulary.convert_idx_sent2sent([5, -1])


def test_trim_keeps_frequent_words_reindexed_with_their_counts(vocab, caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    with caplog.at_level(logging.INFO, logger="aitoolbox.nlp.core.vocabulary"):
        vocab.trim(min_count=2)
    assert vocab.word2index == {"the": 4, "sun": 5, ".": 6, "will": 7}
    assert vocab.index2word == {0: "PAD", 1: "OOV", 2: "SOS", 3: "EOS", 4: "the", 5: "sun", 6: ".", 7: "will"}
    assert vocab.word2count == {"the": 2, "sun": 2, ".": 2, "will": 2}
    assert vocab.num_words == 8
    assert "keeping 4 of 13 words" in caplog.text
    vocab.trim(min_count=3)  # trimming happens once
    assert vocab.num_words == 8


def test_trim_document_level_keeps_the_document_tokens():
    vocabulary = Vocabulary("doc", document_level=True)
    vocabulary.add_sentence(["a", "a", "b"])
    vocabulary.trim(2)
    assert vocabulary.index2word == {0: "PAD", 1: "OOV", 2: "SOS", 3: "EOS", 4: "SOD", 5: "EOD", 6: "a"}
    assert vocabulary.num_words == 7


def test_trim_of_an_empty_vocabulary():
    vocabulary = Vocabulary("empty")
    vocabulary.trim(1)
    assert vocabulary.num_words == 4 and vocabulary.trimmed
