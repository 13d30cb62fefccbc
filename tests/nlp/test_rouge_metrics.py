"""ROUGE through rouge-score: values computed by hand, and the Perl-style report with confidence intervals."""
import os

import pytest

from aitoolbox.nlp.experiment_evaluation.NLP_metrics import ROUGEMetric, ROUGEPerlMetric

rouge_scorer = pytest.importorskip("rouge_score.rouge_scorer")

# ref 'the cat sat on the mat' (6 tokens), hyp 'the cat on the mat' (5 tokens):
#   ROUGE-1: overlap the x2, cat, on, mat = 5 -> P 5/5, R 5/6, F 10/11
#   ROUGE-2: ref bigrams {the cat, cat sat, sat on, on the, the mat}, hyp {the cat, cat on, on the, the mat}:
#            overlap 3 -> P 3/4, R 3/5, F 2/3
#   ROUGE-L: longest common subsequence 'the cat on the mat' = 5 -> as ROUGE-1
REF, HYP = "the cat sat on the mat".split(), "the cat on the mat".split()
BY_HAND = {"rouge-1": {"p": 1., "r": 5 / 6, "f": 10 / 11}, "rouge-2": {"p": 3 / 4, "r": 3 / 5, "f": 2 / 3},
           "rouge-l": {"p": 1., "r": 5 / 6, "f": 10 / 11}}


def assert_nested_approx(actual, expected):
    assert actual.keys() == expected.keys()
    for name in expected:
        assert actual[name] == pytest.approx(expected[name]), name


def test_rouge_by_hand():
    rouge = ROUGEMetric([REF], [HYP])
    assert rouge.metric_name == "ROGUE"  # aitoolbox 1.x's spelling, kept for the result names
    assert_nested_approx(rouge.get_metric(), BY_HAND)
    assert list(rouge.get_metric_dict()) == ["ROGUE"]


def test_rouge_is_the_mean_over_examples():
    # A second example without any overlap halves every score.
    rouge = ROUGEMetric([REF, "a b".split()], [HYP, "c d".split()])
    assert_nested_approx(rouge.get_metric(), {name: {k: v / 2 for k, v in scores.items()}
                                              for name, scores in BY_HAND.items()})


def test_rouge_matches_rouge_score_on_longer_texts():
    refs = ["Police killed the gunman after a standoff on Tuesday.", "The economy grew by 3 percent last year."]
    hyps = ["The gunman was shot dead by police on Tuesday .", "Last year the economy grew three percent ."]
    rouge = ROUGEMetric(refs, [h.split() for h in hyps], target_actual_text=True)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"])
    scores = [scorer.score(ref, hyp) for ref, hyp in zip(refs, hyps)]
    for name, rouge_type in (("rouge-1", "rouge1"), ("rouge-2", "rouge2"), ("rouge-l", "rougeL")):
        for key, field in (("p", "precision"), ("r", "recall"), ("f", "fmeasure")):
            expected = sum(getattr(score[rouge_type], field) for score in scores) / 2
            assert rouge.get_metric()[name][key] == pytest.approx(expected)
    assert 0 < rouge.get_metric()["rouge-2"]["f"] < rouge.get_metric()["rouge-1"]["f"] < 1


def test_1x_values_and_rouge_tokenisation():
    rouge = ROUGEMetric(["Today the sun shines not".split()], ["Today the sun does shine".split()])
    assert_nested_approx(rouge.get_metric(),
                         {"rouge-1": {"f": .6, "p": .6, "r": .6}, "rouge-2": {"f": .5, "p": .5, "r": .5},
                          "rouge-l": {"f": .6, "p": .6, "r": .6}})
    zero = {name: {"f": 0., "p": 0., "r": 0.} for name in ("rouge-1", "rouge-2", "rouge-l")}
    rouge = ROUGEMetric(["today we go to the university".split()], ["bla mjav how w!?".split()])
    assert_nested_approx(rouge.get_metric(), zero)
    # ROUGE-1.5.5's tokenisation: case and punctuation do not matter.
    assert ROUGEMetric(["The Cat, sat."], [["the", "cat", "sat"]], target_actual_text=True)["rouge-2"]["f"] == 1.
    assert_nested_approx(ROUGEMetric([["x"]], [[]]).get_metric(), zero)  # an empty prediction scores 0


def test_several_references_best_one_counts_and_stemming():
    rouge = ROUGEMetric([["a cat sat", "the dog ran"]], [["the", "dog", "ran"]], target_actual_text=True)
    assert rouge["rouge-1"]["f"] == 1.
    plain = ROUGEMetric([["cats", "running"]], [["cat", "run"]])
    stemmed = ROUGEMetric([["cats", "running"]], [["cat", "run"]], use_stemmer=True)
    assert plain["rouge-1"]["f"] == 0. and stemmed["rouge-1"]["f"] == 1.


