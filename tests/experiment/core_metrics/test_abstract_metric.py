"""AbstractBaseMetric: computed on construction, compared, looked up and combined."""
import numpy as np
import pytest

from aitoolbox.experiment.core_metrics.abstract_metric import AbstractBaseMetric


class _Mean(AbstractBaseMetric):
    def __init__(self, y_true, y_pred, name="mean_diff"):
        super().__init__(y_true, y_pred, metric_name=name)

    def calculate_metric(self):
        return float(np.mean(self.y_true - self.y_predicted))


class _Fixed(AbstractBaseMetric):
    def __init__(self, result, name="fixed"):
        self._fixed = result
        super().__init__([], [], metric_name=name, np_array=False)

    def calculate_metric(self):
        return self._fixed


def test_result_is_computed_on_construction_from_numpy_inputs():
    metric = _Mean([3, 4], [1, 1])
    assert isinstance(metric.y_true, np.ndarray)
    assert metric.get_metric() == 2.5 and metric.get_metric_dict() == {"mean_diff": 2.5}
    assert str(metric) == "mean_diff: 2.5" and len(metric) == 1


def test_abstract_class_cannot_be_built():
    with pytest.raises(TypeError):
        AbstractBaseMetric([1], [1], "x")


def test_scalar_metrics_compare_with_metrics_and_numbers():
    low, high = _Fixed(1), _Fixed(np.float64(2.5))
    assert low < high and low <= 1 and high > 2 and 3 >= high and not low > high
    with pytest.raises(ValueError, match="int or float"):
        _Fixed({"a": 1}) < 3
    with pytest.raises(ValueError, match="int or float"):
        low < _Fixed([1, 2])


def test_len_contains_and_getitem_follow_the_result():
    grouped = _Fixed({"cat": 0.5, "dog": 0.7}, name="f1")
    assert len(grouped) == 2 and len(_Fixed(None)) == 0
    assert "f1" in grouped and "cat" in grouped and "cow" not in grouped
    assert grouped["f1"] == {"cat": 0.5, "dog": 0.7} and grouped["dog"] == 0.7
    with pytest.raises(KeyError):
        grouped["cow"]
    with pytest.raises(TypeError):
        len(_Fixed("text"))


def test_adding_metrics_merges_their_dicts():
    acc, f1 = _Fixed(0.9, "acc"), _Fixed(0.8, "f1")
    assert acc + f1 == {"acc": 0.9, "f1": 0.8}
    assert acc + {"roc": 0.7} == {"acc": 0.9, "roc": 0.7}
    assert {"roc": 0.7} + acc == {"acc": 0.9, "roc": 0.7}
    with pytest.raises(TypeError, match="list"):
        acc + [1]
