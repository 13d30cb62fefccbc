"""Exact match and F1 of answer texts (the SQuAD evaluation), against values computed by hand."""
import os

import pytest

from aitoolbox.nlp.experiment_evaluation.NLP_metrics import ExactMatchTextMetric, F1TextMetric

# Three SQuAD-style questions. Normalised (lowercase, no punctuation, no a/an/the):
#   1. gold 'eiffel tower'             pred 'eiffel tower'               EM 1, F1 1
#   2. gold 'in 1889'                  pred '1889'                       EM 0, P 1/1, R 1/2 -> F1 2/3
#   3. gold 'gustave eiffels company'  pred 'company of gustave eiffel'  EM 0, shared {gustave, company}:
#                                                                        P 2/4, R 2/3 -> F1 4/7
GOLD_TEXT = ["the Eiffel Tower", "in 1889", "Gustave Eiffel's company"]
PRED_TOKENS = [["Eiffel", "Tower", "."], ["1889"], ["the", "company", "of", "Gustave", "Eiffel"]]
EXPECTED_EM = 100. * 1 / 3
EXPECTED_F1 = 100. * (1 + 2 / 3 + 4 / 7) / 3


def test_exact_match_and_f1_by_hand_on_squad_style_answers():
    gold_tokens = [text.split() for text in GOLD_TEXT]
    em = ExactMatchTextMetric(gold_tokens, PRED_TOKENS)
    f1 = F1TextMetric(gold_tokens, PRED_TOKENS)
    assert em.get_metric() == pytest.approx(EXPECTED_EM)
    assert f1.get_metric() == pytest.approx(EXPECTED_F1)
    assert em.get_metric_dict() == {"EM": em.get_metric()} and f1.get_metric_dict() == {"F1": f1.get_metric()}


def test_references_as_text():
    assert ExactMatchTextMetric(GOLD_TEXT, PRED_TOKENS, target_actual_text=True).get_metric() == (
        pytest.approx(EXPECTED_EM))
    assert F1TextMetric(GOLD_TEXT, PRED_TOKENS, target_actual_text=True).get_metric() == pytest.approx(EXPECTED_F1)


def test_several_reference_answers_the_best_counts():
    gold = [["Denver Broncos", "The Denver Broncos", "Broncos"], ["Carolina Panthers"]]
    # 'Broncos' matches the third answer exactly; 'Denver' scores best against 'denver broncos': P 1, R 1/2.
    exact = ExactMatchTextMetric(gold, [["Broncos"], ["Carolina", "Panthers"]], target_actual_text=True)
    assert exact.get_metric() == 100.
    assert F1TextMetric(gold, [["Denver"], ["Panthers"]], target_actual_text=True).get_metric() == (
        pytest.approx(100. * (2 / 3 + 2 / 3) / 2))
    with pytest.raises(ValueError, match="non-empty list of alternative answer strings"):
        ExactMatchTextMetric([[]], [["x"]], target_actual_text=True)


def test_1x_values():
    # The values aitoolbox 1.8's tests expected.
    gold = ["bla bla bla".split(), "bla NON dasdadad dqewq".split(), "bla blla".split(), "Today is sunny".split()]
    pred = ["bla bla bla".split(), "bla bla bla".split(), "uuuu".split(), "Today is Not sunny".split()]
    assert ExactMatchTextMetric(gold, pred).get_metric() == 25.
    assert F1TextMetric(gold, pred).get_metric() == pytest.approx(53.57142857142857)
    assert F1TextMetric(["bla bla bla".split(), "bla NON bla".split()],
                        ["bla bla bla".split(), "bla bla bla".split()]).get_metric() == pytest.approx(83.33333333333333)
    assert F1TextMetric(["not match".split()], ["bla bla bla".split()]).get_metric() == 0.


def test_empty_answers_agree_only_with_empty_answers():
    # SQuAD 2.0's unanswerable questions: an empty prediction is right exactly when the reference is empty.
    assert F1TextMetric(["", "", "an answer"], [[], ["guess"], []], target_actual_text=True).get_metric() == (
        pytest.approx(100. / 3))
    assert ExactMatchTextMetric(["", "the"], [[], []], target_actual_text=True).get_metric() == 100.  # 'the' -> ''


def test_normalisation():
    assert ExactMatchTextMetric.normalize_answer("  The  Quick, brown fox!  ") == "quick brown fox"
    assert ExactMatchTextMetric.normalize_answer("an apple a day") == "apple day"
    assert ExactMatchTextMetric.normalize_answer("theatre") == "theatre"  # whole words only
    assert F1TextMetric.get_tokens("") == [] and F1TextMetric.get_tokens("A cat.") == ["cat"]
    # gold [cat, sat], predicted [cat, cat]: one shared token (counted with multiplicity), P 1/2, R 1/2
    assert F1TextMetric.compute_f1("the cat sat", "cat cat") == pytest.approx(0.5)


@pytest.mark.parametrize("metric", [ExactMatchTextMetric, F1TextMetric])
def test_misaligned_or_empty_inputs(metric):
    with pytest.raises(ValueError, match=r"len\(y_true\) != len\(y_predicted\): got 1 != 2"):
        metric(["bla bla bla".split()], ["bla bla bla".split(), "bla bla bla".split()])
    with pytest.raises(ValueError, match="empty"):
        metric([], [])


def test_answers_written_to_files(tmp_path):
    out = tmp_path / "answers"
    ExactMatchTextMetric([t.split() for t in GOLD_TEXT], PRED_TOKENS, output_text_dir=str(out))
    assert sorted(os.listdir(out)) == [f"answer_pred_true_{i}.txt" for i in range(3)]
    assert (out / "answer_pred_true_1.txt").read_text(encoding="utf-8") == (
        "Answer to question 1:\nPredicted:\t1889\nTrue:\tin 1889\n")
    # A smaller evaluation into the same folder leaves no stale answers; other files stay.
    (out / "notes.md").write_text("mine")
    F1TextMetric([["a"]], [["b"]], output_text_dir=str(out))
    assert sorted(os.listdir(out)) == ["answer_pred_true_0.txt", "notes.md"]