def test_custom_tokenizer_for_other_scripts():
    class WhitespaceTokenizer:
        def tokenize(self, text):
            return text.split()

    # rouge-score's own tokenizer keeps only a-z and 0-9, so Cyrillic text has no tokens at all.
    assert ROUGEMetric([["привет", "мир"]], [["привет", "мир"]])["rouge-1"]["f"] == 0.
    assert ROUGEMetric([["привет", "мир"]], [["привет", "друг"]],
                       tokenizer=WhitespaceTokenizer())["rouge-1"]["f"] == pytest.approx(.5)


def test_rouge_rejects_misaligned_inputs():
    with pytest.raises(ValueError, match="got 1 != 2"):
        ROUGEMetric([REF], [HYP, HYP])


def test_rouge_writes_cleaned_answer_files(tmp_path):
    ROUGEMetric([REF], [["<b>the</b>", "c@t", "!!"]], output_text_dir=str(tmp_path / "texts"))
    assert (tmp_path / "texts" / "answer_pred_true_0.txt").read_text(encoding="utf-8") == (
        "Answer to question 0:\nPredicted:\tthe ct !!\nTrue:\tthe cat sat on the mat\n")


# --- ROUGEPerlMetric ------------------------------------------------------------------------------------------
PERL_NAMES = {f"rouge_{n}_{measure}{suffix}" for n in ("1", "2", "3", "4", "l")
              for measure in ("recall", "precision", "f_score") for suffix in ("", "_cb", "_ce")}


def test_perl_style_report_by_hand(tmp_path):
    result = ROUGEPerlMetric([REF], [HYP], str(tmp_path / "perl")).get_metric()
    assert set(result) == PERL_NAMES
    assert result["rouge_1_recall"] == pytest.approx(5 / 6) and result["rouge_1_precision"] == 1.
    assert result["rouge_2_f_score"] == pytest.approx(2 / 3)
    # 3-grams: hyp {the cat on, cat on the, on the mat} vs ref {the cat sat, cat sat on, sat on the, on the mat}
    assert result["rouge_3_precision"] == pytest.approx(1 / 3) and result["rouge_3_recall"] == pytest.approx(1 / 4)
    assert result["rouge_l_recall"] == pytest.approx(5 / 6)
    # One example: every bootstrap resample is that example, so the interval is the value itself.
    assert result["rouge_1_recall_cb"] == result["rouge_1_recall_ce"] == pytest.approx(5 / 6)


def test_perl_style_interval_brackets_the_mean_and_repeats(tmp_path):
    refs = [REF, "a b c d".split(), "one two three".split(), "x y".split()]
    hyps = [HYP, "a b x d".split(), "one two".split(), "z".split()]
    first = ROUGEPerlMetric(refs, hyps, str(tmp_path / "first")).get_metric()
    second = ROUGEPerlMetric(refs, hyps, str(tmp_path / "second")).get_metric()
    assert first == second  # the bootstrap is seeded
    scorer = rouge_scorer.RougeScorer(["rouge1"])
    mean_recall = sum(scorer.score(" ".join(r), " ".join(h))["rouge1"].recall for r, h in zip(refs, hyps)) / 4
    assert first["rouge_1_recall"] == pytest.approx(mean_recall)
    assert first["rouge_1_recall_cb"] < first["rouge_1_recall"] < first["rouge_1_recall_ce"]
    assert 0 <= first["rouge_1_recall_cb"] and first["rouge_1_recall_ce"] <= 1


def test_perl_style_scores_the_cleaned_texts_it_writes(tmp_path):
    out = tmp_path / "perl"
    result = ROUGEPerlMetric([["<i>the</i>", "cat#"]], [["the", "cat", "<br>"]], str(out)).get_metric()
    assert result["rouge_2_f_score"] == 1.  # markup and stray characters removed before scoring
    assert (out / "true_answer" / "true_answer_text.0.txt").read_text(encoding="utf-8") == "the cat"
    assert (out / "pred_answer" / "pred_answer_text.0.txt").read_text(encoding="utf-8") == "the cat"
    ROUGEPerlMetric([["the"]], [["<br>"]], str(out))  # an empty prediction is written as a space
    assert os.listdir(out / "pred_answer") == ["pred_answer_text.0.txt"]
    assert (out / "pred_answer" / "pred_answer_text.0.txt").read_text(encoding="utf-8") == " "


def test_perl_style_with_reference_texts(tmp_path):
    result = ROUGEPerlMetric(["The cat sat."], [["the", "cat", "sat", "."]], str(tmp_path),
                             target_actual_text=True).get_metric()
    assert result["rouge_l_f_score"] == 1.
    assert (tmp_path / "true_answer" / "true_answer_text.0.txt").read_text(encoding="utf-8") == "The cat sat."


def test_regex_clean_text():
    patterns = (r"<.*?>", r"[^a-zA-Z0-9.?! ]+")
    assert ROUGEPerlMetric.regex_clean_text(["<b>bold</b>", "a&b", "<br>", "ok?"], patterns) == ["bold", "ab", "ok?"]
    assert ROUGEPerlMetric.regex_clean_text(["keep", "all"], []) == ["keep", "all"]


def test_perl_style_needs_a_folder():
    with pytest.raises(ValueError, match="needs output_text_dir"):
        ROUGEPerlMetric([REF], [HYP], None)
