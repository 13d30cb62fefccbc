"""A result package around a HuggingFace Evaluate metric (https://huggingface.co/docs/evaluate).

The ``evaluate`` library is imported only when a metric is given by name; a metric object is used as it is.
"""
from typing import Any, Dict, Union

from aitoolbox.experiment.result_package.abstract_result_packages import AbstractResultPackage

RESULT_SUFFIX = "_HFEvaluate"


def load_hf_evaluate_metric(name: str) -> Any:
    """Return ``evaluate.load(name)``.

    Raises:
        ImportError: the ``evaluate`` library is not installed.
    """
    try:
        import evaluate
    except ImportError as error:
        raise ImportError(f"loading the HuggingFace Evaluate metric {name!r} needs the evaluate library, which is "
                          "not installed: pip install evaluate") from error
    return evaluate.load(name)


class HFEvaluateResultPackage(AbstractResultPackage):
    """Evaluate a HuggingFace Evaluate metric as a result package.

    The metric is computed as ``metric.compute(references=y_true, predictions=y_predicted, **inputs)`` and
    every result name gets the suffix ``'_HFEvaluate'`` (``{'accuracy_HFEvaluate': 0.93}``).

    Args:
        hf_evaluate_metric: an ``evaluate.EvaluationModule``, or a metric name to load with
            ``evaluate.load`` (needs ``pip install evaluate``).
        use_models_additional_results: also pass the metadata returned with the model's predictions
            (``additional_results`` of :meth:`prepare_result_package`) as inputs of the metric.
        **kwargs: further inputs of the metric known before predicting (e.g. ``average='macro'``); also
            kept as ``package_metadata``. ``strict_content_check`` and ``np_array`` are taken as the
            package's own settings.

    Raises:
        ImportError: a metric name was given and ``evaluate`` is not installed.
        TypeError: the metric has no ``compute`` method.
    """

    def __init__(self, hf_evaluate_metric: Union[str, Any], use_models_additional_results: bool = True, **kwargs):
        strict_content_check = kwargs.pop("strict_content_check", False)
        np_array = kwargs.pop("np_array", True)
        super().__init__(pkg_name="HuggingFace Evaluate metrics", strict_content_check=strict_content_check,
                         np_array=np_array, **kwargs)
        if isinstance(hf_evaluate_metric, str):
            hf_evaluate_metric = load_hf_evaluate_metric(hf_evaluate_metric)
        if not callable(getattr(hf_evaluate_metric, "compute", None)):
            raise TypeError("hf_evaluate_metric must be a HuggingFace Evaluate metric (evaluate.load('accuracy')) or "
                            f"its name, got {type(hf_evaluate_metric).__name__}")
        self.metric = hf_evaluate_metric
        self.use_models_additional_results = use_models_additional_results

    def prepare_results_dict(self) -> Dict[str, Any]:
        metric_inputs = dict(self.package_metadata)
        if self.use_models_additional_results:
            model_results = (self.additional_results or {}).get("additional_results") or {}
            metric_inputs.update(model_results)
        metric_result = self.metric.compute(references=self.y_true, predictions=self.y_predicted, **metric_inputs)
        if metric_result is None:
            # evaluate computes on the main process only; the other processes get None.
            return {}
        if not isinstance(metric_result, dict):
            raise TypeError(f"the HuggingFace Evaluate metric returned {type(metric_result).__name__}, expected "
                            "a dict of results")
        return {f"{name}{RESULT_SUFFIX}": value for name, value in metric_result.items()}
