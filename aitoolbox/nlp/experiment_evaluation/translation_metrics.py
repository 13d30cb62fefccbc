"""Machine translation metrics: BLEU (nltk on tokens, sacrebleu on detokenized text) and perplexity.

* :class:`BLEUSentenceScoreMetric` and :class:`BLEUCorpusScoreMetric` score token lists with nltk's
  ``sentence_bleu`` / ``corpus_bleu`` (BLEU-4, uniform weights, no smoothing, scores in 0-1), as aitoolbox
  1.x did; nltk's BLEU needs no downloaded data. An example with no matching n-gram of some order scores 0,
  and nltk's warning about it is not repeated for every sentence.
* :class:`BLEUScoreStrTorchNLPMetric` replaces 1.x's call of the Moses ``multi-bleu.perl`` script (through
  pytorch-nlp, which downloaded the script at run time) with sacrebleu, the maintained standard for
  reportable BLEU: the texts are tokenized with sacrebleu's ``13a`` tokenizer (Moses' rules) and scored
  without smoothing, on a 0-100 scale like the script.
* :class:`PerplexityMetric` is ``exp`` of the mean negative log-likelihood loss.
"""
import math
import warnings
from typing import Any, List, Optional, Sequence

import numpy as np

from aitoolbox.experiment.core_metrics.abstract_metric import AbstractBaseMetric
from aitoolbox.nlp._optional import import_optional
from aitoolbox.nlp.experiment_evaluation import text_dump

# nltk warns once per sentence that lacks an n-gram order; the score (0) says it already.
_NLTK_ZERO_COUNT_WARNING = r"\s*The hypothesis contains 0 counts of"


def _nltk_bleu(needed_for: str):
    return import_optional("nltk.translate.bleu_score", needed_for)


def _check_translation_inputs(y_true: Sequence[Any], y_predicted: Sequence[Any], source_sents: Optional[Sequence[Any]],
                              output_text_dir: Optional[str]) -> None:
    if output_text_dir is not None and source_sents is None:
        raise ValueError("output_text_dir is given but source_sents is None: writing the translations to "
                         "output_text_dir needs the source sentences, pass source_sents")
    # The sources are only written out, so they are checked only when they will be.
    lists = [y_true, y_predicted] + ([source_sents] if output_text_dir is not None else [])
    BLEUSentenceScoreMetric.check_transl_sent_num_match(lists)
    if len(y_true) == 0:
        raise ValueError("y_true and y_predicted are empty: there is nothing to score")


