"""aitoolbox 1.x's NLP helpers (vocabulary, NLP metrics and result packages): not supported yet.

Importing any ``aitoolbox.nlp`` module raises an ImportError that says so, rather than a bare "no module named".
"""
raise ImportError("aitoolbox.nlp (aitoolbox 1.x's vocabulary, NLP metrics and result packages) is not supported yet. "
                  "Compute NLP metrics with a maintained library such as Hugging Face evaluate, e.g. through "
                  "aitoolbox.experiment.result_package.hf_evaluate_packages.HFEvaluateResultPackage.")
