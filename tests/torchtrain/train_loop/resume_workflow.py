"""Train, crash, and resume in a new process: the runs test_resume.py compares bitwise.

Run as a module from the repository root it does one phase for every case of a list
(``python -m tests.torchtrain.train_loop.resume_workflow <phase> <work dir> <case names...>``), so that the
whole matrix costs two Python start-ups:

* ``first``: the uninterrupted run of NUM_EPOCHS epochs, then the same run crashed after ``Case.crash_at``
  batches (an exception from a callback, after its checkpoints) -- the process then exits, so only the files
  carry the run on.
* ``resume``: a fresh TrainLoop, the newest checkpoint of the crashed run loaded (by ``tl.load_checkpoint`` or
  by :class:`ModelLoadContinueTraining`), trained to NUM_EPOCHS.

Each run's outcome (weights, O2 master weights, loss scaler, history, counters) is saved with torch.save for the
test to compare. The model has dropout and the training loader shuffles, from its own seeded generator or from
the global RNG, so the RNG states in the checkpoint matter; so does the state of the LR scheduler, which steps
after every optimizer step. For the dynamically scaled modes an inf gradient is injected at OVERFLOW_AT, so the
loss scale in the checkpoint is not its initial value and one step is skipped.
"""
import dataclasses
import os
import random
import sys
from typing import Dict, List

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.model_load import ModelLoadContinueTraining
from aitoolbox.torchtrain.schedulers.basic import LambdaLRScheduler
from aitoolbox.torchtrain.train_loop import TrainLoopCheckpoint
from tests.helpers import MLP, classification_data

NUM_EPOCHS = 3
NUM_SAMPLES = 34  # batches of 4: 9 per epoch, the last one of 2 samples (an odd count, for grad_accumulation=2)
BATCH_SIZE = 4
ITERATION_SAVE_FREQ = 4
OVERFLOW_AT = 2  # total iteration index whose gradients are made inf under dynamic loss scaling
PROJECT = "resume"

