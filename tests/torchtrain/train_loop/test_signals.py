"""SIGTERM during a plain ``fit`` with gradient accumulation, in a real process: training finishes the accumulation
window up to its optimizer step, and no further, before the resumable checkpoint is written. Ctrl-C ends the script
as Python ends one on an uncaught Ctrl-C: by SIGINT (the shell's 130), not with status 1.

Every other signal, recipient, moment and strategy is a cell of the fault matrix
(``tests/torchtrain/distributed/test_signal_matrix.py``)."""
import glob
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.torchtrain.distributed.support import script_env

SCRIPT = textwrap.dedent("""
    import os
    import signal
    import sys

    if os.environ.get("IMPORT_DYNAMO_FIRST"):  # torch's exit handlers are then registered before aitoolbox's
        import torch._dynamo  # noqa: F401

    from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
    from aitoolbox.torchtrain.callbacks.model_save import ModelCheckpoint
    from tests.torchtrain.distributed.support import make_train_loop


    class SignalInBatch(AbstractCallback):
        '''Sends the signal to this very process while batch ``iteration`` of ``epoch`` is being trained.'''

        def __init__(self, signum, epoch, iteration):
            super().__init__("signal in batch")
            self.signum, self.epoch, self.iteration = signum, epoch, iteration
            self.batches_after = 0

        def on_batch_begin(self):
            tl = self.train_loop_obj
            if (tl.epoch, tl.iteration) == (self.epoch, self.iteration):
                os.kill(os.getpid(), self.signum)
            elif (tl.epoch, tl.iteration) > (self.epoch, self.iteration):
                self.batches_after += 1
                print(f"trained batch {tl.iteration} of epoch {tl.epoch} after the signal", flush=True)


    if __name__ == "__main__":
        # The handling this test relies on, whatever was inherited (nohup ignores SIGHUP, a background job SIGINT).
        for name in ("SIGTERM", "SIGHUP"):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        folder, signum, grad_accumulation = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        tl = make_train_loop(shuffle=True)
        checkpoint = ModelCheckpoint(project_name="proj", experiment_name="exp", local_model_result_folder_path=folder)
        try:
            tl.fit(num_epochs=3, callbacks=[checkpoint, SignalInBatch(signum, 1, 2)],
                   grad_accumulation=grad_accumulation)
        finally:
            print("finally ran", flush=True)
""")


def run_until_signal(tmp_path, signum: int, grad_accumulation: int = 1, dynamo_first: bool = False):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(script_env(), **({"IMPORT_DYNAMO_FIRST": "1"} if dynamo_first else {}))
    result = subprocess.run([sys.executable, str(script), str(tmp_path), str(signum), str(grad_accumulation)],
                            env=env, capture_output=True, text=True, timeout=120)
    return result, sorted(glob.glob(str(tmp_path / "proj" / "exp_*" / "checkpoint_model" / "*ITER*.pth")))


@pytest.mark.slow
def test_with_gradient_accumulation_the_stop_waits_for_the_optimizer_step(tmp_path):
    result, saved = run_until_signal(tmp_path, signal.SIGTERM, grad_accumulation=4)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    # Windows of 4 batches: batch 2 is inside 0-3, so training goes on to batch 3 (iteration 11), and no further.
    assert len(saved) == 1 and saved[0].endswith("_E1_ITER11.pth")
    assert "trained batch 3 of epoch 1 after the signal" in result.stdout
    assert "trained batch 4" not in result.stdout


@pytest.mark.parametrize("dynamo_first", [False, True])
def test_ctrl_c_ends_the_script_by_sigint_as_python_does(tmp_path, dynamo_first):
    """An uncaught KeyboardInterrupt ends a Python script by SIGINT, so that its shell sees 130 and a shell loop
    stops; torch's exit handler (once an optimizer has stepped) made it exit with status 1, as a failure. Also
    where the script imports torch._dynamo (or calls torch.compile) before aitoolbox (review of issue 33, stop 40)."""
    result, saved = run_until_signal(tmp_path, signal.SIGINT, dynamo_first=dynamo_first)
    assert result.returncode == -signal.SIGINT, (result.returncode, result.stderr[-3000:])
    assert "KeyboardInterrupt" in result.stderr and "finally ran" in result.stdout
    assert saved == []  # Ctrl-C writes no resumable checkpoint


AFTER_THE_STOP = textwrap.dedent("""
    import os
    import signal
    import time

    from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
    from aitoolbox.torchtrain.train_loop.interrupts import SignalStop
    from tests.torchtrain.distributed.support import make_train_loop


    class SigtermAtBatch(AbstractCallback):
        def __init__(self):
            super().__init__("SIGTERM at batch 2")

        def on_batch_begin(self):
            if self.train_loop_obj.total_iteration_idx == 2:
                os.kill(os.getpid(), signal.SIGTERM)


    if __name__ == "__main__":
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        tl = make_train_loop(shuffle=True)
        tl._interrupts.grace_s = 0.5  # the kill that bounds a stop comes this long after the signal
        try:
            tl.fit(num_epochs=2, callbacks=[SigtermAtBatch()])
        except SignalStop:
            print("stopped", flush=True)
        time.sleep(2.0)  # the process goes on after fit (a notebook, a test suite, an upload)
        print("alive", flush=True)
""")


def test_the_grace_periods_kill_is_called_off_once_training_has_stopped(tmp_path):
    """The deadline that kills a process whose stop takes longer than ``grace_s`` kept running after training had
    stopped: a process going on after the stopped fit (a notebook, the test suite itself) was SIGKILLed ``grace_s``
    after the signal."""
    script = tmp_path / "after_the_stop.py"
    script.write_text(AFTER_THE_STOP)
    result = subprocess.run([sys.executable, str(script)], env=script_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "stopped" in result.stdout and "alive" in result.stdout, result.stderr[-2000:]
