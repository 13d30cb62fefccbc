"""The job of every cell of the signal fault matrix (``test_signal_matrix.py``): a TrainLoop trained with a
checkpoint callback for :data:`NUM_EPOCHS` epochs, that pauses at the cell's moment so the test can signal it there.

Started as ``python signal_matrix_job.py '<json options>'``, or under torchrun. Options: ``folder`` (the run's
root; markers and pid files go there too), ``strategy`` (``'single'``: ``fit`` in this process; ``'ddp'``:
``fit_distributed`` with 2 CPU processes, or joining torchrun's job), ``num_workers`` (of the training loader),
``moment`` (see :class:`PauseAtMoment`; None: no pause). With ``SIGNAL_MATRIX_FAULT=file size limit`` in the
environment, the process that pauses cannot write a file of more than 1 KiB after the moment.

At the moment, rank 0 writes ``<folder>/moment`` and waits :data:`PAUSE_S` seconds: the test's signal arrives
while the job is there.
"""
import json
import os
import sys
import time
from pathlib import Path

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.model_save import ModelCheckpoint
from tests.torchtrain.distributed.support import PidFileWorkerInit, RecordPid, Regressor, make_train_loop, make_model

NUM_EPOCHS = 3
PAUSE_S = 2.0
# Under ddp every step of rank 0 lasts at least this long: the processes agree on a stop within about
# stop_agreement.CHECK_INTERVAL_S of training, which must end before the run does for the stop to be seen mid-run.
DDP_STEP_S = 0.1
MOMENTS = ("first batch", "mid-epoch", "evaluation", "checkpoint write")


class PausingRegressor(Regressor):
    """Pauses in its first evaluation batch once :attr:`pause_marker` is set (a folder: the marker goes there)."""

    pause_marker = None

    def get_loss(self, batch_data, criterion, device):
        if not self.training and self.pause_marker is not None:
            pause_here(self.pause_marker)
            self.pause_marker = None
        return super().get_loss(batch_data, criterion, device)


def pause_here(folder: str) -> None:
    if os.environ.get("SIGNAL_MATRIX_FAULT") == "file size limit":
        # From now on this process cannot write a file larger than 1 KiB (a checkpoint is ~18 KiB): the write fails
        # with OSError EFBIG, as one fails on a full disk.
        import resource
        import signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the error, not the signal that would kill the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    Path(folder, "moment").write_text(str(os.getpid()))
    time.sleep(PAUSE_S)


class PauseAtMoment(AbstractCallback):
    """Rank 0 pauses at the moment: the first batch (epoch 0, batch 0), mid-epoch (epoch 1, batch 2), the
    evaluation at epoch 1's end, or epoch 1's end checkpoint being taken (this callback's ``state_dict`` is part
    of it). Stateful (an empty state), so that every run of the matrix saves the same callback states."""

    def __init__(self, folder: str, moment=None):
        super().__init__("pause at moment")
        self.folder, self.moment = str(folder), moment
        self._armed = False

    def _rank_0(self) -> bool:
        return self.train_loop_obj.strategy.rank == 0

    def on_batch_begin(self):
        tl = self.train_loop_obj
        position = {"first batch": (0, 0), "mid-epoch": (1, 2)}.get(self.moment)
        if position == (tl.epoch, tl.iteration) and self._rank_0():
            pause_here(self.folder)

    def on_epoch_begin(self):
        if self.moment == "evaluation" and self.train_loop_obj.epoch == 1 and self._rank_0():
            self.train_loop_obj.model.pause_marker = self.folder

    def on_batch_end(self):
        if self.train_loop_obj.strategy.is_distributed:
            time.sleep(DDP_STEP_S)

    def on_epoch_end(self):  # runs before the checkpoint callbacks (execution order 100)
        self._armed = self.moment == "checkpoint write" and self.train_loop_obj.epoch == 1 and self._rank_0()

    def state_dict(self) -> dict:
        if self._armed:
            self._armed = False
            pause_here(self.folder)
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def build(folder: str, num_workers: int, gpu_mode: str, moment=None):
    """The matrix's TrainLoop and callbacks (also for the straight and resumed runs the test compares)."""
    tl = make_train_loop(make_model(PausingRegressor), shuffle=True, gpu_mode=gpu_mode)
    if num_workers:
        tl.train_loader = type(tl.train_loader)(
            tl.train_loader.dataset, batch_size=tl.train_loader.batch_size, shuffle=True,
            generator=tl.train_loader.generator, num_workers=num_workers, worker_init_fn=PidFileWorkerInit(folder))
    callbacks = [ModelCheckpoint(project_name="proj", experiment_name="exp", local_model_result_folder_path=folder),
                 PauseAtMoment(folder, moment), RecordPid(folder)]
    return tl, callbacks


def default_signal_handling() -> None:
    """The dispositions this job relies on, whatever it inherited: started by ``nohup`` (SIGHUP ignored) or in the
    background by a shell (SIGINT ignored), it would otherwise not see the signals the test sends."""
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def main(options: dict) -> None:
    default_signal_handling()
    folder, strategy = options["folder"], options["strategy"]
    tl, callbacks = build(folder, options["num_workers"], "ddp" if strategy == "ddp" else "single", options["moment"])
    if strategy == "single":
        tl.fit(num_epochs=NUM_EPOCHS, callbacks=callbacks)
    elif "RANK" in os.environ:  # a worker of torchrun's job
        tl.fit_distributed(num_epochs=NUM_EPOCHS, callbacks=callbacks)
    else:
        tl.fit_distributed(num_epochs=NUM_EPOCHS, callbacks=callbacks, num_cpu_processes=2, start_method="fork")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
