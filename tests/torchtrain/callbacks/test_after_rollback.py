"""What the monitoring callbacks write when SpikeRollback rolls the run back (issue 34.6): ProfilerCallback records
no more cycles than ``repeat``; CSVLogger's and TensorBoard's logs hold the run's final trajectory once, each batch
and epoch a single time, with the rollback marked as an event."""
import csv
import math
import os

import pytest

from aitoolbox.torchtrain.callbacks import CSVLogger, ProfilerCallback, SpikeRollback
from tests.helpers import MLP, model_pair, single_torch_thread
from tests.torchtrain.callbacks.test_spike_rollback import (
    SETTINGS, Poisoned, loader, make_loop, poisoned_at, reference_loader, train)

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")

# The spike (a NaN loss) at batch 17 (epoch 1, position 5), found at the check of batch 19: the run returns to batch
# 14 and trains 47 batches in all (12 an epoch, one left out).
POISON = dict(by_epoch=poisoned_at(1, 5), scale=float("nan"))
TRAINED = 47


def test_the_profiler_records_no_more_cycles_than_repeat_across_a_rollback(tmp_path):
    """Its two cycles (wait 1, warm-up 1, active 2: batches 1-3 and 5-7) lie after the only point kept (the fit's
    start) and before the spike found at the end of epoch 0: the replay must not record them again."""
    model, _ = model_pair(MLP)
    profiler = ProfilerCallback(wait=1, warmup=1, active=2, repeat=2, output_dir=str(tmp_path / "traces"))
    spike = SpikeRollback(**dict(SETTINGS, snapshot_every=100))  # the only point: the fit's start
    tl = train(make_loop(model, loader(Poisoned(poisoned_at(0, 10), scale=float("nan")))), num_epochs=2,
               callbacks=[spike, profiler])
    assert [(record["restored"]["epoch"], record["restored"]["iteration"]) for record in tl.rollbacks] == [(0, -1)]
    assert profiler.cycles_done == 2
    assert len(os.listdir(tmp_path / "traces")) == 2 == len(profiler.trace_files)


