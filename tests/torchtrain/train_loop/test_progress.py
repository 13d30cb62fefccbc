"""Progress bars: the terminal bars, and in a Jupyter notebook widgets that leave no trace of the transient
(evaluation) bars in the saved notebook."""
import ast
import os
import pathlib
import re
import textwrap

import pytest

from aitoolbox.torchtrain.train_loop import progress
from aitoolbox.torchtrain.train_loop.progress import ProgressBar, draws_widgets, iterate_with_progress

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_terminal_bars_are_not_widgets_and_transient_ones_clear_their_line(capsys, monkeypatch):
    assert not draws_widgets()  # pytest is no notebook
    monkeypatch.setattr(progress, "writes_to_terminal", lambda: True)
    assert list(iterate_with_progress(range(3), 3, "Loss validation", enabled=True)) == [0, 1, 2]
    kept = ProgressBar(2, "Epoch 0", enabled=True)
    kept.update(lambda: {"loss": 0.5})
    kept.update()
    kept.set_postfix({"loss": 0.25})
    kept.close()
    kept.close()  # a second close does nothing
    lines = capsys.readouterr().err.split("\r")
    assert lines[-1].startswith("Epoch 0: 100%") and "loss=0.25" in lines[-1]  # the kept bar, finished
    assert not any(line.startswith("Loss validation") for line in lines[-3:])  # the transient one was wiped


def test_output_to_a_file_shows_no_transient_bars_and_few_redraws(capsys, monkeypatch):
    """Review of issue 35, friction 6: stderr to a file or pipe (pytest's capture is one) gets no evaluation bars
    (each redraw would stay in the log) and the epoch's bar at most every LOG_FILE_INTERVAL_S."""
    assert not progress.writes_to_terminal()
    monkeypatch.setattr(progress, "DRAW_INTERVAL_S", 0.0)  # every step reaches tqdm
    assert list(iterate_with_progress(range(50), 50, "Loss validation", enabled=True)) == list(range(50))
    kept = ProgressBar(50, "Epoch 1/1", enabled=True)
    for _ in range(50):
        kept.update(lambda: {"loss": 0.5})
    kept.close()
    err = capsys.readouterr().err
    assert "Loss validation" not in err
    redraws = [line for line in re.split(r"[\r\n]", err) if line.startswith("Epoch 1/1")]
    assert len(redraws) == 2 and redraws[-1].startswith("Epoch 1/1: 100%"), redraws  # the start and the end


class FakeClock:
    """``time`` for the progress module: ``monotonic`` returns :attr:`now` (which the test advances) and counts
    its reads."""

    def __init__(self):
        self.now, self.reads = 1000.0, 0

    def monotonic(self) -> float:
        self.reads += 1
        return self.now


def test_a_bar_reads_the_clock_a_few_times_a_draw_interval_not_at_every_step(monkeypatch):
    """A tiny model's batch notices a clock read (issue 32's per-batch cost): at a steady pace the bar reads it about
    CLOCK_READS_PER_DRAW times a draw interval, and still hands its steps to tqdm about every DRAW_INTERVAL_S."""
    clock = FakeClock()
    monkeypatch.setattr(progress, "time", clock)
    monkeypatch.setattr(progress, "writes_to_terminal", lambda: True)
    bar = ProgressBar(2000, "Epoch 1/1", enabled=True)
    handed = []  # (fake time, steps) of each update tqdm gets
    tqdm_update = bar._bar.update
    bar._bar.update = lambda steps: (handed.append((clock.now, steps)), tqdm_update(steps))
    for _ in range(2000):  # one step a millisecond: 50 steps a draw interval
        clock.now += 0.001
        bar.update()
    assert clock.reads <= 2000 // 4, clock.reads  # (each step read it: 2000)
    gaps = [later - earlier for (earlier, _), (later, _) in zip(handed, handed[1:])]
    assert gaps[0] <= 2 * progress.DRAW_INTERVAL_S  # before the pace is known: the steps between reads double
    assert len(gaps) >= 30 and max(gaps[1:]) <= progress.DRAW_INTERVAL_S * (1 + 1 / progress.CLOCK_READS_PER_DRAW) \
        + 0.0011
    bar.close()
    assert sum(steps for _, steps in handed) == 2000


