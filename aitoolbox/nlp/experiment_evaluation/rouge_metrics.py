"""ROUGE scores of predicted texts against references, computed with Google's ``rouge-score`` package.

``rouge-score`` re-implements the official ROUGE-1.5.5 Perl script in Python (same tokenisation: lowercased,
every character other than a-z and 0-9 a separator; optional Porter stemming) and is maintained; it replaces
both of aitoolbox 1.x's back ends, the ``rouge`` package (:class:`ROUGEMetric`) and the Perl script through
``pyrouge`` (:class:`ROUGEPerlMetric`), neither of which is maintained and the latter of which needs Perl and a
local ROUGE installation.
"""
import os
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from aitoolbox.experiment.core_metrics.abstract_metric import AbstractBaseMetric
from aitoolbox.nlp._optional import import_optional
from aitoolbox.nlp.experiment_evaluation import text_dump
from aitoolbox.nlp.experiment_evaluation.qa_metrics import check_answer_counts

DEFAULT_CLEANING_REGEX = (r"<.*?>", r"[^a-zA-Z0-9.?! ]+")

# ROUGEMetric's result keys (aitoolbox 1.x's, from the ``rouge`` package) -> rouge-score's names.
ROUGE_TYPES = {"rouge-1": "rouge1", "rouge-2": "rouge2", "rouge-l": "rougeL"}
# ROUGEPerlMetric's result names (pyrouge's) -> rouge-score's names.
PERL_ROUGE_TYPES = {"rouge_1": "rouge1", "rouge_2": "rouge2", "rouge_3": "rouge3", "rouge_4": "rouge4",
                    "rouge_l": "rougeL"}
_PERL_MEASURES = (("recall", "recall"), ("precision", "precision"), ("f_score", "fmeasure"))
BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_SEED = 0


def score_texts(references: Sequence[Any], predictions: Sequence[str], rouge_types: Sequence[str],
                use_stemmer: bool = False, tokenizer: Any = None, needed_for: str = "ROUGE") -> List[Dict[str, Any]]:
    """rouge-score's scores of each prediction: ``[{rouge type: Score(precision, recall, fmeasure)}, ...]``.

    Args:
        references: per example a reference text, or a list of alternative reference texts (the best one by
            F-measure counts, per ROUGE type).
        predictions: per example the predicted text.
        rouge_types: rouge-score's type names (``'rouge1'``, ``'rougeL'``...).
        use_stemmer: Porter-stem the tokens (nltk's stemmer, which needs no downloaded data).
        tokenizer: an object with ``tokenize(text) -> list of tokens`` replacing rouge-score's tokenizer (which
            keeps only a-z and 0-9: give one for text in other scripts).
        needed_for: names the metric in the ImportError when rouge-score is missing.
    """
    rouge_scorer = import_optional("rouge_score.rouge_scorer", needed_for)
    scorer = rouge_scorer.RougeScorer(list(rouge_types), use_stemmer=use_stemmer, tokenizer=tokenizer)
    scores = []
    for reference, prediction in zip(references, predictions):
        if isinstance(reference, str):
            scores.append(scorer.score(reference, prediction))
        else:
            scores.append(scorer.score_multi(list(reference), prediction))
    return scores


