"""aitoolbox 1.x's local model loader: read a saved checkpoint and restore a model, optimizer, schedulers, AMP.

The checkpoint is found by the parts of the experiment folder it was saved in (:meth:`load_model`) or by its
path (:meth:`load_model_from_path`). Files written by this package and by aitoolbox 1.x are both read:

- files are read by aitoolbox's restricted reader (:mod:`~aitoolbox.experiment.local_save.safe_load`), which
  runs no code from the file; the plain data types aitoolbox 1.x checkpoints hold (numpy values,
  ``argparse.Namespace``, paths, dates in the hyperparameters) are accepted too. A file holding other Python
  objects is refused with :class:`~aitoolbox.experiment.local_save.safe_load.UntrustedCheckpointError` naming it
  and the refused types; ``weights_only=False`` loads it with full unpickling, which runs whatever code the file
  names: only for files you trust. A damaged file raises
  :class:`~aitoolbox.experiment.local_save.safe_load.CorruptCheckpointError`.
- the ``init_*`` methods name the file in what does not fit
  (:class:`~aitoolbox.experiment.local_save.safe_load.CheckpointMismatchError`: another model's weights, ...).
- a file of this package's first format (``model`` / ``optimizers`` entries) is read with aitoolbox 1.x's
  entry names (``model_state_dict``, ``optimizer_state_dict``, ...); every other entry is kept as it is.
"""
import os
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any, List, Optional

import torch

from aitoolbox.experiment.local_save.checkpoints import (
    MODEL_KEY, OPTIMIZER_KEY, SCHEDULERS_KEY, SHARDED_CHECKPOINT_KEY, SHARDED_IDENTITY_KEY, failures_named,
    load_checkpoint_file)
from aitoolbox.experiment.local_save.folder_create import ExperimentFolder
from aitoolbox.experiment.local_save.local_model_save import model_file_name

# Besides its own names, ``import *`` gives what it gave in aitoolbox 1.x, whose modules had no __all__ (1.x
# scripts and tests use e.g. ``os`` and ``datetime`` after ``from <module> import *``).
__all__ = ["AbstractLocalModelLoader", "PyTorchLocalModelLoader",
           "os", "OrderedDict", "torch", "ExperimentFolder"]

DATA_PARALLEL_PREFIX = "module."


class AbstractLocalModelLoader(ABC):
    """The interface of local model loaders (e.g. ``custom_local_loader_class`` of ModelLoadContinueTraining)."""

    @abstractmethod
    def load_model(self, project_name: str, experiment_name: str, experiment_timestamp: str, model_save_dir: str,
                   epoch_num: Optional[int] = None, **kwargs: Any) -> Any:
        """Load the model saved in the experiment folder.

        Args:
            project_name: the project folder's name.
            experiment_name: the experiment's name.
            experiment_timestamp: the run's timestamp.
            model_save_dir: the sub-folder of the run folder holding the model (``checkpoint_model``, ``model``).
            epoch_num: the epoch of the checkpoint; None for the final model.
            **kwargs: options of the particular loader.

        Returns:
            The loaded model representation.
        """