class BLEUSentenceScoreMetric(AbstractBaseMetric):
    """Mean of the sentence-level BLEU-4 scores (nltk ``sentence_bleu``, 0-1) (``'BLEU_sentence_score'``).

    Args:
        y_true: the reference translations as token lists (one reference per sentence).
        y_predicted: the predicted translations as token lists.
        source_sents: the source sentences, needed to write the translations to ``output_text_dir``.
        output_text_dir: also write every sentence's source, prediction, reference and score to
            ``transl_<i>.txt`` in this folder.

    Raises:
        ValueError: the lists differ in length or are empty, or ``output_text_dir`` without ``source_sents``.
        ImportError: nltk is not installed (``pip install aitoolbox[nlp]``).
    """

    def __init__(self, y_true: Sequence[Sequence[Any]], y_predicted: Sequence[Sequence[Any]],
                 source_sents: Optional[Sequence[Any]] = None, output_text_dir: Optional[str] = None):
        _check_translation_inputs(y_true, y_predicted, source_sents, output_text_dir)
        self.output_text_dir = output_text_dir
        self.source_sents = source_sents
        super().__init__(y_true, y_predicted, metric_name="BLEU_sentence_score", np_array=False)

    def calculate_metric(self) -> float:
        bleu = _nltk_bleu("BLEUSentenceScoreMetric")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NLTK_ZERO_COUNT_WARNING, category=UserWarning)
            scores = [float(bleu.sentence_bleu([list(true)], list(pred)))
                      for true, pred in zip(self.y_true, self.y_predicted)]
        if self.output_text_dir is not None:
            self.dump_translation_text_to_disk(self.source_sents, [text_dump.as_text(s) for s in self.y_predicted],
                                               [text_dump.as_text(s) for s in self.y_true], scores,
                                               self.output_text_dir)
        return float(np.mean(scores))

    @staticmethod
    def dump_translation_text_to_disk(source_sents: Sequence[Any], pred_translations: Sequence[str],
                                      true_translations: Sequence[str], sentence_bleu_results: Sequence[Any],
                                      output_text_dir: str) -> None:
        """Write ``transl_<i>.txt`` per sentence: source, predicted and true translation, and its BLEU score.

        Args:
            source_sents: the source sentences (texts or token lists).
            pred_translations: the predicted translations as texts.
            true_translations: the reference translations as texts.
            sentence_bleu_results: each sentence's score (or a placeholder such as ``'na'``).
            output_text_dir: the folder (created where missing; files of an earlier dump are replaced).

        Raises:
            ValueError: the four lists differ in length.
        """
        BLEUSentenceScoreMetric.check_transl_sent_num_match([pred_translations, true_translations, source_sents,
                                                             sentence_bleu_results])
        text_dump.write_translation_texts(source_sents, pred_translations, true_translations, sentence_bleu_results,
                                          output_text_dir)

    @staticmethod
    def check_transl_sent_num_match(sent_types: Sequence[Sequence[Any]]) -> None:
        """Raise ValueError unless every list in ``sent_types`` has the same length.

        Args:
            sent_types: the lists, e.g. ``[references, predictions, sources]``.
        """
        lengths = [len(sentences) for sentences in sent_types]
        if len(set(lengths)) > 1:
            raise ValueError(f"The numbers of sentences do not match across the text lists: their lengths are "
                             f"{', '.join(str(length) for length in lengths)}; give one per example in each")


class BLEUCorpusScoreMetric(AbstractBaseMetric):
    """Corpus-level BLEU-4 of all sentences together (nltk ``corpus_bleu``, 0-1) (``'BLEU_corpus_score'``).

    n-gram matches and lengths are summed over the corpus before the precisions and the brevity penalty are
    taken, so this is not the mean of the sentence scores.

    Args:
        y_true: the reference translations as token lists.
        y_predicted: the predicted translations as token lists.
        source_sents: the source sentences, needed to write the translations to ``output_text_dir``.
        output_text_dir: also write every sentence's source, prediction and reference to ``transl_<i>.txt``
            (the score column reads ``na``: there are no per-sentence scores).

    Raises:
        ValueError: the lists differ in length or are empty, or ``output_text_dir`` without ``source_sents``.
        ImportError: nltk is not installed (``pip install aitoolbox[nlp]``).
    """

    def __init__(self, y_true: Sequence[Sequence[Any]], y_predicted: Sequence[Sequence[Any]],
                 source_sents: Optional[Sequence[Any]] = None, output_text_dir: Optional[str] = None):
        _check_translation_inputs(y_true, y_predicted, source_sents, output_text_dir)
        self.output_text_dir = output_text_dir
        self.source_sents = source_sents
        super().__init__(y_true, y_predicted, metric_name="BLEU_corpus_score", np_array=False)

    def calculate_metric(self) -> float:
        bleu = _nltk_bleu("BLEUCorpusScoreMetric")
        if self.output_text_dir is not None:
            BLEUSentenceScoreMetric.dump_translation_text_to_disk(
                self.source_sents, [text_dump.as_text(s) for s in self.y_predicted],
                [text_dump.as_text(s) for s in self.y_true], ["na"] * len(self.y_predicted), self.output_text_dir)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NLTK_ZERO_COUNT_WARNING, category=UserWarning)
            return float(bleu.corpus_bleu([[list(true)] for true in self.y_true],
                                          [list(pred) for pred in self.y_predicted]))


