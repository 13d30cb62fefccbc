"""SpikeRollback's kept points where the run that never stopped kept another: a stop checkpoint resumed into a new
run folder (snapshot='checkpoint', review 49x X2). Each compared with the straight run (bitwise weights, the same
rollback records) or refused with an error."""
import errno
import glob
import os
import shutil

import pytest

from aitoolbox.experiment.local_save.checkpoints import find_checkpoint
from aitoolbox.torchtrain.callbacks.model_save import ModelCheckpoint
from aitoolbox.torchtrain.callbacks.spike_rollback import SpikeRollback, SpikeRollbackError
from aitoolbox.torchtrain.distributed.signals import SignalStop
from tests.helpers import MLP, assert_params_equal, model_pair, single_torch_thread
from tests.torchtrain.callbacks.test_spike_rollback import (
    SETTINGS, Poisoned, SigtermAt, TellEpoch, loader, make_loop, poisoned_at,
    rollback_records, train)

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")


# --- a stop checkpoint resumed into a new run folder (review 49x X2) ----------------------------------------------
def stopped_into_new_folder(tmp_path, poison, settings, step):
    """snapshot='checkpoint' stopped by SIGTERM at batch ``step``; the model for the resumed run, the stop's
    checkpoint and the straight run."""
    model, twin = model_pair(MLP)
    resumed_model = model_pair(MLP)[0]
    resumed_model.load_state_dict(twin.state_dict())  # (the checkpoint sets the weights; a twin all the same)
    straight = train(make_loop(twin, loader(Poisoned(poison))),
                     callbacks=[ModelCheckpoint("proj", "straight", str(tmp_path)),
                                SpikeRollback(**settings, snapshot="checkpoint")])
    stopped = make_loop(model, loader(Poisoned(poison)))
    with pytest.raises(SignalStop):
        train(stopped, callbacks=[ModelCheckpoint("proj", "stopped", str(tmp_path)),
                                  SpikeRollback(**settings, snapshot="checkpoint"), SigtermAt(step)])
    (run_folder,) = glob.glob(str(tmp_path / "proj" / "stopped_*"))
    return resumed_model, find_checkpoint(run_folder), straight


def resume_into_new_folder(tmp_path, model, saved, poison, settings):
    resumed = make_loop(model, loader(Poisoned(poison)))
    resumed.load_checkpoint(saved)  # a new run folder: not continue_run_folder
    resumed.fit(num_epochs=4, callbacks=[TellEpoch(), SpikeRollback(**settings, snapshot="checkpoint"),
                                         ModelCheckpoint("proj", "resumed", str(tmp_path))])
    return resumed


@pytest.mark.parametrize("skip_batches", [1, 2])
def test_a_stop_checkpoint_resumed_into_a_new_run_folder_returns_to_the_pin_of_the_folder_it_came_from(
        tmp_path, skip_batches):
    """SIGTERM at batch 14 (a check: its point is pinned, the stop's checkpoint is the point's), the spike at batch
    16. Resumed into a new run folder, the run found no pin, kept its first step (batch 15) and left out batch 16
    only (skip_batches=2: a clipped skip, a warning) or named batch 15 as the point: another run than the straight
    one. The pin of the folder the checkpoint came from is taken over: the run equals the straight run, records
    included, and the old run folder keeps its files."""
    settings = dict(SETTINGS, skip_batches=skip_batches)
    poison = poisoned_at(1, 4)
    model, saved, straight = stopped_into_new_folder(tmp_path, poison, settings, 14)
    assert saved.endswith("_E1_ITER14.pth")
    old_pins = sorted(os.listdir(os.path.join(os.path.dirname(saved), "spike_rollback")))
    resumed = resume_into_new_folder(tmp_path, model, saved, poison, settings)
    assert rollback_records(straight) == [(1, 4, {"epoch": 1, "iteration": 2})]
    assert rollback_records(resumed) == rollback_records(straight)
    assert_params_equal(resumed.model, straight.model)
    assert resumed.train_history == straight.train_history
    assert sorted(os.listdir(os.path.join(os.path.dirname(saved), "spike_rollback"))) == old_pins
    (new_folder,) = glob.glob(str(tmp_path / "proj" / "resumed_*"))
    assert not os.path.exists(os.path.join(new_folder, "checkpoint_model", "spike_rollback"))  # gone at the end