class PyTorchLocalModelLoader(AbstractLocalModelLoader):
    """Load a PyTorch checkpoint dict and put its states into a model, optimizer, LR schedulers, AMP scaler.

    Call :meth:`load_model` (or :meth:`load_model_from_path`) first, then the ``init_*`` methods.

    Args:
        local_model_result_folder_path: the folder that holds the projects (``~`` is expanded).

    Attributes:
        model_representation: the loaded checkpoint dict; None before loading.
    """

    def __init__(self, local_model_result_folder_path: str):
        self.local_model_result_folder_path = os.path.expanduser(local_model_result_folder_path)
        self.model_representation: Optional[dict] = None
        self._loaded_from: Optional[str] = None  # the file or folder it was read from, named in errors

    def load_model(self, project_name: str, experiment_name: str, experiment_timestamp: str,
                   model_save_dir: str = "checkpoint_model", epoch_num: Optional[int] = None,
                   map_location: Any = None, iteration_idx: Optional[int] = None, *,
                   weights_only: bool = True) -> dict:
        """Load ``<root>/<project>/<experiment>_<timestamp>/<model_save_dir>/model_<...>[_E<epoch_num>].pth``.

        Args:
            project_name: the project folder's name.
            experiment_name: the experiment's name.
            experiment_timestamp: the run's timestamp.
            model_save_dir: ``'checkpoint_model'`` (checkpoints) or ``'model'`` (the final model).
            epoch_num: the epoch of the checkpoint; None for the final model ``model_<experiment>_<timestamp>.pth``.
            map_location: where to put the tensors (``torch.load``'s argument); None keeps the saved devices.
            iteration_idx: with ``epoch_num``, load the mid-epoch checkpoint ``..._E<epoch_num>_ITER<iteration_idx>``.
            weights_only: False unpickles the file fully, which runs whatever code it names: only for files you
                trust.

        Returns:
            The checkpoint dict (also kept as :attr:`model_representation`); an empty
            ``schedulers_state_dict`` list is added when the file has none.

        Raises:
            UntrustedCheckpointError: the file holds objects only full unpickling can build (nothing was run).
            FileNotFoundError: there is no such file.
            CorruptCheckpointError: the file is truncated, damaged, not a torch file, or holds no
                ``model_state_dict`` (a ``RuntimeError`` and a ``ValueError``).
        """
        _, experiment_path = ExperimentFolder.get_base_folder_paths(
            project_name, experiment_name, experiment_timestamp, self.local_model_result_folder_path)
        name = model_file_name(experiment_name, experiment_timestamp, epoch_num, iteration_idx)
        return self.load_model_from_path(os.path.join(experiment_path, model_save_dir, name), map_location,
                                         weights_only=weights_only)

    def load_model_from_path(self, model_path: str, map_location: Any = None, *, weights_only: bool = True) -> dict:
        """Load the checkpoint file ``model_path`` (or the newest checkpoint of a run or checkpoint folder).

        Args:
            model_path: the file, or a folder (see :func:`~aitoolbox.experiment.local_save.checkpoints.find_checkpoint`).
            map_location: where to put the tensors (``torch.load``'s argument); None keeps the saved devices.
            weights_only: False unpickles the file fully, which runs whatever code it names: only for files you
                trust.

        Returns:
            The checkpoint dict, as :meth:`load_model`.

        Raises:
            UntrustedCheckpointError / CorruptCheckpointError / FileNotFoundError: as :meth:`load_model`.
        """
        checkpoint = load_checkpoint_file(model_path, map_location=map_location, weights_only=weights_only)
        checkpoint.setdefault(SCHEDULERS_KEY, [])  # files older than scheduler saving have none
        self.model_representation = checkpoint
        self._loaded_from = checkpoint.get(SHARDED_CHECKPOINT_KEY, model_path)
        return checkpoint

    def check_if_model_loaded(self) -> None:
        """Raise ValueError unless a checkpoint has been loaded."""
        if self.model_representation is None:
            raise ValueError("No checkpoint has been loaded yet: call load_model() or load_model_from_path() first")

    def init_model(self, model: torch.nn.Module, used_data_parallel: bool = False) -> torch.nn.Module:
        """Load the checkpoint's model weights into ``model`` (strictly: every key must match).

        Args:
            model: the model, built as when it was saved.
            used_data_parallel: the weights were saved from a ``DataParallel`` / ``DistributedDataParallel``
                wrapper: their ``module.`` key prefix is removed.

        Returns:
            ``model``.

        Raises:
            CheckpointMismatchError: the weights do not fit ``model`` (torch's ``load_state_dict`` message follows
                the file's name).
        """
        self.check_if_model_loaded()
        if MODEL_KEY not in self.model_representation and SHARDED_CHECKPOINT_KEY in self.model_representation:
            # A sharded (FSDP) run's checkpoint: its weights are gathered into this process only now.
            from aitoolbox.experiment.local_save.sharded_checkpoints import read_full_model_state_dict
            self.model_representation[MODEL_KEY] = read_full_model_state_dict(
                self.model_representation[SHARDED_CHECKPOINT_KEY],
                expected_identity=self.model_representation.get(SHARDED_IDENTITY_KEY))
        state_dict = self.model_representation[MODEL_KEY]
        if used_data_parallel:
            state_dict = {key[len(DATA_PARALLEL_PREFIX):] if key.startswith(DATA_PARALLEL_PREFIX) else key: value
                          for key, value in state_dict.items()}
        with failures_named(self._loaded_from):  # another model's weights: the error names the file
            model.load_state_dict(state_dict)
        return model

    def init_optimizer(self, optimizer: Any, device: str = "cuda") -> Any:
        """Load the checkpoint's optimizer state into ``optimizer``.

        Args:
            optimizer: a ``torch.optim`` optimizer, a MultiOptimizer, or a list of optimizers (for a
                checkpoint that saved several).
            device: accepted for aitoolbox 1.x compatibility: ``load_state_dict`` already moves the state to the
                device of the optimizer's parameters.

        Returns:
            ``optimizer``.

        Raises:
            KeyError: the checkpoint holds no optimizer state.
            ValueError: the number of saved optimizer states and of given optimizers differ.
        """
        self.check_if_model_loaded()
        state = self.model_representation.get(OPTIMIZER_KEY)
        if state is None:
            raise KeyError(f"the checkpoint holds no {OPTIMIZER_KEY!r}: the optimizer cannot be restored from it")
        if SHARDED_CHECKPOINT_KEY in self.model_representation:
            raise ValueError(f"{self.model_representation[SHARDED_CHECKPOINT_KEY]} is a sharded (FSDP) checkpoint: "
                             "its optimizer states are keyed by parameter name and load together with the model. "
                             "Continue training with TrainLoop.load_checkpoint(path) or ModelLoadContinueTraining")
        if isinstance(optimizer, (list, tuple)):
            states = state if isinstance(state, (list, tuple)) else [state]
            if len(states) != len(optimizer):
                raise ValueError(f"the checkpoint holds {len(states)} optimizer state(s) and {len(optimizer)} "
                                 "optimizer(s) were given: pass as many optimizers as were saved")
            with failures_named(self._loaded_from):
                for single, single_state in zip(optimizer, states):
                    single.load_state_dict(single_state)
        elif isinstance(state, (list, tuple)) and isinstance(optimizer, torch.optim.Optimizer):
            if len(state) != 1:
                raise ValueError(f"the checkpoint holds {len(state)} optimizer states and one optimizer was given: "
                                 "pass a MultiOptimizer or a list of the optimizers")
            with failures_named(self._loaded_from):
                optimizer.load_state_dict(state[0])
        else:
            with failures_named(self._loaded_from):
                optimizer.load_state_dict(state)  # one optimizer, or a MultiOptimizer with its list of states
        return optimizer

    def init_scheduler(self, scheduler_callbacks_list: List[Any], ignore_saved: bool = False,
                       ignore_missing_saved: bool = False) -> List[Any]:
        """Load the checkpoint's LR scheduler states into the scheduler callbacks, in order.

        Args:
            scheduler_callbacks_list: the scheduler callbacks (subclasses of ``AbstractScheduler``), in the
                order they were registered when the checkpoint was saved.
            ignore_saved: when the checkpoint holds scheduler states but no schedulers are given, go on instead of
                raising.
            ignore_missing_saved: when schedulers are given but the checkpoint holds no states, leave them as they
                are instead of raising.

        Returns:
            ``scheduler_callbacks_list``.

        Raises:
            KeyError: schedulers given, none saved, and not ``ignore_missing_saved``.
            ValueError: states saved, no schedulers given, and not ``ignore_saved``; or the counts differ.
            TypeError: a given scheduler is not an ``AbstractScheduler``.
        """
        self.check_if_model_loaded()
        saved_states = self.model_representation.get(SCHEDULERS_KEY) or []
        if not saved_states and scheduler_callbacks_list:
            if ignore_missing_saved:
                return scheduler_callbacks_list
            raise KeyError(f"the checkpoint holds no scheduler states and {len(scheduler_callbacks_list)} "
                           "scheduler(s) were given: pass ignore_missing_saved=True to start them afresh")
        if saved_states and not scheduler_callbacks_list:
            if ignore_saved:
                return scheduler_callbacks_list
            raise ValueError(f"the checkpoint holds {len(saved_states)} scheduler state(s) and no schedulers were "
                             "given: add the schedulers, or pass ignore_saved=True to leave the states unused")
        if len(saved_states) != len(scheduler_callbacks_list):
            raise ValueError(f"the checkpoint holds {len(saved_states)} scheduler state(s) and "
                             f"{len(scheduler_callbacks_list)} scheduler(s) were given: they must match one to one")
        for scheduler, state in zip(scheduler_callbacks_list, saved_states):
            # Files and results know no callbacks: anything that loads a state dict is a scheduler here.
            if not callable(getattr(scheduler, "load_state_dict", None)):
                raise TypeError(f"{type(scheduler).__name__} is not a scheduler callback: it has no load_state_dict "
                                "(use the schedulers of aitoolbox.torchtrain.schedulers)")
            with failures_named(self._loaded_from):
                scheduler.load_state_dict(state)
        return scheduler_callbacks_list

    def init_amp(self, amp_scaler: Any) -> Any:
        """Load the checkpoint's AMP GradScaler state (entry ``amp``) into ``amp_scaler``.

        Returns:
            ``amp_scaler``.

        Raises:
            KeyError: the checkpoint was saved without AMP and holds no scaler state.
        """
        self.check_if_model_loaded()
        if "amp" not in self.model_representation:
            raise KeyError("the checkpoint holds no AMP scaler state ('amp'): it was saved by training without AMP")
        with failures_named(self._loaded_from):
            amp_scaler.load_state_dict(self.model_representation["amp"])
        return amp_scaler
