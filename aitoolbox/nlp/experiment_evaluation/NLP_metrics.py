"""All NLP metrics of aitoolbox 1.x, at their 1.x import path.

The metrics live in one module per task and are re-exported here:

* question answering (:mod:`.qa_metrics`): :class:`ExactMatchTextMetric`, :class:`F1TextMetric`;
* summarisation (:mod:`.rouge_metrics`): :class:`ROUGEMetric`, :class:`ROUGEPerlMetric` (rouge-score);
* translation (:mod:`.translation_metrics`): :class:`BLEUSentenceScoreMetric`, :class:`BLEUCorpusScoreMetric`
  (nltk), :class:`BLEUScoreStrTorchNLPMetric` (sacrebleu), :class:`PerplexityMetric`;
* benchmarks (:mod:`.glue_metrics`): :class:`GLUEMetric`, :class:`XNLIMetric` (scikit-learn, SciPy).

Importing this module imports none of the optional libraries; a metric that needs one imports it when it is
computed and, when it is missing, raises an ImportError naming ``pip install aitoolbox[nlp]``.
"""
from aitoolbox.nlp.experiment_evaluation.glue_metrics import GLUEMetric, XNLIMetric
from aitoolbox.nlp.experiment_evaluation.qa_metrics import ExactMatchTextMetric, F1TextMetric
from aitoolbox.nlp.experiment_evaluation.rouge_metrics import ROUGEMetric, ROUGEPerlMetric
from aitoolbox.nlp.experiment_evaluation.translation_metrics import (
    BLEUCorpusScoreMetric,
    BLEUScoreStrTorchNLPMetric,
    BLEUSentenceScoreMetric,
    PerplexityMetric,
)

__all__ = [
    "ROUGEMetric", "ROUGEPerlMetric", "ExactMatchTextMetric", "F1TextMetric", "BLEUSentenceScoreMetric",
    "BLEUCorpusScoreMetric", "BLEUScoreStrTorchNLPMetric", "PerplexityMetric", "GLUEMetric", "XNLIMetric",
]
