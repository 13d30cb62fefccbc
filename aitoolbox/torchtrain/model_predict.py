"""Predict with, and evaluate, an already trained model over one data loader (aitoolbox 1.8's model_predict).

:class:`PyTorchModelPredictor` builds a predict-only :class:`~aitoolbox.torchtrain.train_loop.TrainLoop`
(no training loader, optimizer or criterion) around the model, so predictions and losses are computed exactly
as during training: same device placement, mixed-precision settings, batch collation and per-sample loss
averaging.
"""
import logging
import os
from typing import Any, Dict, List, Optional, Sequence, Union

from torch import nn

from aitoolbox.experiment.local_save.experiment_folder import ExperimentFolder
from aitoolbox.torchtrain.callbacks.cloud_upload import cloud_destination
from aitoolbox.torchtrain.train_loop import TrainLoop

logger = logging.getLogger(__name__)

LOCAL_SAVE_MODES = (None, 'local')
CLOUD_SAVE_MODES = ('s3', 'aws_s3', 'aws', 'gcs', 'google_storage', 'google storage')


def _jsonable(value: Any) -> Any:
    """Tensors and arrays as (nested) lists, so predictions can go into a JSON results file."""
    if hasattr(value, 'tolist'):
        return value.tolist()
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    return value


class PyTorchModelPredictor:
    """Predictions, loss, metrics and result packages of a trained model over ``data_loader``.

    Args:
        model: a :class:`~aitoolbox.torchtrain.model.TTModel` (or ``TTDataParallel``) or a
            :class:`~aitoolbox.torchtrain.model.ModelWrap`.
        data_loader: the batches to predict on; any iterable of batches the model's ``get_predictions``
            understands.
        callbacks: callbacks registered with the internal TrainLoop; they run only through
            :meth:`execute_batch_end_callbacks` and :meth:`execute_epoch_end_callbacks`.

    Example::

        predictor = PyTorchModelPredictor(model, test_loader)
        y_pred, y_true, metadata = predictor.model_predict()
        accuracy = predictor.evaluate_result_package(ClassificationResultPackage(), return_result_package=False)
    """

    def __init__(self, model: Any, data_loader: Any, callbacks: Optional[Sequence[Any]] = None):
        self.model = model
        self.data_loader = data_loader
        self.train_loop = TrainLoop(model, None, None, data_loader, None, None)
        self.train_loop.callbacks_handler.register_callbacks(callbacks or [])

    def model_predict(self):
        """Predict over the whole loader.

        Returns:
            ``(y_pred, y_true, metadata)``, the batches' outputs combined as in ``TrainLoop.predict_on_test_set``.
        """
        return self.train_loop.predict_with_model(self.data_loader, dataset_info={'type': 'test'})

    def model_get_loss(self, loss_criterion: Any):
        """The model's mean loss per sample over the loader, in eval mode.

        Args:
            loss_criterion: the criterion handed to the model's ``get_loss_eval`` (e.g. ``nn.CrossEntropyLoss()``).

        Returns:
            A 0-dim tensor, or a :class:`~aitoolbox.torchtrain.multi_loss_optim.MultiLoss` of them when the
            model returns several losses.
        """
        if isinstance(loss_criterion, nn.Module):
            loss_criterion = loss_criterion.to(self.train_loop.device)
        self.train_loop.criterion = loss_criterion
        return self.train_loop.evaluate_model_loss(self.data_loader, dataset_info={'type': 'test'})

    def evaluate_result_package(self, result_package: Any, return_result_package: bool = True):
        """Compute a result package on the model's predictions over the loader.

        Args:
            result_package: an :class:`~aitoolbox.experiment.result_package.abstract_result_packages.AbstractResultPackage`.
            return_result_package: return the package itself; False returns only its results dict.

        Returns:
            The prepared result package, or its ``get_results()`` dict.
        """
        y_pred, y_true, metadata = self.model_predict()
        result_package.prepare_result_package(y_true, y_pred, hyperparameters={}, additional_results=metadata)
        return result_package if return_result_package else result_package.get_results()

    def evaluate_model(self, result_package: Any, project_name: str, experiment_name: str,
                       local_model_result_folder_path: str, cloud_save_mode: Optional[str] = 'local',
                       bucket_name: str = 'model-result', cloud_dir_prefix: str = '',
                       save_true_pred_labels: bool = False) -> str:
        """Evaluate a result package and save its results into an experiment folder.

        The folder is ``<local_model_result_folder_path>/<project_name>/<experiment_name>_<timestamp>/`` and the
        file ``results/results_hyperParams_hist_<experiment_name>_<timestamp>.json`` (JSON, where aitoolbox 1.8
        wrote a pickle), holding the results, the (empty) hyperparameters, the metrics as a one-entry training
        history and, with ``save_true_pred_labels``, the targets and predictions.

        Args:
            result_package: the metrics to compute.
            project_name: the project folder.
            experiment_name: prefix of the run folder.
            local_model_result_folder_path: root of the project folders.
            cloud_save_mode: ``'local'`` (the default; aitoolbox 1.8 defaulted to ``'s3'``) or None: the local
                file only. ``'s3'`` / ``'aws_s3'`` / ``'aws'`` or ``'gcs'`` / ``'google_storage'`` /
                ``'google storage'``: also upload it (before returning) to the same place under the run's key
                in the bucket (see :doc:`cloud_storage`).
            bucket_name: the bucket.
            cloud_dir_prefix: the folder inside the bucket that holds the projects.
            save_true_pred_labels: also save ``y_true`` and ``y_predicted``.

        Returns:
            The path of the results file.

        Raises:
            ValueError: an unknown ``cloud_save_mode``.
            CloudStorageError: the upload failed (after retrying transient errors); the message names the bucket
                and key, and the local file is kept.
        """
        destination = cloud_destination(cloud_save_mode, bucket_name, cloud_dir_prefix,
                                        owner='PyTorchModelPredictor.evaluate_model')

        folder = ExperimentFolder(local_model_result_folder_path, project_name, experiment_name,
                                  timestamp=self.train_loop.experiment_timestamp)
        folder.ensure(folder.results_dir)  # may suffix the timestamp when the folder exists already
        result_package.set_experiment_dir_path_for_additional_results(
            project_name=project_name, experiment_name=experiment_name, experiment_timestamp=folder.timestamp,
            local_model_result_folder_path=local_model_result_folder_path)

        evaluated = self.evaluate_result_package(result_package, return_result_package=True)
        results = evaluated.get_results()
        content: Dict[str, Any] = {
            'experiment_name': experiment_name,
            'experiment_results_local_path': folder.results_dir,
            'results': _jsonable(results),
            'hyperparameters': _jsonable(evaluated.get_hyperparameters()),
            'training_history': {name: [_jsonable(value)] for name, value in results.items()},
        }
        if save_true_pred_labels:
            content['y_true'] = _jsonable(evaluated.y_true)
            content['y_predicted'] = _jsonable(evaluated.y_predicted)
        file_name = f'results_hyperParams_hist_{experiment_name}_{folder.timestamp}.json'
        path = folder.save_json(os.path.join('results', file_name), content)
        if destination is not None:
            storage = destination.storage()
            key = destination.keys(folder).for_local_path(path, folder.path)
            logger.info('Uploading %s to %s', path, storage.uri(key))
            storage.upload_file(path, key)
        return path

    def execute_batch_end_callbacks(self) -> None:
        """Run the registered callbacks' ``on_batch_end``."""
        if not self.train_loop.callbacks:
            logger.warning('execute_batch_end_callbacks has no effect: no callbacks were registered')
        self.train_loop.callbacks_handler.on_batch_end()

    def execute_epoch_end_callbacks(self) -> None:
        """Run the registered callbacks' ``on_epoch_end``."""
        if not self.train_loop.callbacks:
            logger.warning('execute_epoch_end_callbacks has no effect: no callbacks were registered')
        self.train_loop.callbacks_handler.on_epoch_end()

    def evaluate_metric(self, metric_class: Any, return_metric: bool = True):
        """Compute one metric directly on the model's predictions.

        Args:
            metric_class: a metric class (not an instance) called as ``metric_class(y_true, y_pred)``, e.g. an
                ``AbstractBaseMetric`` subclass.
            return_metric: return the metric object; False returns its ``get_metric_dict()``.
        """
        y_pred, y_true, _ = self.model_predict()
        metric = metric_class(y_true, y_pred)
        return metric if return_metric else metric.get_metric_dict()

    def evaluate_metric_list(self, metrics_class_list: Sequence[Any],
                             return_metric_list: bool = True) -> Union[List[Any], Dict[str, Any]]:
        """Compute several metrics on one set of predictions.

        Args:
            metrics_class_list: metric classes (not instances).
            return_metric_list: return the metric objects; False returns one dict merging their metric dicts.
        """
        y_pred, y_true, _ = self.model_predict()
        metrics = [metric_class(y_true, y_pred) for metric_class in metrics_class_list]
        if return_metric_list:
            return metrics
        merged: Dict[str, Any] = {}
        for metric in metrics:
            merged.update(metric.get_metric_dict())
        return merged