@pytest.mark.parametrize("given", ["run folder", "checkpoint folder", "home-relative file", "link to the file"])
def test_a_stop_checkpoint_loaded_by_its_folder_into_a_new_run_folder_returns_to_that_folders_pin(
        tmp_path, monkeypatch, given):
    """As above, load_checkpoint given the run folder or its checkpoint_model/ folder (its newest checkpoint, the
    stop's), the file as ``~/...`` or through a link: the pin is looked for in that run folder, not in the folder above
    it (review 50k K4: it stopped with SpikeRollbackError saying no pin was there), under a folder named ``~`` (50t
    T2) or beside the link (50f G6)."""
    settings = dict(SETTINGS, skip_batches=2)
    poison = poisoned_at(1, 4)
    model, saved, straight = stopped_into_new_folder(tmp_path, poison, settings, 14)
    checkpoint_dir = os.path.dirname(saved)
    source = {"run folder": os.path.dirname(checkpoint_dir), "checkpoint folder": checkpoint_dir,
              "home-relative file": os.path.join("~", os.path.relpath(saved, tmp_path)),
              "link to the file": str(tmp_path / "latest.pth")}[given]
    os.symlink(saved, tmp_path / "latest.pth")  # (review 50f G6: the link's folder was searched)
    monkeypatch.setenv("HOME", str(tmp_path))
    resumed = resume_into_new_folder(tmp_path, model, source, poison, settings)
    assert rollback_records(resumed) == rollback_records(straight) == [(1, 4, {"epoch": 1, "iteration": 2})]
    assert_params_equal(resumed.model, straight.model)


def test_the_pin_of_a_sharded_checkpoint_given_as_its_folder_is_looked_for_in_its_checkpoint_folder(tmp_path):
    """A sharded (FSDP) checkpoint is a folder inside checkpoint_model/: given as that folder, its pins are those of
    the checkpoint_model/ folder around it (review 50t T1: the sharded folder itself was searched)."""
    from aitoolbox.torchtrain.callbacks.spike_rollback import _checkpoint_dir_of

    checkpoint_dir = tmp_path / "exp_1" / "checkpoint_model"
    (checkpoint_dir / "model_exp_1_E1_ITER14").mkdir(parents=True)
    (checkpoint_dir / "spike_rollback").mkdir()
    assert _checkpoint_dir_of(str(checkpoint_dir / "model_exp_1_E1_ITER14")) == str(checkpoint_dir)
    assert _checkpoint_dir_of(str(tmp_path / "exp_1")) == str(checkpoint_dir)
    assert _checkpoint_dir_of(str(checkpoint_dir)) == str(checkpoint_dir)


def test_a_stop_checkpoint_resumed_into_a_new_run_folder_without_its_pin_stops_rather_than_clip_the_skip(tmp_path):
    """As above, the old run folder's pin deleted: the run cannot return where the straight run does; with
    skip_batches=2 it stops with SpikeRollbackError naming the point and continue_run_folder (it left out batch 16
    alone, silently another run)."""
    settings = dict(SETTINGS, skip_batches=2)
    poison = poisoned_at(1, 4)
    model, saved, _ = stopped_into_new_folder(tmp_path, poison, settings, 14)
    shutil.rmtree(os.path.join(os.path.dirname(saved), "spike_rollback"))
    with pytest.raises(SpikeRollbackError, match=r"skip_batches=2 reaches before the first point this fit kept \(epoch "
                                                 r"2, iteration 3, .*returns to \(epoch 2, iteration 2\).*"
                                                 r"continue_run_folder=True.*snapshot='memory' from a checkpoint "
                                                 r"written at a check") as raised:
        resume_into_new_folder(tmp_path, model, saved, poison, settings)
    # Not the advice to resume from the last check's checkpoint: that may be the one resumed from (review 50k K5).
    assert "at or before the last check" not in str(raised.value)


