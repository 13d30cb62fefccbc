"""Train a Vision Transformer in full precision or one of three mixed precision modes, on one process or many.

The configuration file chooses the precision (``AMP``: the TrainLoop's ``use_amp``) and every size.
The same script runs under every launcher:

* plain Python (one process):            python train.py --config config/config_AMP_torch.py
* aitoolbox's own launcher (N processes): python train.py --config config/config_AMP_torch.py --nproc 2
* torchrun:     python -m torch.distributed.run --nproc_per_node 2 train.py --config config/config_AMP_torch.py
* SLURM:        srun --ntasks-per-node 2 python train.py --config config/config_AMP_torch.py
* OpenMPI:      mpirun -np 2 -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=29500 python train.py --config ...

Under torchrun, SLURM or OpenMPI each process finds its rank in the environment and ``fit_distributed``
joins that job instead of starting processes. See README.md.
"""
import argparse
import ast
import os
import runpy
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from aitoolbox.torchtrain.distributed.environment import current_external_placement
from aitoolbox.torchtrain.train_loop import TrainLoop
from vit import build_model, synthetic_loaders

REQUIRED_KEYS = ("NAME", "AMP", "BATCH_SIZE", "NUM_EPOCHS", "LEARNING_RATE", "WEIGHT_DECAY", "NUM_TRAIN_SAMPLES",
                 "NUM_TEST_SAMPLES", "NUM_CLASSES", "IMAGE_SIZE", "PATCH_SIZE", "HIDDEN_SIZE", "DEPTH", "NUM_HEADS")


def load_config(path: str, overrides: Sequence[str] = ()) -> Dict[str, object]:
    """The upper-case names a configuration file defines, with ``KEY=VALUE`` overrides applied.

    Raises:
        FileNotFoundError: no such file.
        KeyError: the file lacks a required setting.
        ValueError: an override is not ``KEY=VALUE`` with a Python literal value.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"configuration file {path!r} not found; the ones shipped are in config/")
    config = {key: value for key, value in runpy.run_path(path).items() if key.isupper()}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.isupper():
            raise ValueError(f"override {item!r} must look like KEY=VALUE, e.g. NUM_EPOCHS=2")
        try:
            config[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"override {item!r}: {value!r} is not a Python literal (number, string, dict, ...)") \
                from None
    missing = [key for key in REQUIRED_KEYS if key not in config]
    if missing:
        raise KeyError(f"{path} does not define {missing}")
    return config


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a configuration file, e.g. config/config_AMP_torch.py")
    parser.add_argument("--nproc", type=int, default=1,
                        help="processes to start with fit_distributed (GPUs, or CPU processes without CUDA); "
                             "ignored under torchrun / SLURM / OpenMPI, which start the processes themselves")
    parser.add_argument("--epochs", type=int, default=None, help="override NUM_EPOCHS")
    parser.add_argument("--batch-size", type=int, default=None, help="override BATCH_SIZE")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any setting of the configuration file (repeatable), e.g. --set DEPTH=2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    args = parser.parse_args(argv)
    if args.epochs is not None:
        args.overrides.append(f"NUM_EPOCHS={args.epochs}")
    if args.batch_size is not None:
        args.overrides.append(f"BATCH_SIZE={args.batch_size}")
    return args


def make_train_loop(config: dict, seed: int, show_progress: bool) -> TrainLoop:
    """The model, data and optimizer of a configuration, in a TrainLoop with the configuration's precision."""
    torch.manual_seed(seed)
    train_loader, test_loader = synthetic_loaders(config, seed)
    model = build_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["LEARNING_RATE"], weight_decay=config["WEIGHT_DECAY"])
    # end_auto_eval=False: no full pass over the training set after every epoch (only the running loss).
    return TrainLoop(model, train_loader, None, test_loader, optimizer, nn.CrossEntropyLoss(),
                     end_auto_eval=False, use_amp=config["AMP"], show_progress=show_progress)


def launcher_name(nproc: int) -> str:
    placement = current_external_placement()
    if placement is not None:
        return f"{placement.launcher}, {placement.world_size} processes"
    return "plain python" if nproc <= 1 else f"fit_distributed, {nproc} processes"


def main(argv: Optional[Sequence[str]] = None) -> List[float]:
    args = parse_args(argv)
    config = load_config(args.config, args.overrides)
    tl = make_train_loop(config, args.seed, not args.no_progress)
    how = launcher_name(args.nproc)

    if current_external_placement() is not None:
        tl.fit_distributed(num_epochs=config["NUM_EPOCHS"])  # joins the job torchrun / SLURM / OpenMPI started
    elif args.nproc > 1:
        tl.fit_distributed(num_epochs=config["NUM_EPOCHS"],
                           num_gpus=args.nproc if torch.cuda.is_available() else None, num_cpu_processes=args.nproc)
    else:
        tl.fit(num_epochs=config["NUM_EPOCHS"])

    # Under a joined job every process takes part (each predicts its share); the others just return.
    y_pred, y_true, _ = tl.predict_on_test_set()
    accuracy = (y_pred == y_true).float().mean().item()
    if tl.is_main_process:
        losses = tl.train_history["accumulated_loss"]
        print(f"[{config['NAME']}] launcher: {how}; precision: {tl.precision}")
        print(f"[{config['NAME']}] final training loss: {losses[-1]:.4f}")
        print(f"[{config['NAME']}] Test accuracy: {accuracy:.4f} ({len(y_true)} images)", flush=True)
    if dist.is_initialized():
        dist.barrier()  # leave together: tearing down gloo while a peer still works can abort it
        dist.destroy_process_group()
    return [accuracy]


if __name__ == "__main__":
    main()