def read_csv(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_the_csv_logs_hold_the_final_trajectory_once_and_mark_the_rollback(tmp_path):
    model, twin = model_pair(MLP)
    logger = CSVLogger(log_dir=str(tmp_path), is_project=False)
    tl = train(make_loop(model, loader(Poisoned(**POISON))), callbacks=[SpikeRollback(**SETTINGS), logger])
    train(make_loop(twin, reference_loader(Poisoned(), {1: {5}})),
          callbacks=[CSVLogger(log_dir=str(tmp_path / "reference"), is_project=False)])
    rows = read_csv(tmp_path / "batch_log.csv")
    assert [int(row["total_iteration"]) for row in rows] == list(range(TRAINED))
    assert not any(math.isnan(float(row["loss"])) for row in rows)
    expected = read_csv(tmp_path / "reference" / "batch_log.csv")
    assert [row["loss"] for row in rows] == [row["loss"] for row in expected]  # the final trajectory itself
    events = [(int(row["total_iteration"]), row["event"]) for row in rows if row.get("event")]
    assert len(events) == 1 and events[0][0] == 15  # the first batch trained after the point returned to
    assert "rollback" in events[0][1] and "epoch 2, iteration 5" in events[0][1]
    epochs = read_csv(tmp_path / "epoch_log.csv")
    assert [int(row["epoch"]) for row in epochs] == [0, 1, 2, 3]
    assert [row["accumulated_loss"] for row in epochs] == [row["accumulated_loss"]
                                                           for row in read_csv(tmp_path / "reference" / "epoch_log.csv")]
    assert [float(row["rollbacks"]) for row in epochs] == [0, 1, 0, 0]
    assert tl.rollbacks[0]["restored"] == {"epoch": 1, "iteration": 2}


def test_tensorboard_shows_the_final_trajectory_once_and_the_rollback_as_an_event(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from aitoolbox.torchtrain.callbacks.tensorboard import TensorboardFullTracking
    model, twin = model_pair(MLP)
    tracker = TensorboardFullTracking(log_dir=str(tmp_path / "tb"), is_project=False)
    train(make_loop(model, loader(Poisoned(**POISON))), callbacks=[SpikeRollback(**SETTINGS), tracker])
    reference_tracker = TensorboardFullTracking(log_dir=str(tmp_path / "reference"), is_project=False)
    train(make_loop(twin, reference_loader(Poisoned(), {1: {5}})), callbacks=[reference_tracker])

    def read(folder):
        events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
        events.Reload()
        return events

    events, expected = read(tmp_path / "tb"), read(tmp_path / "reference")
    losses = [(event.step, event.value) for event in events.Scalars("train_loss/last_batch_loss")]
    assert [step for step, _ in losses] == list(range(TRAINED))
    assert losses == [(event.step, event.value) for event in expected.Scalars("train_loss/last_batch_loss")]
    assert [event.step for event in events.Scalars("loss/accumulated_loss")] == [0, 1, 2, 3]
    marks = events.Scalars("rollbacks/count")
    assert [(mark.step, mark.value) for mark in marks] == [(15, 1.0)]
    assert "rollbacks" in "".join(events.Tags()["tensors"])  # the text describing it


def two_rollbacks_to_one_point(tmp_path, *trackers):
    """NaN losses at positions 5 and 7 of epoch 1, one check interval: the first rollback returns to batch 14 and
    leaves out position 5; the replay spikes at position 7 and returns to batch 14 again."""
    order = poisoned_at(1, 5)[1] + poisoned_at(1, 7)[1]
    model, _ = model_pair(MLP)
    tl = train(make_loop(model, loader(Poisoned({1: order}, scale=float("nan")))),
               callbacks=[SpikeRollback(**SETTINGS)] + list(trackers))
    assert [record["restored"] for record in tl.rollbacks] == [{"epoch": 1, "iteration": 2}] * 2
    return tl


def test_two_rollbacks_to_the_same_point_are_both_marked_in_the_csv_logs(tmp_path):
    two_rollbacks_to_one_point(tmp_path, CSVLogger(log_dir=str(tmp_path), is_project=False))
    rows = read_csv(tmp_path / "batch_log.csv")
    events = [(int(row["total_iteration"]), row["event"]) for row in rows if row.get("event")]
    assert len(events) == 1 and events[0][0] == 15
    assert events[0][1].count("rollback") == 2 and "epoch 2, iteration 5" in events[0][1]


def test_tensorboard_keeps_both_texts_of_two_rollbacks_to_the_same_point(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from aitoolbox.torchtrain.callbacks.tensorboard import TensorboardFullTracking
    tracker = TensorboardFullTracking(log_dir=str(tmp_path / "tb"), is_project=False)
    two_rollbacks_to_one_point(tmp_path, tracker)
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    texts = [event for tag in events.Tags()["tensors"] if "rollbacks" in tag for event in events.Tensors(tag)]
    text = texts[-1]  # the newest at the step is the one shown (whether the reader hides the purged one or not)
    assert text.step == 15 and text.tensor_proto.string_val[0].decode().count("rollback") == 2



def test_tensorboard_logs_a_replayed_epoch_end_once_per_tag(tmp_path):
    """A rollback across an epoch's end (the point in epoch 0, the NaN at epoch 1, position 1): the replayed epoch
    end is logged once per tag, though its timings differ."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from aitoolbox.torchtrain.callbacks import ThroughputMonitor
    from aitoolbox.torchtrain.callbacks.tensorboard import TensorboardFullTracking
    model, _ = model_pair(MLP)
    again = TensorboardFullTracking(log_dir=str(tmp_path / "across"), is_project=False)
    tl = train(make_loop(model, loader(Poisoned(poisoned_at(1, 1), scale=float("nan")))),
               callbacks=[SpikeRollback(**SETTINGS), ThroughputMonitor(), again])
    assert tl.rollbacks[0]["restored"]["epoch"] == 0
    events = EventAccumulator(str(tmp_path / "across"), size_guidance={"scalars": 0})
    events.Reload()
    epoch_tags = [tag for tag in events.Tags()["scalars"] if "samples_per_sec" in tag or tag.startswith("loss/")]
    assert any("samples_per_sec" in tag for tag in epoch_tags)
    for tag in epoch_tags:
        steps = [event.step for event in events.Scalars(tag)]
        assert steps == sorted(set(steps)), tag
