"""The random state a training loader's samplers keep themselves, saved and restored with the run's RNG state.

A resumed epoch draws its data order again from the state its samplers had at the epoch's start, so that state
must be saved. Torch generators (``sampler.generator``, the loader's ``generator``) are saved with the loader's
generators (:func:`loader_generators`). Samplers that draw from a random state of their own besides
(a bucketing sampler's ``random.Random``, a numpy ``Generator``) are saved here, for every sampler the loader
iterates (its sampler, its batch sampler and the samplers they wrap):

* a sampler with ``random_state_dict()`` and ``load_random_state_dict()`` is saved and restored through them: the
  way for a sampler whose ``state_dict`` means something else (torchdata's ``StatefulDataLoader`` takes a sampler's
  ``state_dict`` for its position in the epoch and stops fast-forwarding it);
* else a sampler with ``state_dict()`` and ``load_state_dict()`` is saved and restored through them (so that a
  sampler whose random state is out of reach can still expose it);
* otherwise its attributes that hold a ``random.Random``, a numpy ``Generator``, ``RandomState`` or bit generator,
  or a torch ``Generator`` are saved and restored by value, keyed by attribute path: looked for up to ``_DEPTH``
  attributes down through the plain objects the sampler holds (``cfg.rng``, a wrapper's ``base.rng``), since a
  random state one object down drives the order just the same;
* a random state that cannot be saved (``random.SystemRandom``, which draws from the operating system; generators
  inside a list or dict attribute; a generator more than ``_DEPTH`` attributes down, looked for a few levels
  further) is named in a warning: a resumed run will not draw that sampler's order again.

``DistributedSampler`` (and subclasses such as torchdata's ``StatefulDistributedSampler``, whose ``state_dict`` is
an iteration position, not a random state) is left out: its order follows from its seed and epoch alone.
"""
import contextlib
import functools
import itertools
import logging
import random
import types
import warnings
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

logger = logging.getLogger(__name__)

# The sharding wrappers fit_distributed adds exist only with several processes: a run resumed by another number
# of processes lacks (or has) them, which is not a change of the user's loader.
_WORLD_SIZE_SPECIFIC = ("ShardedSampler", "ShardedBatchSampler")
_ITEMS_LOOKED_AT = 8
# How many attributes down a sampler's random state is looked for (``self.cfg.rng``, ``self.base.cfg.rng``).
_DEPTH = 3
# How much further down a generator is still looked for, only to warn that its state is not saved.
_BEYOND_DEPTH = 3
_SAVEABLE = (random.Random, np.random.Generator, np.random.RandomState, np.random.BitGenerator, torch.Generator)


def loader_samplers(loader: Any) -> List[Any]:
    """The samplers iterating ``loader`` draws from, outermost first: its ``sampler`` and ``batch_sampler`` and, in
    turn, the samplers each wraps (their ``sampler`` attribute), each once."""
    found: List[Any] = []
    pending = [getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)]
    while pending:
        sampler = pending.pop(0)
        if sampler is None or not hasattr(sampler, "__iter__") or any(sampler is known for known in found):
            continue
        found.append(sampler)
        pending.append(getattr(sampler, "sampler", None))
    return found


def loader_generators(loader: Any) -> List[torch.Generator]:
    """The torch generators iterating ``loader`` draws from: the DataLoader's own and its samplers' (the sampler,
    the batch sampler and the samplers they wrap, e.g. the user's sampler inside the one ``fit_distributed`` shards
    it with)."""
    generators: List[torch.Generator] = []
    for owner in [loader] + loader_samplers(loader):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not known for known in generators):
            generators.append(generator)
    return generators


