"""Float32 master weights for a model cast to low precision (apex O2).

The optimizer is given float32 copies ("masters") of the model's low-precision parameters in place of the
parameters themselves, so its update arithmetic and its state stay in float32. Gradients flow the other way:
the model's low-precision gradients are converted (and unscaled) into the masters' ``.grad``; after every
``optimizer.step()`` a step post-hook copies the masters back into the model.
"""
import weakref
from typing import List, Optional, Sequence, Tuple

import torch

GradPair = Tuple[torch.Tensor, torch.Tensor]  # (parameter backward writes to, parameter the optimizer steps)


def is_low_precision(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and tensor.dtype != torch.float32 and tensor.dtype != torch.float64


class _OptimizerMasters:
    """The master bookkeeping of one optimizer."""

    __slots__ = ("pairs", "model_versions", "installed_groups")

    def __init__(self):
        self.pairs: List[GradPair] = []
        self.model_versions: List[int] = []
        self.installed_groups = 0


class MasterWeights:
    """Puts float32 masters into optimizers and keeps them in step with the model.

    The optimizers are held weakly (each one holds this object through its step hook): the bookkeeping of an
    optimizer, its masters included, goes when the optimizer is collected.

    Args:
        optimizers: the optimizers of the model, already holding the model's (cast) parameters.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]):
        self._by_optimizer: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _OptimizerMasters]" = \
            weakref.WeakKeyDictionary()
        for optimizer in optimizers:
            self._by_optimizer[optimizer] = _OptimizerMasters()
            self._install_new_groups(optimizer)
            optimizer.register_step_post_hook(self._after_step)

    def _install_new_groups(self, optimizer: torch.optim.Optimizer) -> None:
        """Give the low-precision parameters of groups not seen yet float32 masters.

        Runs at construction and again whenever masters are needed, so that a group added with
        ``optimizer.add_param_group`` after ``amp.initialize`` is handled like apex's patched
        ``add_param_group`` handled it (without patching): its low-precision parameters get masters, its
        float32 parameters are stepped as they are, and the gradients of both are unscaled.
        """
        record = self._by_optimizer[optimizer]
        if len(optimizer.param_groups) == record.installed_groups:
            return
        new_pairs = []
        for group in optimizer.param_groups[record.installed_groups:]:
            for position, param in enumerate(group["params"]):
                if is_low_precision(param):
                    master = param.detach().clone().float().requires_grad_(param.requires_grad)
                    if param in optimizer.state:
                        optimizer.state[master] = optimizer.state.pop(param)
                    group["params"][position] = master
                    new_pairs.append((param, master))
                else:
                    new_pairs.append((param, param))
        record.pairs.extend(new_pairs)
        record.model_versions.extend(model._version for model, _ in new_pairs)
        record.installed_groups = len(optimizer.param_groups)

    @property
    def optimizers(self) -> List[torch.optim.Optimizer]:
        """The optimizers holding masters (those still alive), in construction order."""
        return list(self._by_optimizer.keys())

    def manages(self, optimizer: torch.optim.Optimizer) -> bool:
        return optimizer in self._by_optimizer

    def grad_pairs(self, optimizer: torch.optim.Optimizer) -> List[GradPair]:
        """``(model parameter, stepped parameter)`` pairs of the optimizer; the two are the same for float32."""
        self._install_new_groups(optimizer)
        self._sync_masters_if_model_changed(optimizer)
        return self._by_optimizer[optimizer].pairs

    def model_parameters(self, optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
        """The model's parameters of the optimizer, as they are: the masters are not refreshed from them (clearing
        gradients must not take a write the model has for now, such as an average swapped in, for the weights)."""
        self._install_new_groups(optimizer)
        return [model for model, _ in self._by_optimizer[optimizer].pairs]

    def _record_versions(self, optimizer: torch.optim.Optimizer) -> None:
        record = self._by_optimizer[optimizer]
        record.model_versions = [model._version for model, _ in record.pairs]

    def _sync_masters_if_model_changed(self, optimizer: torch.optim.Optimizer) -> None:
        """Refresh masters from the model when something else wrote the model's weights (e.g. load_state_dict).

        Without this, the next step would overwrite the loaded weights with stale masters. Every in-place
        write bumps a tensor's version counter, and the only write we expect is our own copy after a step.
        A write that leaves the model at its master's rounding (e.g. ``model.load_state_dict`` after
        ``amp.load_state_dict`` from the same checkpoint) keeps the more precise master, so restoring does
        not depend on the order of the loads.
        """
        record = self._by_optimizer[optimizer]
        changed = [(model, master) for (model, master), version in zip(record.pairs, record.model_versions)
                   if model is not master and model._version != version]
        if changed:
            with torch.no_grad():
                for model, master in changed:
                    if not torch.equal(model, master.to(model.dtype)):
                        master.copy_(model)
            self._record_versions(optimizer)

    def _after_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        with torch.no_grad():
            for model, master in self._by_optimizer[optimizer].pairs:
                if model is not master:
                    model.copy_(master)
        self._record_versions(optimizer)

    def state_dict(self) -> List[List[torch.Tensor]]:
        """The masters' values, per optimizer in construction order (float32 tensors)."""
        optimizers = self.optimizers
        for optimizer in optimizers:
            self._install_new_groups(optimizer)
        return [[master.detach().clone() for model, master in self._by_optimizer[optimizer].pairs
                 if model is not master] for optimizer in optimizers]

    def load_state_dict(self, state: List[List[torch.Tensor]]) -> None:
        """Restore the masters exactly and copy each into its model parameter, unless that parameter was written
        since the last step (a checkpoint's model state loaded, WeightAveraging's average swapped in): it keeps
        what was written, and the next step adopts it or not as for any other write (see
        :meth:`_sync_masters_if_model_changed`)."""
        optimizers = self.optimizers
        for optimizer in optimizers:
            self._install_new_groups(optimizer)
        if len(state) != len(optimizers):
            raise ValueError(f"the checkpoint holds master weights for {len(state)} optimizer(s), "
                             f"this run has {len(optimizers)}")
        with torch.no_grad():
            for optimizer, saved in zip(optimizers, state):
                masters = [(model, master) for model, master in self._by_optimizer[optimizer].pairs
                           if model is not master]
                if len(saved) != len(masters):
                    raise ValueError(f"the checkpoint holds {len(saved)} master weights for an optimizer that "
                                     f"has {len(masters)}: was it saved from the same model and opt_level?")
                record = self._by_optimizer[optimizer]
                written = {id(model) for (model, master), version in zip(record.pairs, record.model_versions)
                           if model is not master and model._version != version}
                for (model, master), value in zip(masters, saved):
                    master.copy_(value)
                    if id(model) not in written:
                        model.copy_(master)
                # Only the parameters copied into are recorded: a written one stays a write for the next step.
                record.model_versions = [version if id(model) in written else model._version
                                         for (model, _), version in zip(record.pairs, record.model_versions)]


