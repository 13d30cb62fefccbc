"""The state of one ``amp.initialize`` call, and the registry that finds it from an optimizer."""
import contextlib
import logging
import weakref
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from aitoolbox.torchtrain.amp.properties import OPT_LEVEL_DESCRIPTIONS, AmpProperties
from aitoolbox.torchtrain.precision.loss_scaler import LossScaler
from aitoolbox.torchtrain.precision.master_weights import (
    MasterWeights, clear_grads, optimizer_pairs, unscale_into)
from aitoolbox.torchtrain.precision.model_cast import ForwardCaster, cast_model, register_upcast_state_dict
from aitoolbox.torchtrain.precision.precision import Precision

logger = logging.getLogger(__name__)


class AmpState:
    """Models, optimizers, loss scalers and master weights prepared by one ``amp.initialize`` call.

    The state refers to its models and optimizers weakly: they own it (through the registry's entries keyed by
    them and the optimizers' step hooks), never the other way round, so dropping the last reference to a model
    and its optimizer frees them together with their state and float32 master weights.

    Args:
        properties: the resolved opt-level settings.
        models: the models (already on their device).
        optimizers: their optimizers.
        num_losses: how many loss scalers to keep (one per ``loss_id``).
        min_loss_scale: floor of dynamic scaling.
        max_loss_scale: ceiling of dynamic scaling.
        enabled: False keeps the state inert (``scale_loss`` yields the loss untouched).
    """

    def __init__(self, properties: AmpProperties, models: List[nn.Module], optimizers: List[torch.optim.Optimizer],
                 num_losses: int = 1, min_loss_scale: Optional[float] = None, max_loss_scale: float = 2.0 ** 24,
                 enabled: bool = True):
        self.properties = properties
        self.enabled = enabled
        self._model_refs = [weakref.ref(model) for model in models]
        self._optimizer_refs = [weakref.ref(optimizer) for optimizer in optimizers]
        self.device_type = self._device_type(models)
        self.loss_scalers = [LossScaler(properties.loss_scale, min_loss_scale, max_loss_scale)
                             for _ in range(num_losses)]
        self.master_weights: Optional[MasterWeights] = None
        self.last_step_skipped: Dict[int, bool] = {id(opt): False for opt in optimizers}
        self._skip_pending: Dict[int, bool] = {id(opt): False for opt in optimizers}
        self._grads_left_scaled = False
        self._stash: Dict[torch.Tensor, torch.Tensor] = {}
        if enabled:
            self._prepare(models, optimizers)

    @property
    def models(self) -> List[nn.Module]:
        """The models of this ``initialize`` call that are still alive."""
        return [model for model in (ref() for ref in self._model_refs) if model is not None]

    @property
    def optimizers(self) -> List[torch.optim.Optimizer]:
        """The optimizers of this ``initialize`` call that are still alive."""
        return [optimizer for optimizer in (ref() for ref in self._optimizer_refs) if optimizer is not None]

    @staticmethod
    def _device_type(models: Sequence[nn.Module]) -> str:
        for model in models:
            for tensor in list(model.parameters()) + list(model.buffers()):
                return tensor.device.type
        return "cpu"

    def _prepare(self, models: List[nn.Module], optimizers: List[torch.optim.Optimizer]) -> None:
        props = self.properties
        for model in models:
            if props.cast_model_type is not None:
                cast_model(model, props.cast_model_type, bool(props.keep_batchnorm_fp32))
            input_dtype = props.cast_model_type if props.cast_model_type in (torch.float16, torch.bfloat16) else None
            autocast_device = self.device_type if props.patch_torch_functions else None
            if input_dtype or autocast_device or props.cast_model_outputs:
                ForwardCaster(input_dtype, props.cast_model_outputs, autocast_device,
                              props.low_precision_dtype).attach(model)
            if input_dtype is not None:
                register_upcast_state_dict(model)
        if props.master_weights and optimizers:
            self.master_weights = MasterWeights(optimizers)
        for optimizer in optimizers:
            # The optimizer holds this state through the hook: the state lives as long as its optimizer does.
            optimizer.register_step_post_hook(self._after_step)
        logger.debug("amp initialized with %s (%s)", props.opt_level, OPT_LEVEL_DESCRIPTIONS[props.opt_level])

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.last_step_skipped[id(optimizer)] = self._skip_pending[id(optimizer)]
        self._skip_pending[id(optimizer)] = False

    @property
    def needs_grad_processing(self) -> bool:
        """False without loss scaling and master weights (O0, O3, O1 in bfloat16): backward is all there is."""
        return self.enabled and (self.properties.uses_loss_scaling or self.master_weights is not None)

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizers: Sequence[torch.optim.Optimizer], loss_id: int = 0,
                   delay_unscale: bool = False):
        """apex's ``scale_loss``: yield the scaled loss; on exit unscale into the stepped params and check.

        Without loss scaling nothing is scaled, unscaled or checked: the block yields the float32 loss and, under
        master weights, only moves the gradients into the float32 masters.
        """
        if self.enabled and not 0 <= loss_id < len(self.loss_scalers):
            raise ValueError(f"loss_id={loss_id} is out of range: amp.initialize was called with "
                             f"num_losses={len(self.loss_scalers)}")
        if not self.needs_grad_processing:
            yield loss.float()
            return
        scaler = self.loss_scalers[loss_id] if self.properties.uses_loss_scaling else None
        pairs_by_optimizer = [optimizer_pairs(opt, self.master_weights) for opt in optimizers]
        # Gradients already unscaled by an earlier scale_loss must not be mixed with the new scaled ones:
        # set them aside and add them back after unscaling (gradient accumulation, several losses).
        if scaler is not None and not self._grads_left_scaled:
            for pairs in pairs_by_optimizer:
                for model_param, stepped in pairs:
                    if model_param is stepped and stepped.grad is not None:
                        self._stash[stepped] = stepped.grad
                        stepped.grad = None
        yield loss.float() if scaler is None else scaler.scale(loss)
        if delay_unscale:
            self._grads_left_scaled = True
            return
        self._grads_left_scaled = False
        found_inf = False
        for pairs in pairs_by_optimizer:
            found_inf |= unscale_into(pairs, scaler)
        for param, grad in self._stash.items():
            param.grad = grad if param.grad is None else param.grad.add_(grad)
        self._stash.clear()
        if scaler is not None and scaler.dynamic:
            scaler.update(found_inf)
            if found_inf:
                logger.info("Gradient overflow: skipping the next optimizer step, loss scale reduced to %g",
                            scaler.loss_scale)
                for optimizer, pairs in zip(optimizers, pairs_by_optimizer):
                    self._skip_pending[id(optimizer)] = True
        for optimizer, pairs in zip(optimizers, pairs_by_optimizer):
            if self._skip_pending[id(optimizer)]:
                clear_grads([stepped for _, stepped in pairs])

    def precision(self, loss_id: int = 0) -> Precision:
        """The Precision object TrainLoop drives with this state (its scaler ``loss_id``)."""
        props = self.properties
        if not self.enabled:
            return Precision(self.device_type)
        return Precision(self.device_type,
                         autocast_dtype=props.low_precision_dtype if props.patch_torch_functions else None,
                         loss_scaler=self.loss_scalers[loss_id] if props.uses_loss_scaling else None,
                         master_weights=self.master_weights, step_listener=self._record_loop_step)

    def _record_loop_step(self, skipped: bool, optimizers) -> None:
        # A step the loop skips never calls optimizer.step(), so the post-step hook cannot see it.
        for optimizer in optimizers:
            if id(optimizer) in self.last_step_skipped:
                self.last_step_skipped[id(optimizer)] = skipped

    def state_dict(self) -> dict:
        """``{'loss_scaler0': {'loss_scale', 'unskipped'}, ...}`` plus the float32 master weights under O2."""
        state = {f"loss_scaler{i}": scaler.state_dict() for i, scaler in enumerate(self.loss_scalers)}
        if self.master_weights is not None:
            state["master_weights"] = self.master_weights.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (or an apex checkpoint's ``amp`` entry)."""
        scaler_keys = sorted((k for k in state if k.startswith("loss_scaler")), key=lambda k: int(k[11:] or 0))
        unknown = [k for k in state if k not in scaler_keys and k != "master_weights"]
        if unknown:
            raise ValueError(f"unexpected key(s) {unknown} in the amp state dict; expected 'loss_scaler0', "
                             "'loss_scaler1', ... and optionally 'master_weights'")
        if len(scaler_keys) != len(self.loss_scalers):
            logger.warning("the amp state dict holds %d loss scaler(s) but amp.initialize was called with "
                           "num_losses=%d; restoring the ones both have", len(scaler_keys), len(self.loss_scalers))
        if not self.properties.uses_loss_scaling:
            # e.g. a checkpoint of apex's dynamic scaling loaded into a bfloat16 run: the scalers stay at 1.0.
            if any(state[key].get("loss_scale", 1.0) != 1.0 for key in scaler_keys):
                logger.info("amp.load_state_dict: this run does no loss scaling (%s with %s); the saved loss scale "
                            "is not used", self.properties.opt_level, self.properties.low_precision_dtype)
            scaler_keys = []
        for key in scaler_keys:
            index = int(key[len("loss_scaler"):])
            if index < len(self.loss_scalers):
                self.loss_scalers[index].load_state_dict(state[key])
        if "master_weights" in state and self.master_weights is not None:
            self.master_weights.load_state_dict(state["master_weights"])


class AmpRegistry:
    """Finds the :class:`AmpState` of an optimizer or model, and the most recent state for argument-free calls.

    apex's functions take no state argument (``amp.state_dict()``), so the module keeps one registry; the
    state itself lives in one object per ``initialize`` call. Entries are keyed weakly by the optimizers and
    models and hold their state, which refers back to them only weakly: an entry, and with the last one the
    state, disappears when its optimizer or model is collected.
    """

    def __init__(self):
        self._by_optimizer: "weakref.WeakKeyDictionary[torch.optim.Optimizer, AmpState]" = weakref.WeakKeyDictionary()
        self._by_model: "weakref.WeakKeyDictionary[nn.Module, AmpState]" = weakref.WeakKeyDictionary()
        self._latest: Optional[weakref.ref] = None

    def register(self, state: AmpState) -> None:
        for optimizer in state.optimizers:
            self._by_optimizer[optimizer] = state
        for model in state.models:
            self._by_model[model] = state
        self._latest = weakref.ref(state)

    def for_optimizer(self, optimizer: torch.optim.Optimizer) -> Optional[AmpState]:
        return self._by_optimizer.get(optimizer)

    def for_model(self, model: nn.Module) -> Optional[AmpState]:
        return self._by_model.get(model)

    def latest(self) -> Optional[AmpState]:
        """The state of the most recent ``initialize`` call, while any of its models or optimizers lives."""
        return None if self._latest is None else self._latest()

    def had_state(self) -> bool:
        """True once a state was registered (to tell "freed" from "never initialized")."""
        return self._latest is not None