@contextlib.contextmanager
def preserved_random_states(loader: Any) -> Iterator[None]:
    """Within the block the loader's samplers may draw; afterwards their random states (the loader's torch
    generators, the samplers' own states) are as before it."""
    generators = loader_generators(loader)
    generator_states = [generator.get_state() for generator in generators]
    sampler_states = capture_sampler_states(loader, generators)
    try:
        yield
    finally:
        for generator, state in zip(generators, generator_states):
            generator.set_state(state)
        restore_sampler_states(loader, sampler_states)


def sampler_draw_states(samplers: List[Any], generators: List[torch.Generator]) -> Callable[[], None]:
    """What iterating ``samplers`` may draw from, as it is now; call the result to put it back.

    That is Python's, numpy's and torch's global random states, the torch ``generators`` (the loader's,
    :func:`loader_generators`) and each sampler's own random state: through ``random_state_dict()`` and
    ``load_random_state_dict()`` where it has them, else the random number generators its attributes hold. Not
    through a sampler's ``state_dict()``: a loader with its own state (torchdata's ``StatefulDataLoader``) reads that
    as the sampler's position in the epoch and restores it itself. Nothing is converted or written to a checkpoint:
    this is for undoing draws within one process.

    Args:
        samplers: the samplers, fixed now (a sampler standing in for one of them later is not looked into).
        generators: torch generators drawn from besides the global one.
    """
    python_state, numpy_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    generator_states = [(generator, generator.get_state()) for generator in generators]
    own_states: List[Any] = []
    for sampler in samplers:
        if _has_methods(sampler, "random_state_dict", "load_random_state_dict"):
            own_states.append((sampler.load_random_state_dict, sampler.random_state_dict()))
        elif not _has_methods(sampler, "state_dict", "load_state_dict"):
            for rng in _own_rngs(sampler, generators, warn=False, others=samplers).values():
                own_states.append((functools.partial(_set_rng_state, rng), _rng_state(rng)))

    def restore() -> None:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        torch.set_rng_state(torch_state)
        for generator, state in generator_states:
            generator.set_state(state)
        for load, state in own_states:
            load(state)

    return restore


def keyed_samplers(loader: Any) -> Dict[str, Any]:
    """The loader's samplers keyed ``<class name>:<n>`` (n counts the samplers of that class): the keys of a loader
    built the same way again, under one process or several, are the same."""
    keyed: Dict[str, Any] = {}
    for sampler in loader_samplers(loader):
        if isinstance(sampler, DistributedSampler):
            continue
        name = type(sampler).__name__
        count = sum(key.rsplit(":", 1)[0] == name for key in keyed)
        keyed[f"{name}:{count}"] = sampler
    return keyed


def _has_methods(sampler: Any, save: str, load: str) -> bool:
    return callable(getattr(sampler, save, None)) and callable(getattr(sampler, load, None))


def _rng_state(rng: Any) -> Any:
    """The state of one random number generator, in values ``torch.load(weights_only=True)`` reads."""
    if isinstance(rng, torch.Generator):
        return rng.get_state()
    if isinstance(rng, random.Random):
        return rng.getstate()
    if isinstance(rng, np.random.RandomState):
        kind, keys, position, has_gauss, gauss = rng.get_state(legacy=True)
        return [kind, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(gauss)]
    bit_generator = rng.bit_generator if isinstance(rng, np.random.Generator) else rng
    return bit_generator.state  # a dict of str and int (Python ints of any size load with weights_only)


def _set_rng_state(rng: Any, state: Any) -> None:
    if isinstance(rng, torch.Generator):
        rng.set_state(state)
    elif isinstance(rng, random.Random):
        version, internal, gauss = state
        rng.setstate((version, tuple(internal), gauss))
    elif isinstance(rng, np.random.RandomState):
        kind, keys, position, has_gauss, gauss = state
        rng.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
    else:
        (rng.bit_generator if isinstance(rng, np.random.Generator) else rng).state = state


