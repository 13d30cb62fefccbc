"""Result packages for NLP tasks: question answering, summarisation, machine translation, GLUE and XNLI.

Each package turns a model's predictions into named NLP metrics (:mod:`.NLP_metrics`) and plugs into the
evaluation callbacks (``ModelPerformanceEvaluation``), the end-of-training saving and
``PyTorchModelPredictor`` like any other result package. Packages that write text files or plots put them,
once the experiment folder is known, inside the experiment's run folder, and list the zipped folder among the
results' extra files.
"""
import os
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from aitoolbox.experiment.core_metrics.classification import AccuracyMetric
from aitoolbox.experiment.local_save.local_results_save import BaseLocalResultsSaver
from aitoolbox.experiment.result_package.abstract_result_packages import AbstractResultPackage
from aitoolbox.nlp.core.vocabulary import Vocabulary
from aitoolbox.nlp.experiment_evaluation import text_dump
from aitoolbox.nlp.experiment_evaluation.attention_heatmap import AttentionHeatMap
from aitoolbox.nlp.experiment_evaluation.glue_metrics import check_glue_task
from aitoolbox.nlp.experiment_evaluation.NLP_metrics import (
    BLEUCorpusScoreMetric,
    BLEUSentenceScoreMetric,
    ExactMatchTextMetric,
    F1TextMetric,
    GLUEMetric,
    PerplexityMetric,
    ROUGEMetric,
    ROUGEPerlMetric,
    XNLIMetric,
)
from aitoolbox.utils import dict_util


def _rows(data: Any) -> List[Any]:
    """The examples of ``data`` as plain Python values (a tensor's or array's rows become lists)."""
    if hasattr(data, "detach"):
        data = data.detach().cpu()
    return data.tolist() if hasattr(data, "tolist") else list(data)


def _in_experiment_dir(path: Optional[str], project_name: str, experiment_name: str, experiment_timestamp: str,
                       local_model_result_folder_path: str) -> Optional[str]:
    """``path`` inside the run folder (an absolute path stays as it is)."""
    if path is None:
        return None
    _, experiment_dir_path, _ = BaseLocalResultsSaver.get_experiment_local_results_folder_paths(
        project_name, experiment_name, experiment_timestamp, local_model_result_folder_path)
    return os.path.join(experiment_dir_path, path)


def _zipped_dump(package: AbstractResultPackage, folder: Optional[str]) -> List[List[str]]:
    """``[[zip name, zip path]]`` of ``folder`` zipped, or nothing when the folder was not written (or in a process
    other than the main one, which writes it)."""
    if folder is None or not os.path.isdir(folder) or not text_dump.is_main_process():
        return []
    zip_path = package.zip_additional_results_dump(folder, folder)
    return [[os.path.basename(zip_path), zip_path]]


