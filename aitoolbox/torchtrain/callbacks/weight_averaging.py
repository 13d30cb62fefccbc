"""Weight averaging: an exponential moving average (EMA) or a stochastic weight average (SWA) of the model's weights,
kept beside training by :class:`WeightAveraging` in a :class:`torch.optim.swa_utils.AveragedModel`.

Training itself never sees the average: the averaged weights are copied into the model only from the end of an
epoch's training (before the epoch-end evaluation) until the next batch is trained, and after training. The copy
is in place, so the optimizer, DDP and a compiled forward keep their parameters, and the training weights are put
back bitwise.
"""
import logging
from typing import Any, Callable, List, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn, update_bn

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.model_save import CHECKPOINT_EXECUTION_ORDER
from aitoolbox.torchtrain.model import TTModel
from aitoolbox.torchtrain.data.loader_info import loader_length, preserved_generator_states
from aitoolbox.torchtrain.data.sampler_state import loader_generators

logger = logging.getLogger(__name__)

MODES = ("ema", "swa")
#: Before the checkpoint callbacks: an update made at a batch end is in the checkpoint saved there, and the final
#: model is in the model before ModelTrainEndSave saves it.
DEFAULT_EXECUTION_ORDER = CHECKPOINT_EXECUTION_ORDER - 10
BnForwardFn = Callable[[nn.Module, Any, torch.device], Any]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def default_bn_forward(module: nn.Module, batch_data: Any, device: torch.device) -> None:
    """One forward pass of a training batch for the BatchNorm statistics: a TTModel's ``get_predictions``, a plain
    module (``ModelWrap``) called on the batch's first element, as :func:`torch.optim.swa_utils.update_bn` does."""
    if isinstance(module, TTModel):
        module.get_predictions(batch_data, device)
        return
    inputs = batch_data[0] if isinstance(batch_data, (list, tuple)) else batch_data
    module(inputs.to(device))


class _BatchForward(nn.Module):
    # update_bn calls its model with the first element of each item; each item is (batch,), so this sees the batch.
    def __init__(self, module: nn.Module, forward_fn: BnForwardFn, device: torch.device):
        super().__init__()
        self.module = module
        self.forward_fn = forward_fn
        self.device = device

    def forward(self, batch_data: Any) -> None:
        self.forward_fn(self.module, batch_data, self.device)


