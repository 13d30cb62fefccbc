"""Callbacks for distributed training: build the data loaders inside each process, set the samplers' epoch."""
from typing import Any, Callable, Optional, Union

from torch.utils.data import DataLoader

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback

LoaderFactory = Callable[[], Optional[DataLoader]]
# A factory, or aitoolbox 1.x's True: "call the (overridden) build_*_dataloader method".
LoaderSource = Union[LoaderFactory, bool, None]


class DistributedSamplerSetEpoch(AbstractCallback):
    """Call ``set_epoch(epoch)`` on the given samplers at the start of every epoch (before other callbacks).

    ``fit_distributed`` already does this for every sampler of the training loader (a ``DistributedSampler`` of
    your own too); use this callback for samplers it does not see, e.g. those of evaluation loaders you iterate
    yourself, so that each epoch shuffles differently.

    Args:
        train_sampler: the training loader's sampler, or None.
        validation_sampler: the validation loader's sampler, or None.
        test_sampler: the test loader's sampler, or None.
    """

    def __init__(self, train_sampler: Any, validation_sampler: Any, test_sampler: Any):
        super().__init__("set_epoch of the DistributedSamplers at the start of each epoch", execution_order=-100)
        self.train_sampler = train_sampler
        self.validation_sampler = validation_sampler
        self.test_sampler = test_sampler

    def on_epoch_begin(self) -> None:
        for sampler in (self.train_sampler, self.validation_sampler, self.test_sampler):
            if sampler is not None:
                sampler.set_epoch(self.train_loop_obj.epoch)


def _check_source(name: str, source: LoaderSource) -> None:
    if source is not None and not isinstance(source, bool) and not callable(source):
        raise TypeError(f"{name} must be a function returning a DataLoader, True (to call the overridden build "
                        f"method) or None, got {source!r}")


class InMultiProcessDataLoad(AbstractCallback):
    """Create the data loaders in every process of ``fit_distributed`` instead of sending them from the parent.

    Use it for data sets that are large, hold open files, or cannot be pickled. Pass it as
    ``fit_distributed(..., in_process_data_load=InMultiProcessDataLoad(...))``: in each process, before
    training, the factories run and their loaders replace the TrainLoop's (which may then be None or small
    placeholders in the parent); the loop then splits them across the ranks as usual.

    Give factories, or (aitoolbox 1.x style) pass ``True`` and override :meth:`build_train_dataloader` /
    :meth:`build_val_dataloader` / :meth:`build_test_dataloader` in a subclass. A source left None (or False),
    or a factory returning None, keeps the loader the TrainLoop already has.

    Args:
        train_loader_build_fn: returns the training DataLoader.
        val_loader_build_fn: returns the validation DataLoader (or a dict of named ones: several validation sets).
        test_loader_build_fn: returns the test DataLoader.
        train_loader_fn: another name of ``train_loader_build_fn``.
        validation_loader_fn: another name of ``val_loader_build_fn``.
        test_loader_fn: another name of ``test_loader_build_fn``.

    Raises:
        TypeError: a source that is not a function, a bool or None, or one given under both of its names.
    """

    def __init__(self, train_loader_build_fn: LoaderSource = None, val_loader_build_fn: LoaderSource = None,
                 test_loader_build_fn: LoaderSource = None, *, train_loader_fn: Optional[LoaderFactory] = None,
                 validation_loader_fn: Optional[LoaderFactory] = None, test_loader_fn: Optional[LoaderFactory] = None):
        super().__init__("Data loading in each process", execution_order=-50)
        sources = {}
        for name, value, alias, alias_value in (
                ("train_loader_build_fn", train_loader_build_fn, "train_loader_fn", train_loader_fn),
                ("val_loader_build_fn", val_loader_build_fn, "validation_loader_fn", validation_loader_fn),
                ("test_loader_build_fn", test_loader_build_fn, "test_loader_fn", test_loader_fn)):
            if value is not None and alias_value is not None:
                raise TypeError(f"pass {name} or {alias} (the same argument), not both")
            source = value if value is not None else alias_value
            _check_source(alias if alias_value is not None else name, source)
            sources[name] = source
        self.train_loader_build_fn = sources["train_loader_build_fn"]
        self.val_loader_build_fn = sources["val_loader_build_fn"]
        self.test_loader_build_fn = sources["test_loader_build_fn"]

    @staticmethod
    def _call(source: LoaderSource) -> Optional[DataLoader]:
        return source() if callable(source) else None

    def build_train_dataloader(self) -> Optional[DataLoader]:
        """The training loader (override in a subclass and pass ``train_loader_build_fn=True``)."""
        return self._call(self.train_loader_build_fn)

    def build_val_dataloader(self) -> Optional[DataLoader]:
        """The validation loader (override in a subclass and pass ``val_loader_build_fn=True``)."""
        return self._call(self.val_loader_build_fn)

    def build_test_dataloader(self) -> Optional[DataLoader]:
        """The test loader (override in a subclass and pass ``test_loader_build_fn=True``)."""
        return self._call(self.test_loader_build_fn)

    def on_multiprocess_start(self) -> None:
        self.load_into(self.train_loop_obj)

    def load_into(self, train_loop: Any) -> None:
        """Build the loaders and hand them to ``train_loop`` (also usable without distributed training)."""
        for attribute, source, build in (
                ("train_loader", self.train_loader_build_fn, self.build_train_dataloader),
                ("validation_loader", self.val_loader_build_fn, self.build_val_dataloader),
                ("test_loader", self.test_loader_build_fn, self.build_test_dataloader)):
            if source in (None, False):
                continue
            loader = build()
            if loader is not None:
                setattr(train_loop, attribute, loader)