class QuestionAnswerResultPackage(AbstractResultPackage):
    """Extractive question answering: ROUGE, exact match (``'EM'``) and F1 of the answer texts.

    ``y_predicted`` holds the predicted answer spans, shape ``(N, 2)``: the indices of the first and the last
    answer token in the example's paragraph (both inclusive). ``y_true`` holds the true spans in the same
    way, unless ``target_actual_text`` gives the true answers as texts (``y_true`` is then not read). The
    results are ``{'ROGUE': {...}, 'EM': ..., 'F1': ...}`` (ROUGE nested as :class:`ROUGEMetric` returns
    it; ``'ROGUE_Perl'`` with ``use_perl_rouge``), or flat (``'ROGUE_rouge-1_f'``...) with
    ``flatten_result_dict``.

    Args:
        paragraph_text_tokens: per example the paragraph's tokens, which the spans index.
        target_actual_text: per example the true answer text (or a list of alternative answer texts, the best
            one counting); None to take the true answers from the spans in ``y_true``.
        output_text_dir: write every predicted and true answer to files in this folder; relative to the
            experiment's run folder when the package is used with an experiment-tracking TrainLoop.
        use_perl_rouge: report ROUGE as :class:`ROUGEPerlMetric` does (pyrouge's names, confidence intervals);
            needs ``output_text_dir``.
        flatten_result_dict: flatten the nested ROUGE results into the results dict.
        strict_content_check: raise instead of warning on a result problem.
        **kwargs: additional metadata of the package.

    Raises:
        ValueError: ``use_perl_rouge`` without ``output_text_dir``, or ``target_actual_text`` not aligned with
            the paragraphs.
    """

    def __init__(self, paragraph_text_tokens: Sequence[Sequence[Any]],
                 target_actual_text: Optional[Sequence[Any]] = None, output_text_dir: Optional[str] = None,
                 use_perl_rouge: bool = False, flatten_result_dict: bool = False, strict_content_check: bool = False,
                 **kwargs):
        if use_perl_rouge and output_text_dir is None:
            raise ValueError("use_perl_rouge=True needs output_text_dir, the folder for the texts it writes")
        if target_actual_text is not None and len(paragraph_text_tokens) != len(target_actual_text):
            raise ValueError(f"target_actual_text has {len(target_actual_text)} answers but paragraph_text_tokens "
                             f"has {len(paragraph_text_tokens)} paragraphs; give one answer per paragraph")
        super().__init__(pkg_name="QuestionAnswerResult", strict_content_check=strict_content_check, **kwargs)
        self.paragraph_text_tokens = [[str(token) for token in paragraph] for paragraph in paragraph_text_tokens]
        self.target_actual_text = target_actual_text
        self.use_target_actual_text = target_actual_text is not None
        self.output_text_dir = os.path.expanduser(output_text_dir) if output_text_dir else None
        self.use_perl_rouge = use_perl_rouge
        self.flatten_result_dict = flatten_result_dict

    def _span_texts(self, spans: Any, what: str) -> List[List[str]]:
        spans = np.asarray(spans)
        if spans.ndim != 2 or spans.shape[1] != 2:
            raise ValueError(f"{self.pkg_name}: {what} must hold (start, end) token spans, shape (N, 2); got shape "
                             f"{spans.shape}")
        if len(spans) != len(self.paragraph_text_tokens):
            raise ValueError(f"{self.pkg_name}: {what} has {len(spans)} spans but the package was given "
                             f"{len(self.paragraph_text_tokens)} paragraphs; give the paragraphs of the data set "
                             "that is evaluated")
        return [paragraph[int(start):int(end) + 1]
                for (start, end), paragraph in zip(spans, self.paragraph_text_tokens)]

    def prepare_results_dict(self) -> Dict[str, Any]:
        pred_text = self._span_texts(self.y_predicted, "y_predicted")
        true_text = (list(self.target_actual_text) if self.use_target_actual_text
                     else self._span_texts(self.y_true, "y_true"))
        if self.use_perl_rouge:
            rouge = ROUGEPerlMetric(true_text, pred_text, self.output_text_dir,
                                    target_actual_text=self.use_target_actual_text)
        else:
            rouge = ROUGEMetric(true_text, pred_text, target_actual_text=self.use_target_actual_text,
                                output_text_dir=self.output_text_dir)
        exact_match = ExactMatchTextMetric(true_text, pred_text, target_actual_text=self.use_target_actual_text)
        f1 = F1TextMetric(true_text, pred_text, target_actual_text=self.use_target_actual_text)
        results = {**rouge.get_metric_dict(), **exact_match.get_metric_dict(), **f1.get_metric_dict()}
        return dict_util.flatten_dict(results) if self.flatten_result_dict else results

    def set_experiment_dir_path_for_additional_results(self, project_name: str, experiment_name: str,
                                                       experiment_timestamp: str,
                                                       local_model_result_folder_path: str) -> None:
        self.output_text_dir = _in_experiment_dir(self.output_text_dir, project_name, experiment_name,
                                                  experiment_timestamp, local_model_result_folder_path)

    def list_additional_results_dump_paths(self) -> Optional[List[List[str]]]:
        return _zipped_dump(self, self.output_text_dir) or None


class QuestionAnswerSpanClassificationResultPackage(AbstractResultPackage):
    """Extractive question answering as two classifications: accuracy of the span starts and of the span ends.

    ``y_true`` and ``y_predicted`` hold ``(start, end)`` token indices, shape ``(N, 2)``. The results are
    ``{'Accuracy_span_start': ..., 'Accuracy_span_end': ...}``.

    Args:
        strict_content_check: raise instead of warning on a result problem.
        **kwargs: additional metadata of the package.
    """

    aligned_inputs = True

    def __init__(self, strict_content_check: bool = False, **kwargs):
        super().__init__(pkg_name="QuestionAnswerSpanClassificationResult",
                         strict_content_check=strict_content_check, **kwargs)

    def prepare_results_dict(self) -> Dict[str, Any]:
        for name, spans in (("y_true", self.y_true), ("y_predicted", self.y_predicted)):
            if spans.ndim != 2 or spans.shape[1] != 2:
                raise ValueError(f"{self.pkg_name}: {name} must hold (start, end) spans, shape (N, 2); got shape "
                                 f"{spans.shape}")
        start = AccuracyMetric(self.y_true[:, 0], self.y_predicted[:, 0], positive_class_thresh=None)
        start.metric_name += "_span_start"
        end = AccuracyMetric(self.y_true[:, 1], self.y_predicted[:, 1], positive_class_thresh=None)
        end.metric_name += "_span_end"
        return start + end