def unscale_into(pairs: Sequence[GradPair], inverse_scaler) -> bool:
    """Move the gradients of the model parameters into the stepped parameters, divided by the loss scale.

    A low-precision gradient is converted to float32 and added to its master's ``.grad``; a float32
    gradient is unscaled in place. Returns True if any gradient holds inf or NaN.

    Args:
        pairs: from :meth:`MasterWeights.grad_pairs`, or ``(p, p)`` pairs without master weights.
        inverse_scaler: the :class:`LossScaler` whose scale to divide by, or None for no scaling.
    """
    moved: List[Tuple[torch.Tensor, torch.Tensor]] = []
    for model, stepped in pairs:
        grad = model.grad
        if grad is None:
            continue
        if grad.is_sparse and grad.dtype == torch.float16:
            # As torch.amp.GradScaler: summing the duplicate indices of a float16 sparse gradient may overflow, so
            # the check must see the coalesced values.
            grad = model.grad = grad.coalesce()
        if model is stepped:
            moved.append((stepped, grad))
        else:
            moved.append((stepped, grad.float()))
            model.grad = None
    found_inf = False
    if inverse_scaler is not None:
        found_inf = inverse_scaler.unscale_grads([grad for _, grad in moved])
    for stepped, grad in moved:
        if stepped.grad is None:
            stepped.grad = grad
        elif stepped.grad is not grad:
            stepped.grad.add_(grad)
    return found_inf


def clear_grads(params: Sequence[torch.Tensor]) -> None:
    """Set gradients to None: every torch optimizer skips parameters without gradients, so a step is a no-op."""
    for param in params:
        param.grad = None


def optimizer_pairs(optimizer: torch.optim.Optimizer, master_weights: Optional[MasterWeights]) -> List[GradPair]:
    """Gradient pairs of an optimizer, with or without master weights."""
    if master_weights is not None and master_weights.manages(optimizer):
        return master_weights.grad_pairs(optimizer)
    return [(p, p) for group in optimizer.param_groups for p in group["params"]]
