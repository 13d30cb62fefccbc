"""Single evaluation metrics: each object computes one named score from ground truth and predictions.

A metric computes its result once, in the constructor; result packages (:mod:`aitoolbox.experiment.result_package`)
combine several of them into one results dict.
"""