# JSON (and the command line) cannot carry a dtype: the precision is chosen by name.
PRECISIONS = {
    "fp32": False,
    # Dynamic scaling asked for explicitly: bfloat16 (the CPU's type) is not scaled by default, and the resume
    # must restore the scale's state too.
    "O1": {"opt_level": "O1", "loss_scale": "dynamic"},
    "O2": {"opt_level": "O2", "loss_scale": "dynamic"},
    "fp16": {"opt_level": "O1", "dtype": torch.float16},
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One crash-and-resume scenario.

    Attributes:
        precision: a key of PRECISIONS.
        seeded_loader: the training loader shuffles with its own seeded generator (else with the global RNG).
        crash_at: batches trained in total when the run crashes.
        iteration_checkpoints: also checkpoint every ITERATION_SAVE_FREQ iterations (resume mid-epoch).
        grad_accumulation: optimizer step every this many batches.
        load: 'load_checkpoint' (tl.load_checkpoint(run folder)), 'callback_path'
            (ModelLoadContinueTraining(saved_model_path=...)) or 'callback_parts' (the aitoolbox 1.x arguments).
        compiled: train with ``torch_compile`` (the deterministic ``aot_eager`` backend): both runs compile in
            their own process, the resumed one from the loaded state.
    """

    precision: str
    seeded_loader: bool = True
    crash_at: int = 9 + 9 + 3  # inside the third epoch: the newest checkpoint is the end of the second
    iteration_checkpoints: bool = False
    grad_accumulation: int = 1
    load: str = "load_checkpoint"
    compiled: bool = False

    @property
    def name(self) -> str:
        parts = [self.precision, "gen" if self.seeded_loader else "global", f"crash{self.crash_at}"]
        if self.iteration_checkpoints:
            parts.append("iter")
        if self.grad_accumulation > 1:
            parts.append(f"acc{self.grad_accumulation}")
        if self.load != "load_checkpoint":
            parts.append(self.load)
        if self.compiled:
            parts.append("compiled")
        return "-".join(parts)


CASES: List[Case] = (
    [Case(precision, seeded) for precision in PRECISIONS for seeded in (True, False)]
    + [Case(precision, crash_at=9 + 7, iteration_checkpoints=True) for precision in PRECISIONS]
    + [Case("fp32", seeded_loader=False, crash_at=9 + 6, iteration_checkpoints=True, grad_accumulation=2),
       Case("fp16", crash_at=9 + 6, iteration_checkpoints=True, grad_accumulation=2),
       Case("O2", crash_at=7, iteration_checkpoints=True, grad_accumulation=2),
       Case("fp32", load="callback_path"),
       Case("O1", crash_at=9 + 7, iteration_checkpoints=True, load="callback_parts"),
       Case("fp32", compiled=True),
       Case("O1", crash_at=9 + 7, iteration_checkpoints=True, compiled=True),
       Case("O2", crash_at=7, iteration_checkpoints=True, grad_accumulation=2, compiled=True)]
)
COMPILE_OPTIONS = {"backend": "aot_eager"}
CASES_BY_NAME: Dict[str, Case] = {case.name: case for case in CASES}


class SimulatedCrash(Exception):
    """Raised from a callback to end a run abruptly (as a killed process would), after its checkpoints."""


class CrashAt(AbstractCallback):
    """Raise SimulatedCrash when ``crash_at`` batches have been trained in total."""

    def __init__(self, crash_at: int):
        super().__init__("crash", execution_order=1000)  # after every checkpoint callback
        self.crash_at = crash_at

    def on_batch_end(self):
        if self.train_loop_obj.total_iteration_idx + 1 == self.crash_at:
            raise SimulatedCrash(f"crashed after {self.crash_at} batches")


class InjectOverflow(AbstractCallback):
    """Make the gradients of batch OVERFLOW_AT inf when a dynamic loss scaler is on (the step is skipped).

    The inf is written by a gradient hook during backward, where a real overflow arises: under master
    weights the backward pass itself moves the gradients into the masters and checks them.
    """

    def __init__(self):
        super().__init__("inject overflow")
        self._hook = None

    def on_batch_begin(self):
        tl = self.train_loop_obj
        scaler = tl.precision.loss_scaler
        if tl.total_iteration_idx == OVERFLOW_AT and scaler is not None and scaler.dynamic:
            self._hook = next(tl.model.parameters()).register_hook(self._overflow)

    @staticmethod
    def _overflow(grad):
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    def on_after_gradient_update(self, optimizer_idx):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def seed_everything(seed: int = 0) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build(case: Case, root: str, experiment: str) -> TrainLoopCheckpoint:
    """The TrainLoop of ``case``, with the same initial weights and RNG state every time."""
    seed_everything()
    model = MLP()
    generator = torch.Generator().manual_seed(7) if case.seeded_loader else None
    train = DataLoader(classification_data(NUM_SAMPLES), batch_size=BATCH_SIZE, shuffle=True, generator=generator)
    validation = DataLoader(classification_data(12, seed=20), batch_size=5)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return TrainLoopCheckpoint(model, train, validation, None, optimizer, nn.CrossEntropyLoss(),
                               project_name=PROJECT, experiment_name=experiment,
                               local_model_result_folder_path=root, hyperparams={"case": case.name},
                               iteration_save_freq=ITERATION_SAVE_FREQ if case.iteration_checkpoints else 0,
                               use_amp=PRECISIONS[case.precision], show_progress=False,
                               torch_compile=COMPILE_OPTIONS if case.compiled else False)


def lr_decay(step: int) -> float:
    """The LR factor after ``step`` optimizer steps: a resumed schedule that restarted at 0 would differ."""
    return 0.95 ** step


def training_callbacks() -> List[AbstractCallback]:
    return [LambdaLRScheduler(lr_decay, execute_epoch_end=False, execute_batch_end=True), InjectOverflow()]


def outcome(tl: TrainLoopCheckpoint) -> dict:
    """What must agree bitwise between the uninterrupted and the resumed run."""
    precision = tl.precision
    return {
        "model": {k: v.detach().clone() for k, v in tl.model.state_dict().items()},
        "raw_params": [p.detach().clone() for p in tl.model.parameters()],
        "masters": precision.master_weights.state_dict() if precision.master_weights is not None else [],
        "loss_scaler": precision.loss_scaler.state_dict() if precision.loss_scaler is not None else None,
        "optimizer": tl.optimizers[0].state_dict(),
        "train_history": tl.train_history.get_train_history_dict(),
        "counters": [tl.epoch, tl.epochs_completed, tl.total_iteration_idx],
        "lr": [group["lr"] for group in tl.optimizers[0].param_groups],
        "compiles": tl.compile_stats.compiles if tl.compile_stats is not None else 0,
    }


def run_first(case: Case, work_dir: str) -> dict:
    """The uninterrupted run, then the crashed one; returns the uninterrupted outcome."""
    root = os.path.join(work_dir, case.name)
    tl = build(case, root, "straight")
    tl.fit(num_epochs=NUM_EPOCHS, callbacks=training_callbacks(), grad_accumulation=case.grad_accumulation)
    straight = outcome(tl)
    tl = build(case, root, "crashed")
    try:
        tl.fit(num_epochs=NUM_EPOCHS, callbacks=training_callbacks() + [CrashAt(case.crash_at)],
               grad_accumulation=case.grad_accumulation)
    except SimulatedCrash:
        pass
    else:  # pragma: no cover - the case is wrong
        raise AssertionError(f"{case.name}: the run did not crash")
    return straight


def crashed_run_folder(case: Case, work_dir: str) -> str:
    project = os.path.join(work_dir, case.name, PROJECT)
    (folder,) = [name for name in os.listdir(project) if name.startswith("crashed_")]
    return os.path.join(project, folder)


def run_resume(case: Case, work_dir: str) -> dict:
    """In a new process: load the crashed run's newest checkpoint and train to NUM_EPOCHS."""
    run_folder = crashed_run_folder(case, work_dir)
    tl = build(case, os.path.join(work_dir, case.name), "resumed")
    callbacks = training_callbacks()
    if case.load == "load_checkpoint":
        tl.load_checkpoint(run_folder)
    elif case.load == "callback_path":
        callbacks.append(ModelLoadContinueTraining(saved_model_path=run_folder))
    else:
        timestamp = os.path.basename(run_folder)[len("crashed_"):]
        callbacks.append(ModelLoadContinueTraining(timestamp, project_name=PROJECT, experiment_name="crashed",
                                                   local_model_result_folder_path=os.path.join(work_dir, case.name)))
    tl.fit(num_epochs=NUM_EPOCHS, callbacks=callbacks, grad_accumulation=case.grad_accumulation)
    return outcome(tl)


def main(argv: List[str]) -> None:
    phase, work_dir, names = argv[0], argv[1], argv[2:]
    torch.set_num_threads(1)  # tiny models: more threads only contend for the cores; both phases run alike
    run = {"first": run_first, "resume": run_resume}[phase]
    results = {name: run(CASES_BY_NAME[name], work_dir) for name in names}
    torch.save(results, os.path.join(work_dir, f"{phase}.pt"))


if __name__ == "__main__":
    main(sys.argv[1:])