def _own_rngs(sampler: Any, known: List[torch.Generator], warn: bool = True, others: Iterable[Any] = ()
              ) -> Dict[str, Any]:
    """The random number generators the sampler owns (not one of ``known``, the loader's torch generators, saved
    with them), keyed by attribute path: its attributes and, down to ``_DEPTH`` attributes, those of the plain
    objects it holds (``cfg.rng``, a wrapper's ``base.rng``, a mixer's ``first.generator``). Warns (``warn``)
    about those that cannot be saved, naming their path. ``others``: the loader's other samplers, not looked
    into (their states are saved under their own keys)."""
    saveable: Dict[str, Any] = {}
    # Objects looked into already (cycles, and an object reached twice) and the loader's other samplers, whose
    # states are saved under their own keys.
    seen = {id(sampler)} | {id(other) for other in others}
    pending = [("", sampler, 1)]
    while pending:
        prefix, owner, depth = pending.pop(0)
        for name, value in vars(owner).items() if hasattr(owner, "__dict__") else ():
            path = f"{prefix}{name}"
            if isinstance(value, random.SystemRandom):
                if warn:
                    _warn_unsaved(sampler, f"attribute {path!r} is a random.SystemRandom, which draws from the "
                                           "operating system and has no state to save")
            elif isinstance(value, _SAVEABLE):
                if not any(value is generator for generator in known) and id(value) not in seen:
                    seen.add(id(value))
                    saveable[path] = value
            elif isinstance(value, (list, tuple, dict)) and warn:
                # The first few items only: a sampler's list of indices may hold millions.
                items = itertools.islice(value.values() if isinstance(value, dict) else value, _ITEMS_LOOKED_AT)
                if any(isinstance(item, _SAVEABLE) for item in items):
                    _warn_unsaved(sampler, f"attribute {path!r} holds random number generators inside a "
                                           f"{type(value).__name__}, which are not saved")
            elif depth < _DEPTH and _looked_into(value) and id(value) not in seen:
                seen.add(id(value))
                pending.append((f"{path}.", value, depth + 1))
            elif warn and _looked_into(value) and id(value) not in seen:
                deeper = _generator_below(value, f"{path}.", set(seen))
                if deeper is not None:
                    _warn_unsaved(sampler, f"attribute {deeper!r} is a random number generator more than {_DEPTH} "
                                           "attributes down, where states are not looked for")
    return saveable


def _generator_below(owner: Any, prefix: str, seen: set) -> Optional[str]:
    """The path of a random number generator held below ``owner`` (beyond the depth states are saved from), or
    None: a bounded search (:data:`_BEYOND_DEPTH` levels, :data:`_ITEMS_LOOKED_AT` objects per level), so that a
    warning names what a resumed run will not draw again instead of passing it over in silence."""
    level = [(prefix, owner)]
    for _ in range(_BEYOND_DEPTH):
        below = []
        for prefix, obj in level:
            for name, value in itertools.islice(vars(obj).items(), 4 * _ITEMS_LOOKED_AT):
                if isinstance(value, _SAVEABLE):
                    return f"{prefix}{name}"
                if _looked_into(value) and id(value) not in seen:
                    seen.add(id(value))
                    below.append((f"{prefix}{name}.", value))
        level = below[:_ITEMS_LOOKED_AT]
    return None


def _looked_into(value: Any) -> bool:
    """Whether a sampler's attribute is a plain object whose own attributes may hold its random state: not a
    class, module or function (a module's attributes are its globals: ``random`` holds the global generator), not
    a dataset (its random states are augmentation, not the order, and may differ by rank on purpose), a tensor,
    an array or a torch module."""
    return hasattr(value, "__dict__") and not isinstance(value, (
        type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType, Dataset,
        torch.Tensor, np.ndarray, torch.nn.Module))


def _warn_unsaved(sampler: Any, why: str) -> None:
    warnings.warn(f"the training sampler {type(sampler).__name__} keeps a random state of its own that a checkpoint "
                  f"cannot hold: {why}. A resumed run will not draw the same data order; give "
                  f"{type(sampler).__name__} state_dict() and load_state_dict() methods that save and restore it "
                  "(or keep each generator in an attribute of its own)", UserWarning, stacklevel=4)


