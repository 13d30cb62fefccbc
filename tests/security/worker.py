"""Load hostile files through aitoolbox's loading entry points, in a process of its own with a memory limit.

Run as ``python -m tests.security.worker SPEC.json``. The spec names the memory limit (MiB of address space
beyond what the process holds once torch is imported and warmed up), the results file and the cases. For each case
the worker writes a ``start`` line, loads, then writes a result line (the error's type, its bases, its message and
the chain of its causes, the growth of the peak resident memory): a case that kills the process is the last one
started. See :mod:`tests.security.corpus`.
"""
import json
import os
import resource
import sys
import traceback
import warnings
from typing import Any, Callable, Dict

import torch

ENTRY_POINTS: Dict[str, Callable[[dict], Any]] = {}


def entry_point(name: str) -> Callable:
    def register(function: Callable) -> Callable:
        ENTRY_POINTS[name] = function
        return function
    return register


def _loop(cls: Any = None, *args: Any, **kwargs: Any) -> Any:
    from torch import nn
    from torch.utils.data import DataLoader

    from aitoolbox.torchtrain.train_loop import TrainLoop
    from tests.helpers import classification_data
    from tests.security.hostile import small_model

    model = small_model()
    return (cls or TrainLoop)(model, DataLoader(classification_data(8), batch_size=4), None, None,
                              torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), nn.CrossEntropyLoss(),
                              *args, show_progress=False, **kwargs)


@entry_point("file")
def _file(case: dict) -> Any:
    from aitoolbox.experiment.local_save.checkpoints import load_checkpoint_file
    return load_checkpoint_file(case["path"])


@entry_point("loop")
def _train_loop(case: dict) -> Any:
    return _loop().load_checkpoint(case["path"])


@entry_point("loader")
def _local_loader(case: dict) -> Any:
    from aitoolbox.experiment.local_load.local_model_load import PyTorchLocalModelLoader
    from tests.security.hostile import small_model

    loader = PyTorchLocalModelLoader(case["root"])
    loader.load_model_from_path(case["path"], map_location="cpu")
    return loader.init_model(small_model())  # a sharded checkpoint's weights are read here


@entry_point("loader_parts")
def _local_loader_parts(case: dict) -> Any:
    from aitoolbox.experiment.local_load.local_model_load import PyTorchLocalModelLoader
    from tests.security.hostile import small_model

    loader = PyTorchLocalModelLoader(case["root"])
    loader.load_model(case["project"], case["experiment"], case["timestamp"], "checkpoint_model", case["epoch"],
                      map_location="cpu")
    return loader.init_model(small_model())


@entry_point("continue")
def _continue_training(case: dict) -> Any:
    from aitoolbox.torchtrain.callbacks.model_load import ModelLoadContinueTraining
    loop = _loop()
    loop.callbacks_handler.register_callbacks([ModelLoadContinueTraining(saved_model_path=case["path"])])
    return loop


@entry_point("sharded")
def _sharded(case: dict) -> Any:
    from aitoolbox.experiment.local_save.sharded_checkpoints import load_sharded_checkpoint
    from tests.security.hostile import small_model
    model = small_model()
    return load_sharded_checkpoint(case["path"], model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


@entry_point("consolidate")
def _consolidate(case: dict) -> Any:
    from aitoolbox.experiment.local_save.sharded_checkpoints import read_full_model_state_dict
    return read_full_model_state_dict(case["path"])


@entry_point("auto_resume")
def _auto_resume(case: dict) -> Any:
    from aitoolbox.torchtrain.train_loop import TrainLoopCheckpoint
    loop = _loop(TrainLoopCheckpoint, case["project"], case["experiment"], case["root"], {}, auto_resume=True)
    return {"resumed_from": loop.resumed_from}


def _bucket_loader(case: dict) -> Any:
    from tests.cloud.test_1x_classes import loader_class
    return loader_class(case["service"])(case["root"], case["bucket"], case["prefix"])


@entry_point("bucket_load_model")
def _bucket_load_model(case: dict) -> Any:
    from tests.security.hostile import small_model
    loader = _bucket_loader(case)
    loader.load_model(case["project"], case["experiment"], case["timestamp"], "checkpoint_model", case["epoch"],
                      map_location="cpu")
    return loader.init_model(small_model())


@entry_point("bucket_newest")
def _bucket_newest(case: dict) -> Any:
    from tests.security.hostile import small_model
    loader = _bucket_loader(case)
    loader.load_newest_checkpoint(case["project"], case["experiment"], case["timestamp"], map_location="cpu")
    return loader.init_model(small_model())


@entry_point("bucket_auto_resume")
def _bucket_auto_resume(case: dict) -> Any:
    from aitoolbox.torchtrain.train_loop import TrainLoopCheckpoint
    loop = _loop(TrainLoopCheckpoint, case["project"], case["experiment"], case["root"], {}, auto_resume=True,
                 cloud_save_mode=case["service"], bucket_name=case["bucket"], cloud_dir_prefix=case["prefix"])
    return {"resumed_from": loop.resumed_from}


def _chain(error: BaseException) -> list:
    names, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        names.append(type(error).__name__)
        error = error.__cause__ or error.__context__
    return names


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _address_space_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) / 1024
    return 0.0


def run_case(case: dict) -> dict:
    peak = _peak_mib()
    result: Dict[str, Any] = {"id": case["id"]}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            returned = ENTRY_POINTS[case["entry"]](case)
        result["outcome"] = "loaded"
        if isinstance(returned, dict) and "resumed_from" in returned:
            result["resumed_from"] = returned["resumed_from"]
    except BaseException as error:  # noqa: BLE001 - everything is reported, the parent judges it
        result.update(outcome="error", type=type(error).__name__,
                      bases=[cls.__name__ for cls in type(error).__mro__], message=str(error)[:4000],
                      chain=_chain(error), traceback=traceback.format_exc()[-3000:])
    result["peak_growth_mib"] = _peak_mib() - peak
    result["marker"] = bool(case.get("marker")) and os.path.exists(case["marker"])
    return result


def _warm_up(spec: dict) -> None:
    """Import and run once what the cases use, so that their memory is what loading costs."""
    for name in spec.get("warm_up", []):
        run_case(dict(name, id="warm-up"))
    torch.ones(4).sum()


def main() -> None:
    with open(sys.argv[1]) as handle:
        spec = json.load(handle)
    torch.set_num_threads(1)
    _warm_up(spec)
    limit = int((_address_space_mib() + spec["memory_limit_mib"]) * 2 ** 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    with open(spec["results"], "a", buffering=1) as results:
        for case in spec["cases"]:
            results.write(json.dumps({"start": case["id"]}) + "\n")
            results.write(json.dumps(run_case(case)) + "\n")


if __name__ == "__main__":
    main()