class WeightAveraging(AbstractCallback):
    """Keep an EMA or SWA of the model's weights; evaluate with it and save it as the final model.

    The average is a :class:`torch.optim.swa_utils.AveragedModel` of the model (``mode='ema'`` with
    :func:`~torch.optim.swa_utils.get_ema_multi_avg_fn`, ``mode='swa'`` the equal-weight average). It is updated
    after optimizer steps (steps skipped on a loss-scale overflow do not count) or once per epoch, from
    ``start_epoch`` and ``start_iteration`` on.

    With ``eval_with_average`` the averaged weights are in the model from the end of each epoch's training until
    the next batch: the epoch-end ``loss`` / ``val_loss``, every ``on_epoch_end`` callback (metrics, early
    stopping, :class:`~aitoolbox.torchtrain.callbacks.model_save.ModelCheckpoint`) and the train-end test loss see
    them; training continues from the training weights, bitwise as without this callback. With ``save_average``
    the model holds the averaged weights when ``fit`` returns, and ModelTrainEndSave saves (and evaluates) them.
    Until the first update there is no average, and the model keeps its training weights.

    Checkpoints: the callback's state (the averaged model, its counters) is saved under ``callbacks`` and restored
    by ``load_checkpoint`` (register a WeightAveraging again). A checkpoint written while the averaged weights are in
    the model (at an epoch end, after training) holds them as ``model_state_dict``, and the training weights in the
    callback's state, which puts them back: training continues bitwise.

    Under DDP every process keeps the average of its (identical) replica; buffers, which each process updates with
    its own batches, are taken from rank 0 whenever the average is used, so all processes hold the same averaged
    weights. ``gpu_mode='fsdp'`` is refused, and so is a second WeightAveraging on the same loop.

    Args:
        mode: ``'ema'`` or ``'swa'``.
        decay: EMA only: ``average = decay * average + (1 - decay) * weights`` (default 0.999).
        start_epoch: the first epoch (0-based) whose weights are averaged.
        start_iteration: the first batch (0-based, counted over the whole run like ``total_iteration_idx``) whose
            optimizer step is averaged.
        update_every: ``N`` averages every N-th optimizer step from the start (EMA's default: 1); ``'epoch'``
            averages the weights at the end of each epoch's training (SWA's default).
        use_buffers: also average the buffers (BatchNorm statistics); otherwise they are copied from the model at
            each update (see ``update_bn``).
        eval_with_average: evaluate with the averaged weights at every epoch end and at the end of training.
        save_average: leave the averaged weights in the model after training (the model ``fit`` returns and
            ModelTrainEndSave saves); False puts the training weights back.
        update_bn: at the end of training (at the last epoch's end when it is known to be the last), recompute the
            averaged model's BatchNorm statistics with a pass over the training data
            (:func:`torch.optim.swa_utils.update_bn`); under DDP each process uses its share and the statistics are
            averaged over the processes. The random state and the loader's generators are left as they were.
        bn_forward_fn: ``fn(module, batch_data, device)`` running one training batch through the averaged module
            for ``update_bn`` (default :func:`default_bn_forward`).
        execution_order: position among the callbacks; must be below the checkpoint callbacks' (100).

    Raises:
        ValueError / TypeError: a bad argument (the message names it and the valid values).
    """

    def __init__(self, mode: str = "ema", decay: Optional[float] = None, start_epoch: int = 0,
                 start_iteration: int = 0, update_every: Union[int, str, None] = None, use_buffers: bool = False,
                 eval_with_average: bool = True, save_average: bool = True, update_bn: bool = False,
                 bn_forward_fn: Optional[BnForwardFn] = None, execution_order: int = DEFAULT_EXECUTION_ORDER):
        super().__init__("Weight averaging", execution_order=execution_order)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(repr(m) for m in MODES)}, got {mode!r}")
        if decay is not None and mode != "ema":
            raise ValueError(f"decay is for mode='ema'; mode={mode!r} averages with equal weights")
        decay = 0.999 if decay is None else decay
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be a number in [0, 1], got {decay!r}")
        for name, value in (("start_epoch", start_epoch), ("start_iteration", start_iteration)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        update_every = (1 if mode == "ema" else "epoch") if update_every is None else update_every
        if update_every != "epoch" and (isinstance(update_every, bool) or not isinstance(update_every, int)
                                        or update_every < 1):
            raise ValueError(f"update_every must be an int >= 1 (optimizer steps) or 'epoch', got {update_every!r}")
        for name, value in (("use_buffers", use_buffers), ("eval_with_average", eval_with_average),
                            ("save_average", save_average), ("update_bn", update_bn)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        if update_bn and use_buffers:
            raise ValueError("update_bn=True recomputes the BatchNorm statistics that use_buffers=True averages: "
                             "choose one")
        if bn_forward_fn is not None and (not callable(bn_forward_fn) or not update_bn):
            raise ValueError("bn_forward_fn must be a function fn(module, batch_data, device), given with "
                             f"update_bn=True; got {bn_forward_fn!r} with update_bn={update_bn}")
        if isinstance(execution_order, bool) or not isinstance(execution_order, int) \
                or execution_order >= CHECKPOINT_EXECUTION_ORDER:
            raise ValueError(f"execution_order must be an int below {CHECKPOINT_EXECUTION_ORDER} (the checkpoint "
                             "callbacks' order), so that checkpoints and the final save see the averaged state; "
                             f"got {execution_order!r}")
        self.mode = mode
        self.decay = float(decay)
        self.start_epoch = start_epoch
        self.start_iteration = start_iteration
        self.update_every = update_every
        self.use_buffers = use_buffers
        self.eval_with_average = eval_with_average
        self.save_average = save_average
        self.update_bn = update_bn
        self.bn_forward_fn = bn_forward_fn
        self._averaged: Optional[AveragedModel] = None
        self._pending_state: Optional[dict] = None  # a state loaded before the averaged model exists
        self._clear_progress()
        self._stepped = False  # an optimizer step since the last update decision
        self._late_warned = False

    def _clear_progress(self) -> None:
        self._step_count = 0  # optimizer steps since the start of averaging
        self._epoch_done = -1  # the last epoch whose end of training was handled
        self._bn_updated_at = -1  # n_averaged when the BatchNorm statistics were last recomputed
        self._backup: Optional[List[torch.Tensor]] = None  # the training weights while the average is in the model
        self._swapped_epoch = -1

    # --- public -----------------------------------------------------------------------------------------------
    @property
    def averaged_model(self) -> Optional[AveragedModel]:
        """The :class:`~torch.optim.swa_utils.AveragedModel` (None before training starts)."""
        return self._averaged

    @property
    def average_module(self) -> Optional[nn.Module]:
        """A copy of the model holding the averaged weights (its ``state_dict`` has the model's keys), or None."""
        return self._averaged.module if self._averaged is not None else None

    @property
    def num_averaged(self) -> int:
        """How many weight states have been averaged (0: no average yet)."""
        return int(self._averaged.n_averaged) if self._averaged is not None else 0

    @property
    def average_in_model(self) -> bool:
        """True while the model holds the averaged weights (the training weights are kept aside)."""
        return self._backup is not None

    # --- hooks ------------------------------------------------------------------------------------------------
    def on_train_loop_registration(self) -> None:
        self._refuse_sharding()
        # A second one would average (or put back) the first one's average while it is in the model.
        if any(isinstance(cb, WeightAveraging) and cb is not self for cb in self.train_loop_obj.callbacks):
            raise ValueError("a TrainLoop takes one WeightAveraging callback, and this one already has one")

    def on_train_begin(self) -> None:
        self._refuse_sharding()
        model = self.train_loop_obj.model
        if self._averaged is None:
            multi_avg_fn = get_ema_multi_avg_fn(self.decay) if self.mode == "ema" else None
            self._averaged = AveragedModel(model, multi_avg_fn=multi_avg_fn, use_buffers=self.use_buffers)
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)
        # _stepped is kept: a fit after an exception in a committed step's hooks finishes that step's batch end,
        # which updates the average for it (a checkpoint or rollback clears it in load_state_dict).
        self._late_warned = False

    def on_epoch_begin(self) -> None:
        # Still the swapped epoch: a resume of its end (all its batches were trained), which evaluates the average.
        if self.average_in_model and self.train_loop_obj.epoch != self._swapped_epoch:
            self._use_training_weights()

    def on_batch_begin(self) -> None:
        if self.average_in_model:  # never train on the average
            self._use_training_weights()

    def on_after_optimizer_step(self) -> None:
        self._stepped = self._stepped or not self.train_loop_obj.optimizer_step_skipped

    def on_batch_end(self) -> None:
        # At the batch end, once every optimizer (of a MultiLoss) has stepped; before the checkpoint callbacks.
        self._update_after_steps()
        if self._last_batch_of_epoch():
            self._end_of_epoch_training()

    def on_epoch_train_end(self) -> None:
        """After the epoch's last optimizer step, before the epoch-end evaluation, on a loop that has this hook (else
        :meth:`on_batch_end` finds the epoch's last batch, and :meth:`on_epoch_end` catches what it cannot)."""
        self._update_after_steps()
        self._end_of_epoch_training()

    def on_epoch_end(self) -> None:
        self._update_after_steps()  # a loader without len: its last step comes after the last batch end
        tl = self.train_loop_obj
        if self._epoch_done != tl.epoch:
            if self.eval_with_average and not self._late_warned and self._update_due_at_epoch_end():
                self._late_warned = True
                logger.warning("WeightAveraging could not tell the last batch of epoch %d (a train loader without len, "
                               "or a stop requested after this callback ran), so the loop's epoch-end losses were "
                               "computed with the training weights; callbacks from execution_order %d on see the "
                               "averaged weights", tl.epoch + 1, self.execution_order)
            self._end_of_epoch_training()
        if self.update_bn and self._final_epoch():
            self._recompute_bn()

    def on_train_end(self) -> None:
        if self.update_bn:
            self._recompute_bn()
        if self.save_average:
            if self.num_averaged == 0:
                logger.warning("WeightAveraging(mode=%r) averaged no weights (start_epoch=%d, start_iteration=%d): the "
                               "model keeps its training weights", self.mode, self.start_epoch, self.start_iteration)
            self._use_average()
        else:
            if self.average_in_model:
                self._use_training_weights()
            if self._averaged is not None:
                self._sync_buffers()  # the average is not used here, but every process holds the same one after fit

    # --- checkpoints ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The averaged model, the counters and, while the average is in the model, the training weights."""
        if self._averaged is None and self._pending_state is not None:
            return self._pending_state
        return {
            "mode": self.mode,
            "averaged": dict(self._averaged.state_dict()) if self._averaged is not None else None,
            "step_count": self._step_count,
            "epoch_done": self._epoch_done,
            "bn_updated_at": self._bn_updated_at,
            "swapped_epoch": self._swapped_epoch,
            "training_weights": list(self._backup) if self._backup is not None else None,
            # A step not judged yet: a snapshot taken between a committed step and its batch end (lr_find after an
            # exception in that step's hooks) must give it back, so that the finished batch end still updates.
            "stepped": self._stepped,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s result; the model holds what the same checkpoint's ``model_state_dict``
        held (the loop loaded it), so the training weights saved aside are put back before the next batch."""
        if state.get("mode") != self.mode:
            raise ValueError(f"the checkpoint holds a WeightAveraging state of mode {state.get('mode')!r}, this "
                             f"callback has mode={self.mode!r}: register the callback as in the saved run")
        if self._averaged is None:  # before training: applied at on_train_begin
            self._pending_state = state
            return
        self._clear_progress()
        # The run continues from the state's step point: where the update was decided, unless the state was taken
        # between a step and its batch end (older states: decided).
        self._stepped = bool(state.get("stepped", False))
        if state["averaged"] is not None:
            self._averaged.load_state_dict(state["averaged"])
        else:
            self._averaged.n_averaged.zero_()
        self._step_count = state["step_count"]
        self._epoch_done = state["epoch_done"]
        self._bn_updated_at = state["bn_updated_at"]
        self._swapped_epoch = state["swapped_epoch"]
        if state["training_weights"] is not None:
            live = self._live_tensors()
            saved = state["training_weights"]
            if len(saved) != len(live) or any(s.shape != t.shape for s, t in zip(saved, live)):
                raise ValueError("the training weights in the WeightAveraging state do not fit the model "
                                 f"({len(saved)} tensors for {len(live)}): load a checkpoint of this model")
            self._backup = [s.to(device=t.device, dtype=t.dtype, copy=True) for s, t in zip(saved, live)]

    def __getstate__(self) -> dict:
        # Sent to the processes of fit_distributed: the EMA function is a closure (not picklable); the state travels.
        state = self.__dict__.copy()
        if self._averaged is not None:
            state["_pending_state"] = self.state_dict()
            state["_averaged"] = None
            state["_backup"] = None
        return state

    # --- averaging --------------------------------------------------------------------------------------------
    def _refuse_sharding(self) -> None:
        if self.train_loop_obj is not None and self.train_loop_obj.shards_parameters:
            raise ValueError("WeightAveraging does not support gpu_mode='fsdp': each process holds only shards of the "
                             "parameters (DTensors), which the averaged copy, its use for evaluation and its "
                             "checkpoints would have to follow. Use gpu_mode='ddp' (every process keeps the whole "
                             "average) or average outside TrainLoop.")

    def _started(self) -> bool:
        tl = self.train_loop_obj
        return tl.epoch >= self.start_epoch and tl.total_iteration_idx >= self.start_iteration

    def _update(self) -> None:
        self._averaged.update_parameters(self.train_loop_obj.model)

    def _update_after_steps(self) -> None:
        if not self._stepped:
            return
        self._stepped = False
        if self.update_every == "epoch" or not self._started():
            return
        if self._step_count % self.update_every == 0:
            self._update()
        self._step_count += 1

    def _update_due_at_epoch_end(self) -> bool:
        return self.num_averaged > 0 or (self.update_every == "epoch" and self._started())

    def _end_of_epoch_training(self) -> None:
        """Once per epoch, after its last optimizer step: the epoch's update (SWA), then the average into the model."""
        tl = self.train_loop_obj
        if self._epoch_done == tl.epoch:
            return
        self._epoch_done = tl.epoch
        if self.update_every == "epoch" and self._started():
            self._update()
        if self.eval_with_average:
            self._use_average()

    def _last_batch_of_epoch(self) -> bool:
        tl = self.train_loop_obj
        num_batches = loader_length(tl.train_loader)
        if num_batches is not None and tl.iteration + 1 == num_batches:
            return True
        if tl.num_iterations > 0 and tl.total_iteration_idx + 1 >= tl.num_iterations:
            return True
        # A single process stops at once when asked to; distributed processes at the epoch end, all together.
        return bool(tl.early_stop) and not _distributed()

    def _final_epoch(self) -> bool:
        tl = self.train_loop_obj
        if tl.num_iterations > 0:
            return tl.total_iteration_idx + 1 >= tl.num_iterations
        return tl.epoch + 1 >= tl.num_epochs

    # --- moving weights ---------------------------------------------------------------------------------------
    def _live_tensors(self) -> List[torch.Tensor]:
        model = self.train_loop_obj.model
        return [t.detach() for t in list(model.parameters()) + list(model.buffers())]

    def _average_tensors(self) -> List[torch.Tensor]:
        module = self._averaged.module
        return [t.detach() for t in list(module.parameters()) + list(module.buffers())]

    @torch.no_grad()
    def _use_average(self) -> None:
        """Copy the average into the model (keeping the training weights aside once); a no-op without an average."""
        if self._averaged is None or self.num_averaged == 0:
            return
        self._sync_buffers()
        live, average = self._live_tensors(), self._average_tensors()
        if self._backup is None:
            self._backup = [t.clone() for t in live]
        for target, source in zip(live, average):
            target.copy_(source)
        self._swapped_epoch = self.train_loop_obj.epoch

    @torch.no_grad()
    def _use_training_weights(self) -> None:
        for target, source in zip(self._live_tensors(), self._backup):
            target.copy_(source)
        self._backup = None

    def _sync_buffers(self) -> None:
        # Each DDP process updates buffers (BatchNorm statistics) with its own batches: use rank 0's everywhere.
        if _distributed():
            for buffer in self._averaged.module.buffers():
                dist.broadcast(buffer.detach(), src=0)

    @torch.no_grad()
    def _recompute_bn(self) -> None:
        """The averaged module's BatchNorm statistics from a pass over the training data (once per average)."""
        if self._averaged is None or self.num_averaged in (0, self._bn_updated_at):
            return
        tl = self.train_loop_obj
        loader = tl.train_loader
        forward = _BatchForward(self._averaged.module, self.bn_forward_fn or default_bn_forward, tl.device)
        devices = [tl.device.index if tl.device.index is not None else torch.cuda.current_device()] \
            if tl.device.type == "cuda" else []
        # Forked RNG and generators: drawing the batches (and dropout) must not change the rest of the run.
        with torch.random.fork_rng(devices=devices), preserved_generator_states(loader_generators(loader)), \
                tl.precision.autocast():
            update_bn(((batch_data,) for batch_data in loader), forward)
        if _distributed():
            world_size = dist.get_world_size()
            for module in self._averaged.module.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.running_mean is not None:
                    for buffer in (module.running_mean, module.running_var):
                        dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
                        buffer.div_(world_size)
        self._bn_updated_at = self.num_averaged
        if self.average_in_model:  # the model shows the new statistics too
            self._use_average()

    def __repr__(self) -> str:
        return (f"WeightAveraging(mode={self.mode!r}, update_every={self.update_every!r}, "
                f"eval_with_average={self.eval_with_average}, save_average={self.save_average})")