class BLEUScoreStrTorchNLPMetric(AbstractBaseMetric):
    """Mean sentence BLEU on detokenized text, 0-100, computed with sacrebleu (``'BLEU_str_torchNLP_score'``).

    Every sentence is scored on its own as a one-sentence corpus (as aitoolbox 1.x scored each with the Moses
    script): tokens are joined with spaces and retokenized by sacrebleu's ``13a`` tokenizer, BLEU-4 without
    smoothing. The name is kept from aitoolbox 1.x; pytorch-nlp is no longer used.

    Args:
        y_true: the reference translations as token lists (a string is taken as the text).
        y_predicted: the predicted translations as token lists (or strings).
        lowercase: compare case-insensitively.
        source_sents: the source sentences, needed to write the translations to ``output_text_dir``.
        output_text_dir: also write every sentence with its score to ``transl_<i>.txt`` in this folder.

    Raises:
        ValueError: the lists differ in length or are empty, or ``output_text_dir`` without ``source_sents``.
        ImportError: sacrebleu is not installed (``pip install aitoolbox[nlp]``).
    """

    def __init__(self, y_true: Sequence[Any], y_predicted: Sequence[Any], lowercase: bool = False,
                 source_sents: Optional[Sequence[Any]] = None, output_text_dir: Optional[str] = None):
        _check_translation_inputs(y_true, y_predicted, source_sents, output_text_dir)
        self.output_text_dir = output_text_dir
        self.source_sents = source_sents
        self.lowercase = lowercase
        super().__init__(y_true, y_predicted, metric_name="BLEU_str_torchNLP_score", np_array=False)

    def calculate_metric(self) -> float:
        sacrebleu_metrics = import_optional("sacrebleu.metrics", "BLEUScoreStrTorchNLPMetric")
        bleu = sacrebleu_metrics.BLEU(lowercase=self.lowercase, tokenize="13a", smooth_method="none")
        references = [text_dump.as_text(sentence) for sentence in self.y_true]
        predictions = [text_dump.as_text(sentence) for sentence in self.y_predicted]
        scores: List[float] = [float(bleu.corpus_score([pred], [[true]]).score)
                               for true, pred in zip(references, predictions)]
        if self.output_text_dir is not None:
            BLEUSentenceScoreMetric.dump_translation_text_to_disk(self.source_sents, predictions, references, scores,
                                                                  self.output_text_dir)
        return float(np.mean(scores))


class PerplexityMetric(AbstractBaseMetric):
    """Perplexity, ``exp(mean(batch_losses))``, of a language or translation model (``'Perplexity'``).

    Args:
        batch_losses: mean negative log-likelihood (cross-entropy, natural log) losses: a number (e.g. the
            evaluated loss of a data set) or a list / array / tensor of per-batch losses. The mean of per-batch
            means equals the per-token mean only when every batch holds as many tokens.

    Raises:
        ValueError: no loss, or a loss that is not a number (e.g. a dict of several losses).
    """

    def __init__(self, batch_losses: Any):
        super().__init__(None, batch_losses, metric_name="Perplexity", np_array=False)

    def calculate_metric(self) -> float:
        losses = self.y_predicted
        if isinstance(losses, dict):
            raise ValueError(f"PerplexityMetric needs one loss, got a dict of losses {sorted(losses)}: pass the "
                             "cross-entropy loss of the model's outputs")
        if hasattr(losses, "detach"):
            losses = losses.detach().cpu().double().numpy()
        try:
            values = np.asarray(losses, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError) as error:
            raise ValueError(f"PerplexityMetric needs numeric losses, got {type(losses).__name__}: {error}") from error
        if values.size == 0:
            raise ValueError("PerplexityMetric got no losses: give at least one")
        mean_loss = float(values.mean())
        if not math.isfinite(mean_loss):
            return mean_loss  # nan stays nan and inf inf: the result packages report non-finite metrics
        try:
            return math.exp(mean_loss)
        except OverflowError:
            return math.inf
