"""The random numbers iterating a training loader draws from, as a checkpoint keeps them.

:func:`capture_draw_state` takes Python's, numpy's and torch's (CPU and CUDA) random states and those of the
loader's data order (its torch generators, the random states its samplers keep themselves); :func:`restore_draw_state`
puts them back. Every value is one ``torch.load(weights_only=True)`` accepts (:func:`weights_only_safe`). The run's
whole random state (:func:`~.train_state.capture_rng_state`) adds the loader's persistent worker iterator
(:mod:`.data_position`), which itself undoes draws with these two.
"""
import random
from typing import Any, List, Optional

import numpy as np
import torch

from aitoolbox.torchtrain.data.sampler_state import capture_sampler_states, loader_generators, restore_sampler_states


def weights_only_safe(value: Any) -> Any:
    """``value`` with numpy scalars and arrays (e.g. metrics computed by scikit-learn) turned into Python numbers
    and tensors, which ``torch.load(weights_only=True)`` accepts; containers are converted recursively."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy()) if value.dtype != object else value.tolist()
    if isinstance(value, dict):
        return {key: weights_only_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        converted = [weights_only_safe(item) for item in value]
        return converted if isinstance(value, list) else tuple(converted)
    return value


def capture_draw_state(loader: Any = None, generators: Optional[List[torch.Generator]] = None) -> dict:
    """The random states of this process and of ``loader``'s data order, as weights-only-loadable values.

    Args:
        loader: the training loader (None: the process's states only).
        generators: ``loader``'s torch generators (:func:`loader_generators`) where the caller has them already
            (an epoch's start: its samplers are not walked twice); None: looked up here.
    """
    numpy_kind, numpy_keys, numpy_pos, numpy_has_gauss, numpy_gauss = np.random.get_state()
    if generators is None:
        generators = loader_generators(loader) if loader is not None else []
    state = {
        "python": random.getstate(),
        "numpy": [numpy_kind, torch.from_numpy(numpy_keys.astype(np.int64)), int(numpy_pos), int(numpy_has_gauss),
                  float(numpy_gauss)],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else [],
        "loader_generators": [generator.get_state() for generator in generators],
    }
    if loader is not None:
        samplers = capture_sampler_states(loader, generators)
        if samplers:
            state["samplers"] = weights_only_safe(samplers)
    return state


def restore_draw_state(state: dict, loader: Any = None) -> None:
    """Put back what :func:`capture_draw_state` returned (other keys of ``state`` are left alone)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    generators = loader_generators(loader) if loader is not None else []
    if len(generators) != len(state["loader_generators"]):
        raise ValueError(f"the checkpoint holds {len(state['loader_generators'])} train-loader generator state(s), "
                         f"the train loader has {len(generators)}: build the DataLoader as in the original run")
    for generator, generator_state in zip(generators, state["loader_generators"]):
        generator.set_state(generator_state)
    if loader is not None:  # (states saved before this key existed hold none)
        restore_sampler_states(loader, state.get("samplers", {}))
