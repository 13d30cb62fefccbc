"""BLEU (nltk on tokens, sacrebleu on text) against hand-computed values and sacrebleu itself; perplexity
against torch's cross-entropy."""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from aitoolbox.nlp.experiment_evaluation.NLP_metrics import (
    BLEUCorpusScoreMetric,
    BLEUScoreStrTorchNLPMetric,
    BLEUSentenceScoreMetric,
    PerplexityMetric,
)

sacrebleu = pytest.importorskip("sacrebleu")
pytest.importorskip("nltk")

# hyp 'the cat sat on the mat' (6 tokens) vs ref 'the cat sat on the red mat' (7 tokens), by hand:
#   clipped n-gram precisions p1 = 6/6, p2 = 4/5, p3 = 3/4, p4 = 2/3; brevity penalty exp(1 - 7/6)
HYP = "the cat sat on the mat".split()
REF = "the cat sat on the red mat".split()
BLEU_BY_HAND = math.exp(1 - 7 / 6) * (1 * 4 / 5 * 3 / 4 * 2 / 3) ** 0.25

REFS = [REF, "he read the book because he was interested in world history".split(),
        "it is a guide to action that ensures that the military always obeys the commands of the party".split()]
HYPS = [HYP, "he was interested in world history because he read the book".split(),
        "it is a guide to action which ensures that the military always obeys the commands of the party".split()]


def sacrebleu_on_tokens(refs, hyps):
    """sacrebleu's corpus BLEU (0-1) of already tokenized text: no retokenizing, no smoothing."""
    return sacrebleu.corpus_bleu([" ".join(h) for h in hyps], [[" ".join(r) for r in refs]], tokenize="none",
                                 smooth_method="none").score / 100


def test_sentence_bleu_by_hand():
    bleu = BLEUSentenceScoreMetric([REF], [HYP])
    assert bleu.get_metric() == pytest.approx(BLEU_BY_HAND)
    assert bleu.get_metric_dict() == {"BLEU_sentence_score": bleu.get_metric()}
    assert BLEUCorpusScoreMetric([REF], [HYP]).get_metric() == pytest.approx(BLEU_BY_HAND)


def test_corpus_bleu_equals_sacrebleu_corpus_bleu():
    corpus = BLEUCorpusScoreMetric(REFS, HYPS)
    assert corpus.get_metric() == pytest.approx(sacrebleu_on_tokens(REFS, HYPS), rel=1e-12)
    assert corpus.get_metric_dict() == {"BLEU_corpus_score": corpus.get_metric()}
    # Corpus BLEU sums the n-gram statistics; it is not the mean of the sentence scores.
    sentence_mean = BLEUSentenceScoreMetric(REFS, HYPS).get_metric()
    assert sentence_mean == pytest.approx(sum(sacrebleu_on_tokens([r], [h]) for r, h in zip(REFS, HYPS)) / 3)
    assert sentence_mean != pytest.approx(corpus.get_metric())


def test_1x_values():
    # The values aitoolbox 1.8's tests expected (nltk, as in 1.8).
    refs = ["bla bla bla bla".split(), "mjaw how how how how mjav mjaw".split()]
    hyps = ["bla mjav bla bla bla".split(), "mjaw how how mjav mjaw".split()]
    assert BLEUSentenceScoreMetric(refs, hyps).get_metric() == pytest.approx(0.281834861892037)
    assert BLEUCorpusScoreMetric(refs, hyps).get_metric() == pytest.approx(0.5240330551337333)
    bleu = BLEUSentenceScoreMetric(["Today the sun does not shine".split()], ["Today the sun does shine".split()])
    assert bleu.get_metric() == pytest.approx(0.5789300674674098)
    assert BLEUCorpusScoreMetric(["bla bla bla bla".split()], ["bla bla bla bla".split()]).get_metric() == 1.


def test_no_matching_ngram_of_an_order_scores_zero_without_warnings():
    # No 2-gram of the hypothesis is in the reference: unsmoothed BLEU is 0 (nltk: practically 0).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bleu = BLEUSentenceScoreMetric(["Today the sun does not shine".split()], ["Today it is cloudy".split()])
    assert bleu.get_metric() == pytest.approx(0., abs=1e-12)


@pytest.mark.parametrize("metric", [BLEUSentenceScoreMetric, BLEUCorpusScoreMetric, BLEUScoreStrTorchNLPMetric])
def test_misaligned_inputs_and_missing_sources(metric):
    with pytest.raises(ValueError, match="lengths are 2, 1"):
        metric([REF, REF], [HYP])
    with pytest.raises(ValueError, match="empty"):
        metric([], [])
    with pytest.raises(ValueError, match="pass source_sents"):
        metric([REF], [HYP], output_text_dir="out")


