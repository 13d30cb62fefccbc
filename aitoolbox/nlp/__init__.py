"""NLP helpers of aitoolbox 1.x: vocabulary and text utilities, NLP metrics and NLP result packages.

* :mod:`aitoolbox.nlp.core` -- text normalisation (:mod:`~aitoolbox.nlp.core.core`) and the
  :class:`~aitoolbox.nlp.core.vocabulary.Vocabulary` of token indices;
* :mod:`aitoolbox.nlp.experiment_evaluation` -- metrics (exact match and F1 for question answering, ROUGE,
  BLEU, perplexity, GLUE), attention heat maps and the result packages built on them;
* :mod:`aitoolbox.nlp.torch_collate_fns` -- a padding collate function for question answering batches.

Importing these modules needs nothing beyond aitoolbox itself; the metric libraries (rouge-score, sacrebleu,
nltk) and matplotlib are imported when a metric that needs them is computed: ``pip install aitoolbox[nlp]``.
"""