def capture_sampler_states(loader: Any, known_generators: Optional[List[torch.Generator]] = None) -> Dict[str, Any]:
    """The random states the samplers of ``loader`` keep themselves, keyed by sampler (see the module's description).

    Args:
        loader: the training loader.
        known_generators: torch generators saved elsewhere, not saved again; None: the loader's generators
            (:func:`loader_generators`).
    """
    if known_generators is None:
        known_generators = loader_generators(loader)
    known = list(known_generators)
    states: Dict[str, Any] = {}
    samplers = keyed_samplers(loader)
    for key, sampler in samplers.items():
        if _has_methods(sampler, "random_state_dict", "load_random_state_dict"):
            states[key] = {"random_state": sampler.random_state_dict()}
            continue
        if _has_methods(sampler, "state_dict", "load_state_dict"):
            states[key] = {"state_dict": sampler.state_dict()}
            continue
        rngs = _own_rngs(sampler, known, others=samplers.values())
        if rngs:
            states[key] = {"attributes": {name: _rng_state(rng) for name, rng in rngs.items()}}
    return states


def restore_sampler_states(loader: Any, states: Dict[str, Any]) -> None:
    """Put back what :func:`capture_sampler_states` returned into the samplers of ``loader`` (one built as the saved
    run's was); a saved sampler this loader lacks is named in a warning."""
    current = keyed_samplers(loader)
    for key, saved in states.items():
        sampler = current.get(key)
        if sampler is None:
            if key.rsplit(":", 1)[0] not in _WORLD_SIZE_SPECIFIC:
                logger.warning("the checkpoint holds the random state of the training sampler %s, which this training "
                               "loader does not have: build the loader as in the saved run for the same data order",
                               key)
            continue
        _check_saved_kind(key, sampler, saved)
        if "random_state" in saved:
            sampler.load_random_state_dict(saved["random_state"])
            continue
        if "state_dict" in saved:
            sampler.load_state_dict(saved["state_dict"])
            continue
        # Only the attributes a capture of this sampler saves now: the names come from the checkpoint, and
        # getattr of any other name ('__class__', 'data_source') would let the file write into a class every
        # sampler shares or into the user's dataset.
        rngs = _own_rngs(sampler, loader_generators(loader), warn=False, others=current.values())
        unknown = sorted(str(name) for name in saved["attributes"] if name not in rngs)
        if unknown:
            raise ValueError(f"the random state saved for the training sampler {key} names attribute(s) {unknown}, "
                             f"which are not random number generators of {type(sampler).__name__} (those are "
                             f"{sorted(rngs)}): a checkpoint restores only the generators a sampler owns. Build the "
                             "loader as in the saved run, or resume from another checkpoint")
        for name, state in saved["attributes"].items():
            _set_rng_state(rngs[name], state)


def _check_saved_kind(key: str, sampler: Any, saved: Any) -> None:
    """``saved`` is of the kind :func:`capture_sampler_states` writes for ``sampler`` (else a ``ValueError`` naming
    ``key``): a sampler is restored only through the methods or attributes its capture uses."""
    if _has_methods(sampler, "random_state_dict", "load_random_state_dict"):
        expected = "random_state"
    elif _has_methods(sampler, "state_dict", "load_state_dict"):
        expected = "state_dict"
    else:
        expected = "attributes"
    if not isinstance(saved, dict) or list(saved) != [expected] or (
            expected == "attributes" and not isinstance(saved[expected], dict)):
        shown = sorted(map(str, saved)) if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"the random state saved for the training sampler {key} is {shown}, where a "
                         f"{type(sampler).__name__} saves {{{expected!r}: ...}}: build the loader as in the saved "
                         "run, or resume from another checkpoint")