class ROUGEMetric(AbstractBaseMetric):
    """ROUGE-1, ROUGE-2 and ROUGE-L (precision, recall, F-measure), averaged over the examples (``'ROGUE'``).

    The result has aitoolbox 1.x's shape and names (including the metric name's spelling):
    ``{'rouge-1': {'f': ..., 'p': ..., 'r': ...}, 'rouge-2': {...}, 'rouge-l': {...}}``, values in 0-1.
    ROUGE-L is the longest common subsequence of each whole text.

    Args:
        y_true: the references as token lists, or with ``target_actual_text`` as strings (or lists of
            alternative reference strings).
        y_predicted: the predictions as token lists (a string is taken as the text).
        target_actual_text: ``y_true`` holds texts rather than tokens.
        output_text_dir: also write each predicted and true text to ``answer_pred_true_<i>.txt`` in this folder.
        output_text_cleaning_regex: patterns removed from the predicted tokens in those files (not from the
            scored texts).
        use_stemmer: Porter-stem tokens before matching (new; aitoolbox 1.x did not stem).
        tokenizer: replaces rouge-score's tokenizer (``tokenize(text) -> tokens``); new.

    Raises:
        ValueError: ``y_true`` and ``y_predicted`` differ in length or are empty.
        ImportError: rouge-score is not installed (``pip install aitoolbox[nlp]``).
    """

    def __init__(self, y_true: Sequence[Any], y_predicted: Sequence[Any], target_actual_text: bool = False,
                 output_text_dir: Optional[str] = None,
                 output_text_cleaning_regex: Sequence[str] = DEFAULT_CLEANING_REGEX, *,
                 use_stemmer: bool = False, tokenizer: Any = None):
        check_answer_counts(y_true, y_predicted)
        self.output_text_cleaning_regex = output_text_cleaning_regex
        self.target_actual_text = target_actual_text
        self.output_text_dir = output_text_dir
        self.use_stemmer = use_stemmer
        self.tokenizer = tokenizer
        super().__init__(y_true, y_predicted, metric_name="ROGUE", np_array=False)

    def calculate_metric(self) -> Dict[str, Dict[str, float]]:
        import_optional("rouge_score.rouge_scorer", "ROUGEMetric")  # before writing any file
        if self.output_text_dir is not None:
            self.dump_answer_text_to_disk(self.y_true, self.y_predicted, self.output_text_dir,
                                          self.output_text_cleaning_regex, self.target_actual_text)
        self.prepare_text()
        scores = score_texts(self.y_true, self.y_predicted, list(ROUGE_TYPES.values()), self.use_stemmer,
                             self.tokenizer, needed_for="ROUGEMetric")
        return {name: {"f": _mean(scores, rouge_type, "fmeasure"), "p": _mean(scores, rouge_type, "precision"),
                       "r": _mean(scores, rouge_type, "recall")}
                for name, rouge_type in ROUGE_TYPES.items()}

    def prepare_text(self) -> None:
        """Join token lists into texts (references only when they are tokens, not ``target_actual_text``)."""
        if not self.target_actual_text:
            self.y_true = [text_dump.as_text(sentence) for sentence in self.y_true]
        self.y_predicted = [text_dump.as_text(sentence) for sentence in self.y_predicted]

    @staticmethod
    def dump_answer_text_to_disk(true_text: Sequence[Any], pred_text: Sequence[Any], output_text_dir: str,
                                 output_text_cleaning_regex: Sequence[str], target_actual_text: bool) -> None:
        """Write ``answer_pred_true_<i>.txt`` per example into ``output_text_dir`` (created where missing).

        Args:
            true_text: the references (token lists, or texts with ``target_actual_text``).
            pred_text: the predictions as token lists.
            output_text_dir: the folder.
            output_text_cleaning_regex: patterns removed from the tokens before writing (references given as
                texts are written as they are).
            target_actual_text: the references are texts.
        """
        predictions = [text_dump.as_text(ROUGEPerlMetric.regex_clean_text(answer, output_text_cleaning_regex))
                       for answer in pred_text]
        references = [_reference_text(answer) if target_actual_text
                      else text_dump.as_text(ROUGEPerlMetric.regex_clean_text(answer, output_text_cleaning_regex))
                      for answer in true_text]
        text_dump.write_answer_texts(references, predictions, output_text_dir)


