"""Loss evaluation and prediction over a whole data set, exact over batches (and processes)."""
import contextlib
import itertools
import logging
from typing import TYPE_CHECKING, Any, Optional, Tuple

import torch
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.train_loop.module_modes import modes_restored
from aitoolbox.torchtrain.train_loop.losses import (
    LossResult, as_float_dict, as_loss_result, detached_values, history_entries, loss_names)
from aitoolbox.torchtrain.train_loop.progress import EvaluationProgress
from aitoolbox.torchtrain.data.loader_info import (  # noqa: F401 (importable from here as before)
    batch_size_of, loader_length, preserved_generator_states)
from aitoolbox.torchtrain.data.sampler_state import loader_generators
from aitoolbox.torchtrain.train_loop.validation_sets import VALIDATION, history_prefixes, select_validation_set

if TYPE_CHECKING:  # pragma: no cover
    from aitoolbox.torchtrain.train_loop.train_loop import TrainLoop

logger = logging.getLogger(__name__)


def weights_version(module: Any) -> Optional[tuple]:
    """A value that changes whenever ``module``'s parameters or buffers change: each tensor's identity, storage and
    version counter (torch counts every in-place change: an optimizer step, ``load_state_dict``, a copy into
    ``detach()``, ``running_mean`` updates). None when a tensor keeps no version (an inference-mode tensor).

    A change made through ``tensor.data`` (``p.data.mul_(2)``) is not counted by torch and not seen here."""
    if not isinstance(module, torch.nn.Module):
        return ()
    try:
        return tuple((id(tensor), tensor._version, tensor.data_ptr())
                     for tensor in itertools.chain(module.parameters(), module.buffers()))
    except RuntimeError:
        return None


def merge_metadata(batch_metadata: Optional[dict], collected: Optional[dict]) -> Optional[dict]:
    """Merge one batch's metadata dict (values are per-sample sequences) into the collected dict of lists."""
    if batch_metadata is None:
        return collected
    if not isinstance(batch_metadata, dict):
        raise TypeError("get_predictions must return metadata as a dict of per-sample values or None, got "
                        f"{type(batch_metadata).__name__}")
    collected = {} if collected is None else collected
    for key, values in batch_metadata.items():
        if isinstance(values, torch.Tensor):
            values = values.detach().cpu().tolist()
        collected.setdefault(key, []).extend(values)
    return collected


@contextlib.contextmanager
def evaluation_mode(train_loop: "TrainLoop", loader: Any):
    """Eval mode, no gradients and forked random state (and the strategy's evaluation context: FSDP gathers the
    parameters once); each submodule's previous train/eval mode is restored after (a frozen BatchNorm stays in
    eval mode).

    Both the global torch RNG and the loader's own generators are restored: evaluating on the training
    loader (seeded with ``DataLoader(generator=...)``) must not change the order of the next training epoch.
    """
    device = train_loop.device
    rng_devices = []
    if device.type == "cuda":
        rng_devices = [device.index if device.index is not None else torch.cuda.current_device()]
    runner = train_loop.model_runner
    # The outermost module the loop calls: a parallel wrapper holds the model, so its modes cover the model's.
    outermost = getattr(runner, "wrapper", runner)
    with torch.random.fork_rng(devices=rng_devices), preserved_generator_states(loader_generators(loader)), \
            torch.no_grad(), train_loop.strategy.evaluation_context(), modes_restored(outermost):
        runner.eval()
        yield


