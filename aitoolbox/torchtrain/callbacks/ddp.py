"""Callbacks for distributed training: build the data loaders inside each process."""
from typing import Callable, Optional

from torch.utils.data import DataLoader

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback

LoaderFactory = Callable[[], Optional[DataLoader]]


class InMultiProcessDataLoad(AbstractCallback):
    """Create the data loaders in every process of ``fit_distributed`` instead of sending them from the parent.

    Use it for data sets that are large, hold open files, or cannot be pickled. Pass it as
    ``fit_distributed(..., in_process_data_load=InMultiProcessDataLoad(...))``: in each process, before
    training, the factories run and their loaders replace the TrainLoop's (which may then be None or small
    placeholders in the parent); the loop then splits them across the ranks as usual. Give factories, or
    subclass and override :meth:`build_train_loader` / :meth:`build_validation_loader` /
    :meth:`build_test_loader`. A factory returning None keeps the loader the TrainLoop already has.

    Args:
        train_loader_fn: returns the training DataLoader.
        validation_loader_fn: returns the validation DataLoader.
        test_loader_fn: returns the test DataLoader.
    """

    def __init__(self, train_loader_fn: Optional[LoaderFactory] = None,
                 validation_loader_fn: Optional[LoaderFactory] = None, test_loader_fn: Optional[LoaderFactory] = None):
        super().__init__("Data loading in each process", execution_order=-50)
        for name, factory in (("train_loader_fn", train_loader_fn), ("validation_loader_fn", validation_loader_fn),
                              ("test_loader_fn", test_loader_fn)):
            if factory is not None and not callable(factory):
                raise TypeError(f"{name} must be a function returning a DataLoader (or None), got {factory!r}")
        self.train_loader_fn = train_loader_fn
        self.validation_loader_fn = validation_loader_fn
        self.test_loader_fn = test_loader_fn

    def build_train_loader(self) -> Optional[DataLoader]:
        return self.train_loader_fn() if self.train_loader_fn is not None else None

    def build_validation_loader(self) -> Optional[DataLoader]:
        return self.validation_loader_fn() if self.validation_loader_fn is not None else None

    def build_test_loader(self) -> Optional[DataLoader]:
        return self.test_loader_fn() if self.test_loader_fn is not None else None

    def on_multiprocess_start(self) -> None:
        self.load_into(self.train_loop_obj)

    def load_into(self, train_loop) -> None:
        """Build the loaders and hand them to ``train_loop`` (also usable without distributed training)."""
        for attribute, build in (("train_loader", self.build_train_loader),
                                 ("validation_loader", self.build_validation_loader),
                                 ("test_loader", self.build_test_loader)):
            loader = build()
            if loader is not None:
                setattr(train_loop, attribute, loader)
