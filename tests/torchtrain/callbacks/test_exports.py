"""Every public callback class is importable from ``aitoolbox.torchtrain.callbacks`` (issue 35, item 7).

The test walks the modules of the callbacks package and of the LR schedulers package (whose schedulers are
callbacks), so a callback added later without its export fails here rather than in a user's import.
"""
import importlib
import inspect
import pkgutil

import aitoolbox.torchtrain.callbacks as callbacks_package
import aitoolbox.torchtrain.schedulers as schedulers_package
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback


def public_callback_classes() -> dict:
    """``{name: class}`` of every public callback class defined in a module of the callbacks or schedulers package."""
    found = {}
    modules = [(package, module_info.name) for package in (callbacks_package, schedulers_package)
               for module_info in pkgutil.iter_modules(package.__path__)]
    for package, module_name in modules:
        if module_name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{module_name}")
        for name, value in vars(module).items():
            if name.startswith("_") or not inspect.isclass(value) or not issubclass(value, AbstractCallback):
                continue
            if value.__module__ == module.__name__:  # defined here, not imported from elsewhere
                found[name] = value
    return found


def test_the_walk_finds_the_callbacks_of_every_kind():
    names = set(public_callback_classes())
    # A sample of each module's callbacks: the walk would pass vacuously if it found nothing.
    assert {"ModelCheckpoint", "ModelIterationCheckpoint", "ModelTrainEndSave", "TensorboardTrainBatchLoss",
            "EarlyStopping", "CSVLogger", "InMultiProcessDataLoad", "ModelLoadContinueTraining",
            "GradientStatsPrint", "ListRegisteredCallbacks", "StepLRScheduler", "CosineWithWarmupScheduler"} <= names


def test_every_public_callback_class_is_exported_from_the_package():
    missing = sorted(name for name in public_callback_classes()
                     if getattr(callbacks_package, name, None) is not public_callback_classes()[name])
    assert missing == [], f"not importable from aitoolbox.torchtrain.callbacks: {missing}"
    not_in_all = sorted(set(public_callback_classes()) - set(callbacks_package.__all__))
    assert not_in_all == [], f"missing from aitoolbox.torchtrain.callbacks.__all__: {not_in_all}"


def test_the_issue_s_imports_work():
    from aitoolbox.torchtrain.callbacks import ModelCheckpoint, TensorboardTrainBatchLoss  # noqa: F401


def test_the_scheduler_callbacks_import_from_the_callbacks_package():
    """The docs say every callback imports from here: the LR scheduler callbacks too (review of issue 35, D10)."""
    from aitoolbox.torchtrain.callbacks import (  # noqa: F401
        ConstantWithWarmupScheduler, CosineWithWarmupScheduler, GeneralLRSchedulerCallback,
        HardRestartsCosineWithWarmupScheduler, LambdaLRScheduler, MultiStepLRScheduler, StepLRScheduler)
