"""PyTorchModelPredictor: predictions, loss, result packages, metrics and saved results of a trained model."""
import json
import logging

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.experiment.result_package.abstract_result_packages import AbstractResultPackage
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.model import ModelWrap
from aitoolbox.torchtrain.model_predict import PyTorchModelPredictor
from tests.helpers import MLP, ClassifierFeedDefinition, PlainMLP, classification_data, indexed_classification_data


def eval_model(model_class=MLP):
    torch.manual_seed(0)
    return model_class().eval()


def loader(num_samples=10, batch_size=4, dataset=classification_data):
    return DataLoader(dataset(num_samples), batch_size=batch_size)


class AccuracyPackage(AbstractResultPackage):
    def __init__(self):
        super().__init__(pkg_name='Accuracy')
        self.calls = 0

    def prepare_results_dict(self):
        self.calls += 1
        return {'accuracy': float((torch.as_tensor(self.y_true) == torch.as_tensor(self.y_predicted)).float().mean())}


class CountMetric:
    """Duck-typed metric class: built from (y_true, y_pred), as the predictor calls it."""

    def __init__(self, y_true, y_pred):
        self.y_true, self.y_pred = y_true, y_pred

    def get_metric_dict(self):
        return {'count': len(self.y_true)}


class MatchMetric(CountMetric):
    def get_metric_dict(self):
        return {'matches': int((self.y_true == self.y_pred).sum())}


def manual_predictions(model, data_loader):
    y_pred, y_true = [], []
    with torch.no_grad():
        for x, y in data_loader:
            y_pred.append(model(x).argmax(dim=1))
            y_true.append(y)
    return torch.cat(y_pred), torch.cat(y_true)


def test_model_predict_concatenates_all_batches():
    model, data_loader = eval_model(), loader()
    y_pred, y_true, metadata = PyTorchModelPredictor(model, data_loader).model_predict()
    expected_pred, expected_true = manual_predictions(model, data_loader)
    assert torch.equal(y_pred, expected_pred) and torch.equal(y_true, expected_true)


def test_model_predict_collects_metadata():
    data_loader = loader(dataset=indexed_classification_data)
    _, _, metadata = PyTorchModelPredictor(eval_model(), data_loader).model_predict()
    assert [int(i) for i in metadata['index']] == list(range(10))


def test_model_predict_with_a_model_wrap():
    module = eval_model(PlainMLP)
    data_loader = loader()
    y_pred, y_true, _ = PyTorchModelPredictor(ModelWrap(module, ClassifierFeedDefinition()), data_loader).model_predict()
    expected_pred, expected_true = manual_predictions(module, data_loader)
    assert torch.equal(y_pred, expected_pred) and torch.equal(y_true, expected_true)


def test_predictions_follow_later_weight_changes():
    model, data_loader = eval_model(), loader()
    predictor = PyTorchModelPredictor(model, data_loader)
    predictor.model_predict()
    with torch.no_grad():
        model.fc2.bias.copy_(torch.tensor([100.0, 0.0, 0.0]))
    y_pred, _, _ = predictor.model_predict()
    assert torch.equal(y_pred, torch.zeros(10, dtype=y_pred.dtype))


def test_model_get_loss_is_the_mean_loss_per_sample():
    model, data_loader = eval_model(), loader(num_samples=10, batch_size=4)  # batches of 4, 4 and 2
    loss = PyTorchModelPredictor(model, data_loader).model_get_loss(nn.CrossEntropyLoss())
    x, y = classification_data(10).tensors
    with torch.no_grad():
        expected = nn.CrossEntropyLoss()(model(x), y)
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)


def test_evaluate_result_package_returns_the_package_or_its_results():
    model, data_loader = eval_model(), loader()
    expected_pred, expected_true = manual_predictions(model, data_loader)
    expected_accuracy = float((expected_pred == expected_true).float().mean())

    predictor = PyTorchModelPredictor(model, data_loader)
    package = AccuracyPackage()
    assert predictor.evaluate_result_package(package) is package
    assert package.get_results() == {'accuracy': expected_accuracy} and package.calls == 1
    assert predictor.evaluate_result_package(AccuracyPackage(), return_result_package=False) == \
        {'accuracy': expected_accuracy}


