"""Question answering metrics of the SQuAD evaluation: exact match and token-overlap F1 of answer texts.

Both compare normalised answers (lowercased, punctuation and the articles a / an / the removed, whitespace
collapsed), as the official SQuAD 2.0 evaluation script does, and report percentages (0-100). Written in
plain Python: they need no optional library.
"""
import re
import string
from collections import Counter
from typing import Any, List, Optional, Sequence

from aitoolbox.experiment.core_metrics.abstract_metric import AbstractBaseMetric
from aitoolbox.nlp.experiment_evaluation import text_dump

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = frozenset(string.punctuation)


def check_answer_counts(y_true: Sequence[Any], y_predicted: Sequence[Any]) -> None:
    """Raise ValueError unless there is one prediction per reference and at least one of each."""
    if len(y_true) != len(y_predicted):
        raise ValueError(f"len(y_true) != len(y_predicted): got {len(y_true)} != {len(y_predicted)}; give one "
                         "predicted answer per reference answer")
    if len(y_true) == 0:
        raise ValueError("y_true and y_predicted are empty: there is nothing to score")


def reference_alternatives(true_answer: Any, target_actual_text: bool) -> List[str]:
    """The accepted answer texts of one question.

    With ``target_actual_text`` the reference is a string, or a list of strings when several answers are
    correct (SQuAD lists several). Otherwise it is a sequence of tokens, joined with spaces.
    """
    if isinstance(true_answer, str):
        return [true_answer]
    if target_actual_text:
        alternatives = list(true_answer)
        if not alternatives or not all(isinstance(answer, str) for answer in alternatives):
            raise ValueError("with target_actual_text=True each reference must be an answer string or a non-empty "
                             f"list of alternative answer strings, got {true_answer!r}")
        return alternatives
    return [text_dump.as_text(true_answer)]


class ExactMatchTextMetric(AbstractBaseMetric):
    """Percentage of questions whose predicted answer equals a reference after normalisation (``'EM'``).

    Args:
        y_true: the reference answers: token lists, or with ``target_actual_text`` answer strings (or lists of
            alternative answer strings, the best one counting).
        y_predicted: the predicted answers as token lists (a string is taken as the answer text).
        target_actual_text: ``y_true`` holds texts rather than tokens.
        output_text_dir: also write each predicted and true answer to ``answer_pred_true_<i>.txt`` in this
            folder, for reading.

    Raises:
        ValueError: ``y_true`` and ``y_predicted`` differ in length or are empty.
    """

    def __init__(self, y_true: Sequence[Any], y_predicted: Sequence[Any], target_actual_text: bool = False,
                 output_text_dir: Optional[str] = None):
        check_answer_counts(y_true, y_predicted)
        self.target_actual_text = target_actual_text
        self.output_text_dir = output_text_dir
        super().__init__(y_true, y_predicted, metric_name="EM", np_array=False)

    def calculate_metric(self) -> float:
        self.y_true, self.y_predicted = _answer_texts(self.y_true, self.y_predicted, self.target_actual_text,
                                                      self.output_text_dir)
        matches = sum(max(float(self.normalize_answer(pred) == self.normalize_answer(true)) for true in alternatives)
                      for pred, alternatives in zip(self.y_predicted, self.y_true))
        return 100. * matches / len(self.y_true)

    @staticmethod
    def normalize_answer(text_str: str) -> str:
        """Lowercase, remove punctuation and the articles a / an / the, and collapse whitespace (SQuAD's rule).

        Args:
            text_str: an answer.

        Returns:
            The normalised answer.
        """
        text = "".join(char for char in text_str.lower() if char not in _PUNCTUATION)
        return " ".join(_ARTICLES.sub(" ", text).split())


class F1TextMetric(AbstractBaseMetric):
    """Mean token-overlap F1 between predicted and reference answers, as a percentage (``'F1'``).

    Per question: precision = shared tokens / predicted tokens, recall = shared tokens / reference tokens
    (tokens of the normalised answers, counted with multiplicity); an empty answer scores 100 when the
    other is empty too and 0 otherwise. With several references the best one counts.

    Args:
        y_true: the reference answers: token lists, or with ``target_actual_text`` answer strings (or lists of
            alternative answer strings).
        y_predicted: the predicted answers as token lists (a string is taken as the answer text).
        target_actual_text: ``y_true`` holds texts rather than tokens.
        output_text_dir: also write each predicted and true answer to ``answer_pred_true_<i>.txt`` in this
            folder, for reading.

    Raises:
        ValueError: ``y_true`` and ``y_predicted`` differ in length or are empty.
    """

    def __init__(self, y_true: Sequence[Any], y_predicted: Sequence[Any], target_actual_text: bool = False,
                 output_text_dir: Optional[str] = None):
        check_answer_counts(y_true, y_predicted)
        self.target_actual_text = target_actual_text
        self.output_text_dir = output_text_dir
        super().__init__(y_true, y_predicted, metric_name="F1", np_array=False)

    def calculate_metric(self) -> float:
        self.y_true, self.y_predicted = _answer_texts(self.y_true, self.y_predicted, self.target_actual_text,
                                                      self.output_text_dir)
        total = sum(max(self.compute_f1(true, pred) for true in alternatives)
                    for pred, alternatives in zip(self.y_predicted, self.y_true))
        return 100. * total / len(self.y_true)

    @staticmethod
    def compute_f1(a_gold: str, a_pred: str) -> float:
        """Token-overlap F1 (0-1) of one predicted answer against one reference answer.

        Args:
            a_gold: the reference answer text.
            a_pred: the predicted answer text.
        """
        gold_tokens, pred_tokens = F1TextMetric.get_tokens(a_gold), F1TextMetric.get_tokens(a_pred)
        if not gold_tokens or not pred_tokens:
            # A "no answer" is right only when both say so.
            return float(gold_tokens == pred_tokens)
        shared = sum((Counter(gold_tokens) & Counter(pred_tokens)).values())
        if shared == 0:
            return 0.
        precision, recall = shared / len(pred_tokens), shared / len(gold_tokens)
        return 2 * precision * recall / (precision + recall)

    @staticmethod
    def get_tokens(s: str) -> List[str]:
        """The tokens of the normalised answer ``s`` (none for an empty answer)."""
        if not s:
            return []
        return ExactMatchTextMetric.normalize_answer(s).split()


def _answer_texts(y_true: Sequence[Any], y_predicted: Sequence[Any], target_actual_text: bool,
                  output_text_dir: Optional[str]):
    """The reference alternatives and the predicted texts; written to ``output_text_dir`` when given."""
    references = [reference_alternatives(answer, target_actual_text) for answer in y_true]
    predictions = [text_dump.as_text(answer) for answer in y_predicted]
    if output_text_dir is not None:
        text_dump.write_answer_texts([" | ".join(alternatives) for alternatives in references], predictions,
                                     output_text_dir)
    return references, predictions