class TextSummarizationResultPackage(AbstractResultPackage):
    """Summarisation: ROUGE-1, ROUGE-2 and ROUGE-L of the predicted summaries, flat (``'ROGUE_rouge-1_f'``...).

    ``y_true`` and ``y_predicted`` hold per example a text or a list of tokens. (aitoolbox 1.x declared this
    package but raised NotImplementedError.)

    Args:
        strict_content_check: raise instead of warning on a result problem.
        **kwargs: additional metadata of the package.
    """

    aligned_inputs = True

    def __init__(self, strict_content_check: bool = False, **kwargs):
        super().__init__(pkg_name="TextSummarizationResult", strict_content_check=strict_content_check,
                         np_array=False, **kwargs)

    def prepare_results_dict(self) -> Dict[str, Any]:
        rouge = ROUGEMetric(_rows(self.y_true), _rows(self.y_predicted))
        return dict_util.flatten_dict(rouge.get_metric_dict())


class MachineTranslationResultPackage(AbstractResultPackage):
    """Machine translation: corpus and mean sentence BLEU, perplexity, and optionally attention heat maps.

    ``y_true`` and ``y_predicted`` hold per sentence the target token indices of ``target_vocab`` (lists,
    or the rows of a tensor); the reserved tokens (padding, start and end marks, out-of-vocabulary) are
    dropped before scoring. Perplexity is ``exp`` of the loss, which the evaluation callbacks hand over
    (the package sets ``requires_loss``); elsewhere put it into the model's prediction metadata as ``'loss'``.
    For heat maps the metadata must also hold ``'attention_matrices'`` (per sentence target x source) and
    ``'source_sent_text'`` (per sentence the source token indices of ``source_vocab``).

    The results: ``{'BLEU_corpus_score': ..., 'BLEU_sentence_score': ..., 'Perplexity': ...}`` and, with
    ``output_attn_heatmap_dir``, ``'Attention_HeatMap'``: the list of saved plot files.

    Args:
        target_vocab: the vocabulary of the predicted language.
        source_vocab: the vocabulary of the source language; needed for heat maps.
        source_sents: the source sentences of the evaluated data set; needed for ``output_text_dir``.
        output_text_dir: write every translation with its BLEU score to files in this folder.
        output_attn_heatmap_dir: save attention heat maps in this folder.
        strict_content_check: raise instead of warning on a result problem.
        **kwargs: additional metadata of the package.

    Raises:
        ValueError: ``output_text_dir`` without ``source_sents``, or ``output_attn_heatmap_dir`` without
            ``source_vocab``.
    """

    aligned_inputs = True

    def __init__(self, target_vocab: Vocabulary, source_vocab: Optional[Vocabulary] = None,
                 source_sents: Optional[Sequence[Any]] = None, output_text_dir: Optional[str] = None,
                 output_attn_heatmap_dir: Optional[str] = None, strict_content_check: bool = False, **kwargs):
        if output_text_dir is not None and source_sents is None:
            raise ValueError("output_text_dir is given, which writes the translations to files, but source_sents "
                             "is None: pass the source sentences of the evaluated data set as source_sents")
        if output_attn_heatmap_dir is not None and source_vocab is None:
            raise ValueError("output_attn_heatmap_dir is given, which plots attention heat maps, but source_vocab "
                             "is None: pass the source language's Vocabulary to label the plots")
        super().__init__(pkg_name="MachineTranslationResult", strict_content_check=strict_content_check,
                         np_array=False, **kwargs)
        self.requires_loss = True
        self.target_vocab = target_vocab
        self.source_vocab = source_vocab
        self.source_sents = source_sents
        self.output_text_dir = output_text_dir
        self.output_attn_heatmap_dir = output_attn_heatmap_dir
        self.attention_matrices = None
        self.y_true_text: Optional[List[List[str]]] = None
        self.y_predicted_text: Optional[List[List[str]]] = None

    def _model_output(self, key: str, purpose: str) -> Any:
        metadata = (self.additional_results or {}).get("additional_results") or {}
        if key not in metadata:
            raise ValueError(f"{self.pkg_name}: {purpose} needs {key!r} in the prediction metadata (keys present: "
                             f"{sorted(metadata)}); the evaluation callbacks add the loss, the model's "
                             "get_predictions returns the rest as its third value")
        return metadata[key]

    def prepare_results_dict(self) -> Dict[str, Any]:
        self.y_true_text = [self.target_vocab.convert_idx_sent2sent(sentence, rm_default_tokens=True)
                            for sentence in _rows(self.y_true)]
        self.y_predicted_text = [self.target_vocab.convert_idx_sent2sent(sentence, rm_default_tokens=True)
                                 for sentence in _rows(self.y_predicted)]
        bleu_sentence = BLEUSentenceScoreMetric(self.y_true_text, self.y_predicted_text, self.source_sents,
                                                self.output_text_dir)
        bleu_corpus = BLEUCorpusScoreMetric(self.y_true_text, self.y_predicted_text)
        perplexity = PerplexityMetric(self._model_output("loss", "perplexity"))
        results = {**bleu_corpus.get_metric_dict(), **bleu_sentence.get_metric_dict(), **perplexity.get_metric_dict()}
        if self.output_attn_heatmap_dir is not None:
            self.attention_matrices = self._model_output("attention_matrices", "the attention heat maps")
            source_indices = self._model_output("source_sent_text", "the attention heat maps")
            source_text = [self.source_vocab.convert_idx_sent2sent(sentence, rm_default_tokens=False)
                           for sentence in _rows(source_indices)]
            heatmaps = AttentionHeatMap(self.attention_matrices, source_text, self.y_predicted_text,
                                        self.output_attn_heatmap_dir)
            results.update(heatmaps.get_metric_dict())
        return results

    def set_experiment_dir_path_for_additional_results(self, project_name: str, experiment_name: str,
                                                       experiment_timestamp: str,
                                                       local_model_result_folder_path: str) -> None:
        location = (project_name, experiment_name, experiment_timestamp, local_model_result_folder_path)
        self.output_text_dir = _in_experiment_dir(self.output_text_dir, *location)
        self.output_attn_heatmap_dir = _in_experiment_dir(self.output_attn_heatmap_dir, *location)

    def list_additional_results_dump_paths(self) -> Optional[List[List[str]]]:
        paths = _zipped_dump(self, self.output_text_dir) + _zipped_dump(self, self.output_attn_heatmap_dir)
        return paths or None