def test_a_disabled_bar_does_nothing(capsys):
    bar = ProgressBar(None, "off", enabled=False)
    bar.update(lambda: pytest.fail("the postfix of a disabled bar is never computed"))
    bar.set_postfix({"loss": 1.0})
    bar.close()
    assert list(iterate_with_progress(iter("ab"), None, "off", enabled=False)) == ["a", "b"]
    assert capsys.readouterr().err == ""


NOTEBOOK_CELLS = [
    """
    import torch
    from torch import nn
    from torch.utils.data import DataLoader
    from aitoolbox.experiment.result_package.basic_packages import ClassificationResultPackage
    from aitoolbox.torchtrain.callbacks.performance_eval import ModelPerformanceEvaluation
    from aitoolbox.torchtrain.train_loop import TrainLoop
    from aitoolbox.torchtrain.train_loop.progress import draws_widgets
    from tests.helpers import MLP, classification_data
    from ipywidgets import Widget
    assert draws_widgets(), "tqdm.auto draws text bars in this kernel"
    created = []
    Widget.on_widget_constructed(created.append)
    torch.manual_seed(0)
    model = MLP()
    tl = TrainLoop(model, DataLoader(classification_data(24), batch_size=8),
                   DataLoader(classification_data(16, seed=1), batch_size=8),
                   DataLoader(classification_data(16, seed=2), batch_size=8),
                   torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    """,
    """
    tl.fit(num_epochs=2, callbacks=[ModelPerformanceEvaluation(ClassificationResultPackage())])
    """,
    """
    predictions = tl.predict_on_test_set(force_prediction=True)
    print("validation loss", float(tl.evaluate_loss_on_validation_set(force_prediction=True)))
    """,
    """
    # ipywidgets keeps every widget until it is closed: only the epoch bars' widgets may still be open.
    def tree(widget):
        yield widget
        for part in list(getattr(widget, "children", ())) + [getattr(widget, "layout", None),
                                                             getattr(widget, "style", None)]:
            if isinstance(part, Widget):
                yield from tree(part)

    open_bars = [w for w in created if type(w).__name__ == "TqdmHBox" and w.comm is not None]
    in_open_bars = {part.model_id for bar in open_bars for part in tree(bar)}
    stray = [type(w).__name__ for w in created if w.comm is not None and w.model_id not in in_open_bars]
    print("OPEN BARS", sorted(bar.model_id for bar in open_bars), "STRAY", stray, "CREATED", len(created))
    """,
]
EPOCH_BARS = 2
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


@pytest.mark.slow
@pytest.mark.extended
def test_transient_bars_leave_nothing_in_the_saved_notebook(tmp_path):
    pytest.importorskip("ipywidgets")
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(textwrap.dedent(source).strip()) for source in NOTEBOOK_CELLS])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    client = nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3", store_widget_state=True,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=env)  # raises CellExecutionError with the cell's traceback on failure
    path = tmp_path / "saved.ipynb"
    nbformat.write(notebook, str(path))
    saved = nbformat.read(str(path), as_version=4)
    nbformat.validate(saved)

    outputs = [output for cell in saved.cells for output in cell.outputs]
    text = "\n".join(str(output) for output in outputs)
    assert "validation loss" in text and "Epoch 1/2" in text  # the run itself printed
    assert not re.search(r"(Loss|Predict) (train|validation|test)", text), text
    views = [output["data"][WIDGET_VIEW]["model_id"] for output in outputs
             if output["output_type"] == "display_data" and WIDGET_VIEW in output["data"]]
    assert len(views) == EPOCH_BARS  # the epoch bars stay: widgets whose state is saved with the notebook
    assert set(views) <= set(saved.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"])
    # What is left of a transient bar's display is an output without content, which shows nothing.
    emptied = [output for output in outputs if output["output_type"] == "display_data" and not output["data"]]
    # An epoch's evaluation passes share one transient bar (validation loss and predictions), then the third cell's two.
    assert len(emptied) >= EPOCH_BARS + 2
    # The transient bars' widgets are closed: a frontend saving its live widget state saves none of them (nbclient
    # itself saves the state of every widget ever opened), and the kernel holds none of them any more.
    report = re.search(r"OPEN BARS (\[.*?\]) STRAY (\[.*?\]) CREATED (\d+)", text)
    assert sorted(views) == ast.literal_eval(report.group(1)) and ast.literal_eval(report.group(2)) == []
    assert int(report.group(3)) > 11 * EPOCH_BARS  # the transient bars made widgets too
