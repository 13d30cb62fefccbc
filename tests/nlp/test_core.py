"""aitoolbox.nlp.core.core: ASCII folding, sentence normalisation, yes/no parsing and finding a token span."""
import pytest

from aitoolbox.nlp.core import core


@pytest.mark.parametrize("sub_list, expected", [
    ([1, 2, 3], (4, 6)),
    ([1, 1], (0, 1)),  # the first occurrence wins
    ([7], (9, 9)),
    ([1, 1, 1, 5, 1, 2, 3, 5, 6, 7], (0, 9)),  # the whole list
    ([10, 10], None),
    ([7, 7], None),  # would run past the end
])
def test_find_sub_list(sub_list, expected):
    assert core.find_sub_list(sub_list, [1, 1, 1, 5, 1, 2, 3, 5, 6, 7]) == expected


def test_find_sub_list_of_tokens_and_ranges():
    paragraph = "the tower was built in 1889 by the company".split()
    assert core.find_sub_list("in 1889".split(), paragraph) == (4, 5)
    assert core.find_sub_list(range(2, 4), range(6)) == (2, 3)


@pytest.mark.parametrize("sub_list, main_list, match", [
    ([1, 1, 1], [1, 1], "longer than main_list"),
    (range(10), range(5), "longer than main_list"),
    ([], [1, 2], "sub_list is empty"),
])
def test_find_sub_list_rejects_bad_input(sub_list, main_list, match):
    with pytest.raises(ValueError, match=match):
        core.find_sub_list(sub_list, main_list)


def test_normalize_string_splits_sentence_punctuation_and_drops_the_rest():
    assert core.normalize_string("For this purpose, we propose a hierarchical attention model to capture the "
                                 "context in a structured and dynamic manner.") == (
        "for this purpose we propose a hierarchical attention model to capture the context in a structured and "
        "dynamic manner .")
    assert core.normalize_string("For this purpose, we propose a 2-hierarchical 345 attention model to capture.") == (
        "for this purpose we propose a 2 hierarchical 345 attention model to capture .")
    assert core.normalize_string("  Really?!  Yes...  ") == "really ? ! yes . . ."


def test_normalize_string_folds_accents_unless_asked_not_to():
    assert core.normalize_string("Crème Brûlée, s'il vous plaît!") == "creme brulee s il vous plait !"
    # Without folding the accented letters are not ASCII letters, so they separate tokens.
    assert core.normalize_string("Crème", unicode_to_ascii_convert=False) == "cr me"


def test_unicode_to_ascii():
    assert core.unicode_to_ascii("Ünïcödé façade") == "Unicode facade"
    assert core.unicode_to_ascii("plain") == "plain"
    assert core.unicode_to_ascii("東京") == "東京"  # no ASCII base: kept


@pytest.mark.parametrize("word, expected", [("yes", True), ("TRUE", True), ("t", True), ("Y", True), ("1", True),
                                            ("no", False), ("False", False), ("f", False), ("N", False),
                                            ("0", False)])
def test_str2bool(word, expected):
    assert core.str2bool(word) is expected


def test_str2bool_rejects_other_words():
    with pytest.raises(ValueError, match="Boolean value expected.*'maybe'"):
        core.str2bool("maybe")