class GLUEResultPackage(AbstractResultPackage):
    """The metrics of a GLUE task, flat: e.g. ``{'GLUE_mrpc_acc': ..., 'GLUE_mrpc_f1': ..., ...}``.

    Args:
        task_name: the GLUE task (see :class:`GLUEMetric`).
        strict_content_check: raise instead of warning on a result problem (new).
        **kwargs: additional metadata of the package (new).

    Raises:
        ValueError: an unknown task.
    """

    aligned_inputs = True

    def __init__(self, task_name: str, strict_content_check: bool = False, **kwargs):
        check_glue_task(task_name)  # now rather than at the first evaluation
        super().__init__("GLUE benchmark", strict_content_check=strict_content_check, **kwargs)
        self.task_name = task_name

    def prepare_results_dict(self) -> Dict[str, Any]:
        metric = GLUEMetric(self.y_true, self.y_predicted, self.task_name)
        return dict_util.flatten_dict(metric.get_metric_dict())


class XNLIResultPackage(AbstractResultPackage):
    """XNLI accuracy: ``{'xnli_accuracy_acc': ...}``.

    Args:
        strict_content_check: raise instead of warning on a result problem (new).
        **kwargs: additional metadata of the package (new).
    """

    aligned_inputs = True

    def __init__(self, strict_content_check: bool = False, **kwargs):
        super().__init__("XNLI benchmark", strict_content_check=strict_content_check, **kwargs)

    def prepare_results_dict(self) -> Dict[str, Any]:
        return dict_util.flatten_dict(XNLIMetric(self.y_true, self.y_predicted).get_metric_dict())