def test_translations_written_with_their_scores(tmp_path):
    out = tmp_path / "transl"
    bleu = BLEUSentenceScoreMetric([REF], [HYP], source_sents=["le chat"], output_text_dir=str(out))
    assert (out / "transl_0.txt").read_text(encoding="utf-8") == (
        f"Source:\tle chat\nPredicted:\t{' '.join(HYP)}\nTrue:\t{' '.join(REF)}\nBLEU: {bleu.get_metric()}\n")
    BLEUCorpusScoreMetric([REF], [HYP], source_sents=[["le", "chat"]], output_text_dir=str(out))
    assert (out / "transl_0.txt").read_text(encoding="utf-8").endswith("BLEU: na\n")
    with pytest.raises(ValueError, match="lengths are 1, 1, 2"):
        BLEUSentenceScoreMetric([REF], [HYP], source_sents=["a", "b"], output_text_dir=str(out))


# --- BLEUScoreStrTorchNLPMetric: sacrebleu on detokenized text -------------------------------------------------
def test_string_bleu_is_the_mean_of_sacrebleu_sentence_scores():
    bleu = BLEUScoreStrTorchNLPMetric(REFS, HYPS)
    scorer = sacrebleu.metrics.BLEU(tokenize="13a", smooth_method="none")
    expected = [scorer.corpus_score([" ".join(h)], [[" ".join(r)]]).score for r, h in zip(REFS, HYPS)]
    assert bleu.get_metric() == pytest.approx(sum(expected) / 3)
    assert BLEUScoreStrTorchNLPMetric([REF], [HYP]).get_metric() == pytest.approx(100 * BLEU_BY_HAND)
    assert bleu.get_metric_dict() == {"BLEU_str_torchNLP_score": bleu.get_metric()}


def test_string_bleu_tokenizes_like_moses_and_can_ignore_case():
    # 13a splits punctuation off, so 'world!' and 'world !' are the same text.
    same_text = BLEUScoreStrTorchNLPMetric([["Hello", "big", "world", "!"]], [["Hello", "big", "world!"]])
    assert same_text.get_metric() == pytest.approx(100.)
    # Case counts unless lowercase=True: only 2 of 4 unigrams match and no 3-gram, so unsmoothed BLEU is 0.
    assert BLEUScoreStrTorchNLPMetric(["hello big world ."], ["HELLO BIG world ."]).get_metric() == 0.
    lowercase = BLEUScoreStrTorchNLPMetric(["hello big world ."], ["HELLO BIG world ."], lowercase=True)
    assert lowercase.get_metric() == pytest.approx(100.)


# --- PerplexityMetric -------------------------------------------------------------------------------------------
def test_perplexity_is_exp_of_the_mean_token_cross_entropy():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5, 11, generator=generator, dtype=torch.float64)  # 4 batches of 5 tokens, 11 words
    targets = torch.randint(0, 11, (4, 5), generator=generator)
    batch_losses = [F.cross_entropy(logits[b], targets[b]) for b in range(4)]
    nll = -torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).mean()
    expected = float(torch.exp(F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))))
    assert float(torch.exp(nll)) == pytest.approx(expected)
    assert PerplexityMetric(batch_losses).get_metric() == pytest.approx(expected, rel=1e-12)
    assert PerplexityMetric(torch.stack(batch_losses)).get_metric() == pytest.approx(expected, rel=1e-12)
    whole = PerplexityMetric(float(F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))))
    assert whole.get_metric() == pytest.approx(expected, rel=1e-12)
    assert whole.get_metric_dict() == {"Perplexity": whole.get_metric()}
    assert type(whole.get_metric()) is float


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size():
    loss = F.cross_entropy(torch.zeros(3, 50), torch.tensor([0, 7, 49]))
    assert PerplexityMetric([loss]).get_metric() == pytest.approx(50.)


def test_perplexity_edge_cases():
    assert PerplexityMetric([1e6]).get_metric() == math.inf
    assert math.isnan(PerplexityMetric([float("nan")]).get_metric())
    with pytest.raises(ValueError, match="no losses"):
        PerplexityMetric([])
    with pytest.raises(ValueError, match="dict of losses"):
        PerplexityMetric({"loss_a": 1., "loss_b": 2.})
    with pytest.raises(ValueError, match="numeric losses"):
        PerplexityMetric(["high"])