def test_evaluate_result_package_passes_metadata_as_additional_results():
    package = AccuracyPackage()
    PyTorchModelPredictor(eval_model(), loader(dataset=indexed_classification_data)).evaluate_result_package(package)
    assert [int(i) for i in package.additional_results['additional_results']['index']] == list(range(10))


def test_evaluate_model_writes_a_json_results_file(tmp_path):
    model, data_loader = eval_model(), loader()
    predictor = PyTorchModelPredictor(model, data_loader)
    path = predictor.evaluate_model(AccuracyPackage(), 'proj', 'exp', str(tmp_path), save_true_pred_labels=True)

    timestamp = predictor.train_loop.experiment_timestamp
    assert path == str(tmp_path / 'proj' / f'exp_{timestamp}' / 'results' /
                       f'results_hyperParams_hist_exp_{timestamp}.json')
    with open(path) as results_file:
        saved = json.load(results_file)
    expected_pred, expected_true = manual_predictions(model, data_loader)
    accuracy = float((expected_pred == expected_true).float().mean())
    assert saved['results'] == {'accuracy': accuracy}
    assert saved['training_history'] == {'accuracy': [accuracy]}
    assert saved['experiment_name'] == 'exp'
    assert saved['y_true'] == expected_true.tolist() and saved['y_predicted'] == expected_pred.tolist()


def test_evaluate_model_without_labels_and_in_an_existing_folder(tmp_path):
    predictor = PyTorchModelPredictor(eval_model(), loader())
    first = predictor.evaluate_model(AccuracyPackage(), 'proj', 'exp', str(tmp_path))
    second = predictor.evaluate_model(AccuracyPackage(), 'proj', 'exp', str(tmp_path))
    assert first != second  # an existing run folder is never overwritten
    with open(second) as results_file:
        assert 'y_true' not in json.load(results_file)


def test_evaluate_model_rejects_an_unknown_mode(tmp_path):
    with pytest.raises(ValueError, match='dropbox'):
        PyTorchModelPredictor(eval_model(), loader()).evaluate_model(AccuracyPackage(), 'p', 'e', str(tmp_path),
                                                                     cloud_save_mode='dropbox')


def test_evaluate_metric_and_metric_list():
    model, data_loader = eval_model(), loader()
    expected_pred, expected_true = manual_predictions(model, data_loader)
    predictor = PyTorchModelPredictor(model, data_loader)

    metric = predictor.evaluate_metric(CountMetric)
    assert isinstance(metric, CountMetric) and torch.equal(metric.y_true, expected_true)
    assert predictor.evaluate_metric(CountMetric, return_metric=False) == {'count': 10}

    metrics = predictor.evaluate_metric_list([CountMetric, MatchMetric])
    assert [type(m) for m in metrics] == [CountMetric, MatchMetric]
    assert predictor.evaluate_metric_list([CountMetric, MatchMetric], return_metric_list=False) == \
        {'count': 10, 'matches': int((expected_pred == expected_true).sum())}


class EndCounter(AbstractCallback):
    def __init__(self):
        super().__init__('end counter')
        self.batch_ends = 0
        self.epoch_ends = 0

    def on_batch_end(self):
        self.batch_ends += 1

    def on_epoch_end(self):
        self.epoch_ends += 1


def test_callbacks_run_only_when_asked():
    callback = EndCounter()
    predictor = PyTorchModelPredictor(eval_model(), loader(), callbacks=[callback])
    assert callback.train_loop_obj is predictor.train_loop
    predictor.model_predict()
    assert (callback.batch_ends, callback.epoch_ends) == (0, 0)
    predictor.execute_batch_end_callbacks()
    predictor.execute_epoch_end_callbacks()
    assert (callback.batch_ends, callback.epoch_ends) == (1, 1)


def test_executing_callbacks_without_any_warns(caplog, monkeypatch):
    # the package logger may not propagate to the root logger caplog listens on
    monkeypatch.setattr(logging.getLogger('aitoolbox'), 'propagate', True)
    predictor = PyTorchModelPredictor(eval_model(), loader())
    with caplog.at_level(logging.WARNING, logger='aitoolbox.torchtrain.model_predict'):
        predictor.execute_batch_end_callbacks()
        predictor.execute_epoch_end_callbacks()
    assert 'execute_batch_end_callbacks has no effect' in caplog.text
    assert 'execute_epoch_end_callbacks has no effect' in caplog.text