class ROUGEPerlMetric(AbstractBaseMetric):
    """ROUGE-1 to ROUGE-4 and ROUGE-L with 95 % confidence intervals, as the ROUGE-1.5.5 Perl script reports them.

    Computed with rouge-score on the cleaned texts (aitoolbox 1.x ran the Perl script through pyrouge). The
    result uses pyrouge's names: ``rouge_1_recall``, ``rouge_1_recall_cb`` and ``rouge_1_recall_ce`` (the
    interval's bounds), the same for ``precision`` and ``f_score``, and for ``rouge_2``, ``rouge_3``,
    ``rouge_4`` and ``rouge_l``; values in 0-1. Each value is the mean over the examples; the interval is the
    2.5th to 97.5th percentile of 1000 bootstrap resamples of that mean (seeded, so results repeat). The
    Perl script's ROUGE-W, ROUGE-S* and ROUGE-SU* are not computed.

    The cleaned texts are also written to ``output_text_dir`` as before: ``true_answer/true_answer_text.<i>.txt``
    and ``pred_answer/pred_answer_text.<i>.txt``.

    Args:
        y_true: the references as token lists (the "model" summaries), or with ``target_actual_text`` strings.
        y_predicted: the predictions as token lists (the "system" summaries).
        output_text_dir: the folder for the text files.
        output_text_cleaning_regex: patterns removed from every token (tokens left empty are dropped) before
            scoring; references given as texts are not cleaned.
        target_actual_text: ``y_true`` holds texts rather than tokens.
        use_stemmer: Porter-stem tokens before matching (ROUGE-1.5.5's ``-m``); new.

    Raises:
        ValueError: ``y_true`` and ``y_predicted`` differ in length or are empty.
        ImportError: rouge-score is not installed (``pip install aitoolbox[nlp]``).
    """

    def __init__(self, y_true: Sequence[Any], y_predicted: Sequence[Any], output_text_dir: str,
                 output_text_cleaning_regex: Sequence[str] = DEFAULT_CLEANING_REGEX,
                 target_actual_text: bool = False, *, use_stemmer: bool = False):
        check_answer_counts(y_true, y_predicted)
        if output_text_dir is None:
            raise ValueError("ROUGEPerlMetric needs output_text_dir, the folder for the text files it writes")
        self.output_text_dir = output_text_dir
        self.output_text_cleaning_regex = output_text_cleaning_regex
        self.target_actual_text = target_actual_text
        self.use_stemmer = use_stemmer
        super().__init__(y_true, y_predicted, metric_name="ROGUE_Perl", np_array=False)

    def calculate_metric(self) -> Dict[str, float]:
        import_optional("rouge_score.rouge_scorer", "ROUGEPerlMetric")  # before writing any file
        references, predictions = self.dump_answer_text_to_disk(
            self.y_true, self.y_predicted, self.output_text_dir, self.output_text_cleaning_regex,
            self.target_actual_text)
        scores = score_texts(references, predictions, list(PERL_ROUGE_TYPES.values()), self.use_stemmer,
                             needed_for="ROUGEPerlMetric")
        columns = [(f"{name}_{measure}", rouge_type, field)
                   for name, rouge_type in PERL_ROUGE_TYPES.items() for measure, field in _PERL_MEASURES]
        table = np.array([[float(getattr(example[rouge_type], field)) for _, rouge_type, field in columns]
                          for example in scores])
        low, high = _bootstrap_interval(table)
        results = {}
        for position, (name, _, _) in enumerate(columns):
            results[name] = float(table[:, position].mean())
            results[f"{name}_cb"] = float(low[position])
            results[f"{name}_ce"] = float(high[position])
        return results

    @staticmethod
    def dump_answer_text_to_disk(true_text: Sequence[Any], pred_text: Sequence[Any], output_text_dir: str,
                                 output_text_cleaning_regex: Sequence[str],
                                 target_actual_text: bool) -> Tuple[List[str], List[str]]:
        """Write the cleaned references and predictions, one file each, under ``output_text_dir``.

        References go to ``true_answer/true_answer_text.<i>.txt`` and predictions to
        ``pred_answer/pred_answer_text.<i>.txt``; those two folders are emptied first.

        Returns:
            ``(references, predictions)``: the texts to score (new: aitoolbox 1.x returned None).
        """
        true_dir = text_dump.reset_subfolder(output_text_dir, "true_answer")
        pred_dir = text_dump.reset_subfolder(output_text_dir, "pred_answer")
        # References given as texts are scored as given (several alternatives: the best one counts).
        references = [text if target_actual_text
                      else " ".join(ROUGEPerlMetric.regex_clean_text(text, output_text_cleaning_regex))
                      for text in true_text]
        # An empty prediction is written as a space: ROUGE-1.5.5 rejected empty files.
        predictions = [" ".join(ROUGEPerlMetric.regex_clean_text(text, output_text_cleaning_regex)) or " "
                       for text in pred_text]
        if text_dump.is_main_process():
            for position, text in enumerate(references):
                _write(os.path.join(true_dir, f"true_answer_text.{position}.txt"), _reference_text(text))
            for position, text in enumerate(predictions):
                _write(os.path.join(pred_dir, f"pred_answer_text.{position}.txt"), text)
        return references, predictions

    @staticmethod
    def regex_clean_text(text: Sequence[str], cleaning_regex_list: Sequence[str]) -> List[str]:
        """Remove every pattern from every token, in order, dropping the tokens that end up empty.

        Args:
            text: the tokens (a string is split on whitespace first).
            cleaning_regex_list: regular expressions to remove, e.g. ``(r'<.*?>', r'[^a-zA-Z0-9.?! ]+')``
                (markup, then anything but letters, digits, spaces and ``. ? !``).

        Returns:
            The cleaned, non-empty tokens.
        """
        tokens = text.split() if isinstance(text, str) else [str(token) for token in text]
        for pattern in cleaning_regex_list:
            compiled = re.compile(pattern)
            tokens = [cleaned for cleaned in (compiled.sub("", token) for token in tokens) if cleaned]
        return tokens


def _reference_text(reference: Any) -> str:
    """A reference given as text; several alternatives are joined with ``' | '`` for reading."""
    return reference if isinstance(reference, str) else " | ".join(str(text) for text in reference)


def _mean(scores: List[Dict[str, Any]], rouge_type: str, field: str) -> float:
    return float(np.mean([getattr(example[rouge_type], field) for example in scores]))


def _bootstrap_interval(table: np.ndarray, confidence: float = 0.95) -> Tuple[np.ndarray, np.ndarray]:
    """Percentile bootstrap interval of the column means of ``table`` (examples x measures)."""
    generator = np.random.default_rng(BOOTSTRAP_SEED)
    num_examples = table.shape[0]
    means = np.empty((BOOTSTRAP_RESAMPLES, table.shape[1]))
    for resample in range(BOOTSTRAP_RESAMPLES):
        means[resample] = table[generator.integers(0, num_examples, num_examples)].mean(axis=0)
    tail = (1. - confidence) / 2. * 100.
    return np.percentile(means, tail, axis=0), np.percentile(means, 100. - tail, axis=0)


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as file:
        file.write(text)