class Evaluator:
    """Computes sample-weighted losses and collects predictions for a TrainLoop.

    The evaluation runs in eval mode without gradients, under the loop's precision, and inside a forked
    torch RNG so that evaluating (for example shuffling a loader) never changes the training run.
    Results are cached for the current training iteration and weights: several callbacks asking for validation
    predictions at one epoch end share a single pass, and a change of the weights or buffers in between (the
    average WeightAveraging puts in, a ``load_state_dict``) is evaluated anew (see :func:`weights_version`). It
    also records the losses the loop evaluates at the end of an epoch and of training (``end_auto_eval``).
    """

    def __init__(self, train_loop: "TrainLoop"):
        self.train_loop = train_loop
        self._prediction_cache = {}
        self._loss_cache = {}
        self._prepared_loaders = {}  # dataset type -> (the user's loader, the loader prepared by the strategy)
        self.progress = EvaluationProgress()  # at an epoch's end, its passes share one bar

    # --- the loop's own evaluations ----------------------------------------------------------------------
    def at_epoch_end(self) -> None:
        """Record ``loss`` and ``val_loss`` when ``end_auto_eval`` asks for them at this epoch (with several
        validation sets ``val_<name>_loss`` for each, the first one also as ``val_loss``)."""
        tl = self.train_loop
        if tl.auto_eval_due:
            self.record_loss("loss", self.loss_on("train"))
            if tl.validation_loader is not None:
                for name, prefixes in history_prefixes(tl.validation_loader):
                    result = self.loss_on("validation", name=name)
                    for prefix in prefixes:
                        self.record_loss(f"{prefix}loss", result)

    def at_train_end(self) -> None:
        """Record (and log) ``train_end_test_loss`` when there is a test loader and ``end_auto_eval`` is on."""
        tl = self.train_loop
        if tl.end_auto_eval is not False and tl.test_loader is not None:
            entries = self.record_loss("train_end_test_loss", self.loss_on("test"))
            if tl.strategy.is_main_process:
                logger.info("Test loss at the end of training: %s",
                            ", ".join(f"{k} {v:.6g}" for k, v in entries.items()))

    def record_loss(self, metric_name: str, result: LossResult) -> dict:
        """Insert an evaluated loss into the history (one entry per name for a MultiLoss); returns the entries."""
        names = loss_names(result)
        values = result if names is None else torch.stack([result[name] for name in names])
        entries = history_entries(metric_name, values, names)
        for name, value in entries.items():
            self.train_loop.insert_metric_result_into_history(name, value)
        return entries

    # --- the loop's three data sets ------------------------------------------------------------------------
    def _dataset(self, dataset_type: str, name: Optional[str]) -> Tuple[str, Optional[str], Any]:
        """``(key, set name, user's loader)`` of one of the loop's data sets; ``name`` picks one of several
        validation sets (see :func:`~.validation_sets.select_validation_set`)."""
        tl = self.train_loop
        if dataset_type == VALIDATION:
            return select_validation_set(tl.validation_loader, name)
        if name is not None:
            raise ValueError(f"name={name!r} picks one of several validation sets; the {dataset_type} set has no names")
        loader = {"train": tl.train_loader, "test": tl.test_loader}[dataset_type]
        if loader is None:
            raise ValueError(f"this TrainLoop has no {dataset_type}_loader: pass one to the constructor")
        return dataset_type, None, loader

    def prepared_loader(self, dataset_type: str, name: Optional[str] = None) -> DataLoader:
        """The loader to evaluate on: the user's, or under DDP this process's exact share of it (for each
        validation set its own share)."""
        key, _, loader = self._dataset(dataset_type, name)
        # Prepared once per loader: a loader replaced since (by the user, or by DataSubsetTestRun) is prepared anew.
        source, prepared = self._prepared_loaders.get(key, (None, None))
        if source is not loader:
            prepared = self.train_loop.strategy.setup_eval_loader(loader)
            self._prepared_loaders[key] = (loader, prepared)
        return prepared

    def loss_on(self, dataset_type: str, force: bool = False, float_dict_format: bool = False,
                name: Optional[str] = None):
        """The mean loss over the loop's ``dataset_type`` set (cached within one training iteration); ``name``
        picks one of several validation sets (None: the first)."""
        key, _, _ = self._dataset(dataset_type, name)
        loss = self.evaluate_loss(self.prepared_loader(dataset_type, name), key, force=force)
        return as_float_dict(loss) if float_dict_format else loss

    def predictions_on(self, dataset_type: str, force: bool = False, execute_callbacks: bool = False,
                       name: Optional[str] = None):
        """``(y_pred, y_true, metadata)`` over the loop's ``dataset_type`` set (cached within one iteration);
        ``name`` picks one of several validation sets (None: the first)."""
        key, set_name, _ = self._dataset(dataset_type, name)
        # The callbacks' dataset_info: a named set says which one (its type stays 'validation', as 1.x callbacks test).
        dataset_info = {"type": dataset_type} if set_name is None else {"type": dataset_type, "name": set_name}
        return self.predict(self.prepared_loader(dataset_type, name), key, execute_callbacks=execute_callbacks,
                            force=force, dataset_info=dataset_info)

    # --- any loader ----------------------------------------------------------------------------------------

    def _cache_key(self, dataset_type: str, loader: Any) -> Optional[tuple]:
        """What a cached result answers for: the set, the loader, the training position and the weights (None: the
        weights' version cannot be read, nothing is cached)."""
        # The loader's identity too: a result computed on a loader since replaced is not the new loader's. (Cached
        # values keep their loader alive, so its id cannot be reused by another loader meanwhile.)
        version = weights_version(self.train_loop.model)
        if version is None:
            return None
        return dataset_type, id(loader), self.train_loop.epoch, self.train_loop.total_iteration_idx, version

    def _key_after(self, key_before: tuple, dataset_type: str, loader: Any) -> Optional[tuple]:
        """The key to store a result under: the weights' version as the evaluation left them. A distributed
        evaluation puts rank 0's buffers into every rank and each rank's own back afterwards (the same values, new
        versions); the next call must still find the result. A result whose evaluation changed the weights
        otherwise (a module that updates a buffer in eval mode) is not kept."""
        key_after = self._cache_key(dataset_type, loader)
        if key_after is None or not self.train_loop.strategy.is_distributed:
            return key_before if key_after == key_before else None
        return key_after

    @staticmethod
    def _store(cache: dict, key: Optional[tuple], value) -> dict:
        """``cache`` with ``value`` under ``key``; what older iterations or other weights left behind is dropped.
        ``key`` None: nothing is stored."""
        if key is None:
            return cache
        kept = {old_key: old_value for old_key, old_value in cache.items() if old_key[2:] == key[2:]}
        kept[key] = value
        return kept

    def evaluate_loss(self, loader: DataLoader, dataset_type: str, force: bool = False,
                      cache: bool = True) -> LossResult:
        """Mean loss per sample over the loader (each batch weighted by its number of samples).

        Returns:
            A 0-dim float64 CPU tensor, or a MultiLoss of them when ``get_loss_eval`` returns a MultiLoss.
        """
        key = self._cache_key(dataset_type, loader) if cache else None
        if key is not None and not force and key in self._loss_cache:
            return self._loss_cache[key][1]
        tl = self.train_loop
        tl.set_up()
        device = tl.device
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        sample_count = torch.zeros((), dtype=torch.float64, device=device)
        names = None
        with evaluation_mode(tl, loader):
            batches = self.progress.iterate(loader, loader_length(loader), f"Loss {dataset_type}", tl.show_progress)
            for batch_data in batches:
                with tl.precision.autocast():
                    loss = tl.model_runner.get_loss_eval(batch_data, tl.criterion, device)
                tl.check_loss(loss, "get_loss_eval")
                names = loss_names(loss)
                num_samples = batch_size_of(batch_data) or 1
                loss_sum = loss_sum + detached_values(loss).double() * num_samples
                sample_count += num_samples
        totals = tl.strategy.all_reduce_sum(torch.cat([loss_sum.reshape(-1), sample_count.reshape(1)]))
        if totals[-1].item() == 0:
            raise ValueError(f"cannot evaluate the loss on {dataset_type}: its data loader yielded no batches. An "
                             "evaluation set must yield at least one; a sized loader is checked when the loop is "
                             "built, one over an IterableDataset (length unknown) only here. Give the loop a loader "
                             "that yields data (tl.validation_loader = ...); fit() again then continues this "
                             "epoch's end")
        mean = (totals[:-1] / totals[-1]).cpu()
        result = as_loss_result(mean.reshape(()) if names is None else mean, names)
        if key is not None:
            self._loss_cache = self._store(self._loss_cache, self._key_after(key, dataset_type, loader),
                                           (loader, result))
        return result

    def predict(self, loader: DataLoader, dataset_type: str, execute_callbacks: bool = False, force: bool = False,
                cache: bool = True, dataset_info: Optional[dict] = None) -> Tuple[Any, Any, Optional[dict]]:
        """``(y_pred, y_true, metadata)`` over the whole loader, joined by the loop's collate functions.

        Args:
            loader: the batches.
            dataset_type: ``'train'``, ``'validation'``, ``'test'`` (or a name of the caller's).
            execute_callbacks: call ``on_after_batch_prediction`` of the callbacks after each batch.
            force: predict again even if this iteration's result is cached.
            cache: keep the result for this training iteration.
            dataset_info: handed to the callbacks; ``{'type': dataset_type}`` when None.
        """
        tl = self.train_loop
        key = self._cache_key(dataset_type, loader) if cache else None
        if key is not None and not force and key in self._prediction_cache:
            return self._prediction_cache[key][1]
        tl.set_up()
        y_pred, y_true, metadata = [], [], None
        dataset_info = dataset_info if dataset_info is not None else {"type": dataset_type}
        with evaluation_mode(tl, loader):
            batches = self.progress.iterate(loader, loader_length(loader), f"Predict {dataset_type}",
                                            tl.show_progress)
            for batch_data in batches:
                with tl.precision.autocast():
                    outputs = tl.model_runner.get_predictions(batch_data, tl.device)
                if not isinstance(outputs, (tuple, list)) or len(outputs) != 3:
                    raise ValueError(
                        "get_predictions must return a tuple (y_pred, y_true, metadata) with metadata a dict "
                        f"or None; got {type(outputs).__name__}"
                        + (f" of length {len(outputs)}" if isinstance(outputs, (tuple, list)) else ""))
                y_pred_batch, y_true_batch, metadata_batch = outputs
                if execute_callbacks:
                    tl.callbacks_handler.on_after_batch_prediction(y_pred_batch, y_true_batch, metadata_batch,
                                                                   dataset_info)
                y_pred = tl.collate_batch_pred_fn(y_pred_batch, y_pred)
                y_true = tl.collate_batch_pred_fn(y_true_batch, y_true)
                metadata = merge_metadata(metadata_batch, metadata)
        if tl.strategy.world_size > 1:
            y_pred, y_true, metadata = self._gather_from_ranks(y_pred, y_true, metadata)
        result = (tl.pred_transform_fn(y_pred), tl.pred_transform_fn(y_true), metadata)
        if key is not None:
            self._prediction_cache = self._store(self._prediction_cache, self._key_after(key, dataset_type, loader),
                                                 (loader, result))
        return result

    def _gather_from_ranks(self, y_pred, y_true, metadata):
        """Join every rank's collected outputs in rank order: each rank holds one contiguous block of the data."""
        if not (isinstance(y_pred, list) and isinstance(y_true, list)):
            raise TypeError("under distributed training collate_batch_pred_fn must collect into a list (as "
                            "append_predictions does), so the ranks' predictions can be joined")
        parts = self.train_loop.strategy.all_gather_objects((y_pred, y_true, metadata))
        joined_pred = [item for part_pred, _, _ in parts for item in part_pred]
        joined_true = [item for _, part_true, _ in parts for item in part_true]
        joined_metadata = None
        for _, _, part_metadata in parts:
            if part_metadata is not None:
                joined_metadata = merge_metadata(part_metadata, joined_metadata)
        return joined_pred, joined_true, joined_metadata

    def clear_cache(self) -> None:
        """Forget cached results and prepared loaders (the strategy changed: loaders are prepared anew)."""
        self._prediction_cache = {}
        self._loss_cache = {}
        self._prepared_loaders = {}