def test_a_pin_that_cannot_be_taken_over_leaves_no_partial_file_and_the_run_stops_only_at_a_skip_before_it(
        tmp_path, monkeypatch):
    """The old folder's pin can be neither linked (another file system) nor copied (a full disk: both injected for
    that pin only). The resumed fit crashed at its first batch with the OSError and left a partial pin file (review
    50k K14); it goes on without the pin, removes what the copy left, and the spike whose skip reaches before its
    first point stops with SpikeRollbackError, as without a pin."""
    settings = dict(SETTINGS, skip_batches=2)
    poison = poisoned_at(1, 4)
    model, saved, _ = stopped_into_new_folder(tmp_path, poison, settings, 14)
    old_pins = os.path.join(os.path.dirname(saved), "spike_rollback")
    real_link, real_copy = os.link, shutil.copy2

    def link(source, target, *args, **kwargs):
        if str(source).startswith(old_pins):
            raise OSError(errno.EXDEV, "Invalid cross-device link (injected)")
        return real_link(source, target, *args, **kwargs)

    def copy(source, target, *args, **kwargs):
        if str(source).startswith(old_pins):
            with open(target, "wb") as partial:
                partial.write(bytes(100))
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real_copy(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "link", link)
    monkeypatch.setattr(shutil, "copy2", copy)
    with pytest.raises(SpikeRollbackError, match="skip_batches=2 reaches before the first point this fit kept"):
        resume_into_new_folder(tmp_path, model, saved, poison, settings)
    (new_folder,) = glob.glob(str(tmp_path / "proj" / "resumed_*"))
    new_pins = os.path.join(new_folder, "checkpoint_model", "spike_rollback")
    # (The run's own point kept at its first step is pinned there; the partial copy of the old pin is not.)
    assert not any(name == os.path.basename(saved) for name in os.listdir(new_pins))
    assert os.listdir(old_pins)  # the old run folder's pin stays


def test_a_first_point_without_the_pin_that_a_skip_does_not_reach_before_records_the_straight_runs_point(tmp_path):
    """skip_batches=1, no pin anywhere: the run returns to its first step's point and leaves out the spiking batch
    alone, as the straight run: bitwise the same, and its record names the straight run's point (it named batch 15)."""
    poison = poisoned_at(1, 4)
    model, saved, straight = stopped_into_new_folder(tmp_path, poison, SETTINGS, 14)
    shutil.rmtree(os.path.join(os.path.dirname(saved), "spike_rollback"))
    resumed = resume_into_new_folder(tmp_path, model, saved, poison, SETTINGS)
    assert rollback_records(resumed) == rollback_records(straight) == [(1, 4, {"epoch": 1, "iteration": 2})]
    assert_params_equal(resumed.model, straight.model)


def test_a_memory_run_resumed_with_unjudged_losses_never_clips_a_skip_reaching_before_its_first_point(tmp_path):
    """snapshot='memory', skip_batches=3: an iteration checkpoint of batch 15 (loss 15 not judged; the point kept at
    batch 14 was in the stopped process's memory) resumed in a new loop. Its first step (batch 16) is checked and
    kept; the spike at batch 17 leaves out 15-17 in the straight run, and the resumed run left out 17 alone with a
    warning (another run). It stops with SpikeRollbackError naming the straight run's point."""
    from aitoolbox.torchtrain.callbacks.model_save import ModelIterationCheckpoint
    from tests.torchtrain.callbacks.test_spike_rollback import KilledAt
    settings = dict(SETTINGS, skip_batches=3)
    poison = poisoned_at(1, 5)  # batch 17
    model, twin = model_pair(MLP)
    straight = train(make_loop(twin, loader(Poisoned(poison))), callbacks=[SpikeRollback(**settings)])
    assert rollback_records(straight) == [(1, 5, {"epoch": 1, "iteration": 2})]
    stopped = make_loop(model, loader(Poisoned(poison)))
    with pytest.raises(RuntimeError, match="killed"):
        train(stopped, callbacks=[ModelIterationCheckpoint(1, "proj", "exp", str(tmp_path)),
                                  SpikeRollback(**settings), KilledAt(17)])
    (saved,) = glob.glob(str(tmp_path / "proj" / "exp_*" / "checkpoint_model" / "*_E1_ITER15.pth"))
    resumed = make_loop(model_pair(MLP)[0], loader(Poisoned(poison)))
    resumed.load_checkpoint(saved)
    with pytest.raises(SpikeRollbackError, match=r"skip_batches=3 reaches before the first point this fit kept \(epoch "
                                                 r"2, iteration 4, .*returns to \(epoch 2, iteration 2\)"):
        resumed.fit(num_epochs=4, callbacks=[TellEpoch(), SpikeRollback(**settings)])

