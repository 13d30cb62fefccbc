"""TrainLoop's whole-set evaluation: the end-of-epoch and end-of-training losses, and 1.x's evaluate and predict
methods. The computing itself (exact over batches and processes, cached per iteration) is :class:`.Evaluator`'s.
"""
import logging
from typing import Optional

import torch
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.train_loop.losses import LossResult, as_float_dict, history_entries, loss_names

logger = logging.getLogger(__name__)


class EvaluationMethods:
    """The evaluation half of :class:`~aitoolbox.torchtrain.train_loop.train_loop.TrainLoop` (a mixin: it uses the
    loop's loaders, strategy, history and ``_evaluator``)."""

    @property
    def auto_eval_due(self) -> bool:
        """True when the loop records ``loss``/``val_loss`` at the end of the current epoch (``end_auto_eval``)."""
        if self.end_auto_eval is True or self.end_auto_eval is False:
            return self.end_auto_eval
        return (self.epoch + 1) % self.end_auto_eval == 0

    def _evaluate_at_epoch_end(self) -> None:
        if self.auto_eval_due:
            self._record_loss("loss", self.evaluate_loss_on_train_set())
            if self.validation_loader is not None:
                self._record_loss("val_loss", self.evaluate_loss_on_validation_set())

    def _record_loss(self, metric_name: str, result: LossResult) -> dict:
        """Insert an evaluated loss into the history (one entry per name for a MultiLoss); returns the entries."""
        names = loss_names(result)
        values = result if names is None else torch.stack([result[name] for name in names])
        entries = history_entries(metric_name, values, names)
        for name, value in entries.items():
            self.insert_metric_result_into_history(name, value)
        return entries

    def _evaluate_at_train_end(self) -> None:
        if self.end_auto_eval is not False and self.test_loader is not None:
            entries = self._record_loss("train_end_test_loss", self.evaluate_loss_on_test_set())
            if self.strategy.is_main_process:
                logger.info("Test loss at the end of training: %s",
                            ", ".join(f"{k} {v:.6g}" for k, v in entries.items()))

    def _evaluation_loader(self, dataset_type: str) -> DataLoader:
        """The loader to evaluate on: the user's, or under DDP this process's exact share of it."""
        loader = {"train": self.train_loader, "validation": self.validation_loader, "test": self.test_loader}[dataset_type]
        if loader is None:
            raise ValueError(f"this TrainLoop has no {dataset_type}_loader: pass one to the constructor")
        # Prepared once per loader: a loader replaced since (by the user, or by DataSubsetTestRun) is prepared anew.
        source, prepared = self._evaluation_loaders.get(dataset_type, (None, None))
        if source is not loader:
            prepared = self.strategy.setup_eval_loader(loader)
            self._evaluation_loaders[dataset_type] = (loader, prepared)
        return prepared

    def _evaluate_loss_on(self, dataset_type: str, force_prediction: bool, float_dict_format: bool):
        loss = self._evaluator.evaluate_loss(self._evaluation_loader(dataset_type), dataset_type,
                                             force=force_prediction)
        return as_float_dict(loss) if float_dict_format else loss

    def evaluate_loss_on_train_set(self, force_prediction: bool = False, float_dict_format: bool = False):
        """Mean loss per sample over the training set, in eval mode (cached within one training iteration).

        Args:
            force_prediction: evaluate again even if this iteration's value is cached.
            float_dict_format: return a float (a ``{name: float}`` dict for a MultiLoss) instead of a 0-dim
                float64 tensor (a MultiLoss of them).
        """
        return self._evaluate_loss_on("train", force_prediction, float_dict_format)

    def evaluate_loss_on_validation_set(self, force_prediction: bool = False, float_dict_format: bool = False):
        """Mean loss per sample over the validation set; arguments as :meth:`evaluate_loss_on_train_set`."""
        return self._evaluate_loss_on("validation", force_prediction, float_dict_format)

    def evaluate_loss_on_test_set(self, force_prediction: bool = False, float_dict_format: bool = False):
        """Mean loss per sample over the test set; arguments as :meth:`evaluate_loss_on_train_set`."""
        return self._evaluate_loss_on("test", force_prediction, float_dict_format)

    def evaluate_model_loss(self, data_loader: DataLoader, move_to_cpu: bool = False,
                            dataset_info: Optional[dict] = None) -> LossResult:
        """Mean loss per sample over any loader (not cached): a 0-dim float64 tensor, or a MultiLoss of them.

        Args:
            data_loader: the batches to evaluate on.
            move_to_cpu: return the value on the CPU rather than on the training device.
            dataset_info: e.g. ``{'type': 'validation'}``, shown in the progress bar.
        """
        dataset_type = (dataset_info or {}).get("type", "data")
        loss = self._evaluator.evaluate_loss(data_loader, dataset_type, force=True, cache=False)
        return loss.cpu() if move_to_cpu else loss.to(self.device)

    def _predict_on(self, dataset_type: str, force_prediction: bool, execute_callbacks: bool):
        return self._evaluator.predict(self._evaluation_loader(dataset_type), dataset_type,
                                       execute_callbacks=execute_callbacks, force=force_prediction)

    def predict_on_train_set(self, force_prediction: bool = False, execute_callbacks: bool = False):
        """``(y_pred, y_true, metadata)`` over the training set (cached within one training iteration).

        Args:
            force_prediction: predict again even if this iteration's predictions are cached.
            execute_callbacks: call the callbacks' ``on_after_batch_prediction`` after each batch.
        """
        return self._predict_on("train", force_prediction, execute_callbacks)

    def predict_on_validation_set(self, force_prediction: bool = False, execute_callbacks: bool = False):
        """``(y_pred, y_true, metadata)`` over the validation set; arguments as :meth:`predict_on_train_set`."""
        return self._predict_on("validation", force_prediction, execute_callbacks)

    def predict_on_test_set(self, force_prediction: bool = False, execute_callbacks: bool = False):
        """``(y_pred, y_true, metadata)`` over the test set; arguments as :meth:`predict_on_train_set`."""
        return self._predict_on("test", force_prediction, execute_callbacks)

    def predict_with_model(self, data_loader: DataLoader, execute_callbacks: bool = False, move_to_cpu: bool = False,
                           dataset_info: Optional[dict] = None):
        """``(y_pred, y_true, metadata)`` over any loader (not cached).

        Args:
            data_loader: the batches to predict on.
            execute_callbacks: call the callbacks' ``on_after_batch_prediction`` after each batch.
            move_to_cpu: accepted for 1.x compatibility; the collate functions decide where outputs live.
            dataset_info: e.g. ``{'type': 'test'}``, handed to the callbacks and shown in the progress bar.
        """
        dataset_type = (dataset_info or {}).get("type", "data")
        return self._evaluator.predict(data_loader, dataset_type, execute_callbacks=execute_callbacks, force=True,
                                       cache=False, dataset_info=dataset_info)
