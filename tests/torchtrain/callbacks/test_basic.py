"""FunctionOnTrainLoop, DataSubsetTestRun, ListRegisteredCallbacks and the unsupported 1.x callbacks."""
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils.data.dataloader import default_collate

from aitoolbox.torchtrain.callbacks import basic
from aitoolbox.torchtrain.callbacks.basic import (DataSubsetTestRun, EmailNotification, FunctionOnTrainLoop,
                                                  ListRegisteredCallbacks, LogUpload)
from aitoolbox.torchtrain.train_loop import TrainLoop


def make_loop(model, loader, val_loader=None, lr=0.05, end_auto_eval=False, **kwargs):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return TrainLoop(model, loader, val_loader, None, optimizer, nn.MSELoss(), end_auto_eval=end_auto_eval,
                     show_progress=False, **kwargs)


# --- FunctionOnTrainLoop ------------------------------------------------------------------------------------
HOOK_FLAGS = ("tl_registration", "train_begin", "train_end", "epoch_begin", "epoch_end", "batch_begin", "batch_end",
              "after_gradient_update", "after_optimizer_step")


def test_function_on_train_loop_calls_at_the_selected_hooks(make_model, make_loader):
    model = make_model()
    optimizers = [torch.optim.SGD(model.hidden.parameters(), lr=0.01), torch.optim.SGD(model.out.parameters(), lr=0.01)]
    tl = TrainLoop(model, make_loader(num_samples=20), None, None, optimizers, nn.MSELoss(), end_auto_eval=False,
                   show_progress=False)
    counts = Counter()
    seen_loops = set()

    def counter(flag):
        def fn(train_loop):
            seen_loops.add(id(train_loop))
            counts[flag] += 1
        return FunctionOnTrainLoop(fn, **{flag: True})

    tl.fit(num_epochs=2, grad_accumulation=2, callbacks=[counter(flag) for flag in HOOK_FLAGS])
    # 2 epochs of 5 batches; steps after batches 2, 4 and 5; two optimizers
    assert counts == {"tl_registration": 1, "train_begin": 1, "train_end": 1, "epoch_begin": 2, "epoch_end": 2,
                      "batch_begin": 10, "batch_end": 10, "after_gradient_update": 20, "after_optimizer_step": 6}
    assert seen_loops == {id(tl)}


def test_function_on_train_loop_order_of_hooks(make_model, make_loader):
    tl = make_loop(make_model(), make_loader(num_samples=4))  # a single batch
    events = []
    callbacks = [FunctionOnTrainLoop(lambda t, flag=flag: events.append(flag), **{flag: True}) for flag in HOOK_FLAGS]
    tl.fit(num_epochs=1, callbacks=callbacks[::-1])
    assert events == ["tl_registration", "train_begin", "epoch_begin", "batch_begin", "after_gradient_update",
                      "after_optimizer_step", "batch_end", "epoch_end", "train_end"]
    assert FunctionOnTrainLoop(print, epoch_end=True, execution_order=7).execution_order == 7


def test_function_on_train_loop_rejects_bad_arguments():
    with pytest.raises(TypeError, match="fn_to_execute must be a function taking the TrainLoop, got 'abc'"):
        FunctionOnTrainLoop("abc", epoch_end=True)


def test_function_on_train_loop_direct_call_and_1x_flag(make_model, make_loader):
    tl = make_loop(make_model(), make_loader(num_samples=8))
    calls = []
    callback = FunctionOnTrainLoop(calls.append, device_idx_execution=0)  # no hook: called directly only
    tl.callbacks_handler.register_callbacks([callback])
    callback.execute_callback()
    assert calls == [tl] and callback.device_idx_execution == 0
    assert not getattr(tl, "grad_cb_used", False)
    tl.callbacks_handler.register_callbacks([FunctionOnTrainLoop(calls.append, after_optimizer_step=True)])
    assert tl.grad_cb_used  # aitoolbox 1.x's flag, set for code that reads it


# --- DataSubsetTestRun --------------------------------------------------------------------------------------
def my_collate(batch):
    return default_collate(batch)


def test_data_subset_trains_on_the_first_batches_like_a_hand_loop(make_model, make_loader, hand_train,
                                                                   assert_params_equal):
    tl_model, hand_model = make_model(), make_model()
    tl = make_loop(tl_model, make_loader(shuffle=True, seed=3, collate_fn=my_collate))
    batches = Counter()
    tl.fit(num_epochs=3, grad_accumulation=2,
           callbacks=[DataSubsetTestRun(num_train_batches=3), FunctionOnTrainLoop(lambda t: batches.update([t.epoch]),
                                                                                  batch_begin=True)])
    assert batches == {0: 3, 1: 3, 2: 3}
    assert isinstance(tl.train_loader, list) and len(tl.train_loader) == 3
    # as in aitoolbox 1.x: the same first batches in every epoch
    first_batches = [batch for _, batch in zip(range(3), make_loader(shuffle=True, seed=3))]
    for kept, expected in zip(tl.train_loader, first_batches):
        assert all(torch.equal(a, b) for a, b in zip(kept, expected))
    optimizer = torch.optim.SGD(hand_model.parameters(), lr=0.05)
    hand_train(hand_model, first_batches, [optimizer], num_epochs=3, grad_accumulation=2)
    assert_params_equal(tl_model, hand_model)


def test_data_subset_reads_no_batch_beyond_those_kept():
    read = []

    def loader():
        for i in range(10):
            read.append(i)
            yield i
    assert DataSubsetTestRun.subset_data_loader(loader(), 3) == [0, 1, 2] and read == [0, 1, 2]
    assert DataSubsetTestRun.subset_data_loader(range(2), 5) == [0, 1]


def test_data_subset_validation_and_test_loaders(make_model, make_loader):
    model = make_model()
    val_loader, test_loader = make_loader(num_samples=20, seed=1), make_loader(num_samples=20, seed=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    tl = TrainLoop(model, make_loader(), val_loader, test_loader, optimizer, nn.MSELoss(), show_progress=False)
    tl.fit(num_epochs=1, callbacks=[DataSubsetTestRun(num_train_batches=2, num_val_batches=2, num_test_batches=1)])
    assert (len(tl.train_loader), len(tl.validation_loader), len(tl.test_loader)) == (2, 2, 1)
    with torch.no_grad():
        x, y = val_loader.dataset.tensors
        expected_val_loss = nn.functional.mse_loss(model(x[:8]), y[:8]).item()
    assert tl.train_history["val_loss"][0] == pytest.approx(expected_val_loss, rel=1e-6)


def test_data_subset_needs_the_loaders_it_subsets(make_model, make_loader):
    tl = make_loop(make_model(), make_loader())
    with pytest.raises(ValueError, match="keep 1 batch\\(es\\) of the validation_loader, but the TrainLoop has no "
                                         "validation_loader"):
        tl.fit(num_epochs=1, callbacks=[DataSubsetTestRun(num_val_batches=1)])
    tl = make_loop(make_model(), make_loader())
    with pytest.raises(ValueError, match="TrainLoop has no test_loader"):
        tl.fit(num_epochs=1, callbacks=[DataSubsetTestRun(num_test_batches=2)])


@pytest.mark.parametrize("kwargs, message", [
    ({"num_train_batches": 0}, "num_train_batches must be an int >= 1, got 0"),
    ({"num_train_batches": 2.0}, "num_train_batches must be an int >= 1, got 2.0"),
    ({"num_val_batches": -1}, "num_val_batches must be an int >= 0, got -1"),
    ({"num_test_batches": None}, "num_test_batches must be an int >= 0, got None"),
])
def test_data_subset_rejects_bad_counts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DataSubsetTestRun(**kwargs)




# --- ListRegisteredCallbacks and the unsupported 1.x callbacks ----------------------------------------------
def test_list_registered_callbacks_prints_each_hook_with_its_callbacks(make_model, make_loader, capsys):
    tl = make_loop(make_model(), make_loader(num_samples=8))
    tl.fit(num_epochs=1, callbacks=[ListRegisteredCallbacks(), DataSubsetTestRun(num_train_batches=1)])
    report = capsys.readouterr().out
    assert report.startswith("Registered callbacks:")
    train_begin = report.split("  on_train_begin:\n")[1].split("\n  on_")[0]
    assert "Print the list of registered callbacks: ListRegisteredCallbacks, execution_order: 0" in train_begin
    assert "DataSubsetTestRun" in train_begin
    assert "DataSubsetTestRun" not in report.split("  on_epoch_end:\n")[1].split("\n  on_")[0]


def test_list_registered_callbacks_report_text():
    text = basic.registered_callbacks_report([FunctionOnTrainLoop(print, epoch_end=True, execution_order=5)])
    assert "  on_epoch_end:\n    Execute the provided function at the selected hooks: FunctionOnTrainLoop, " \
           "execution_order: 5" in text


def test_email_needs_project_names_and_log_upload_needs_cloud_storage(make_model, make_loader):
    # EmailNotification sends through AWS SES (tests/cloud/test_email_notification.py); names come first.
    with pytest.raises(AttributeError, match="pass project_name and experiment_name to EmailNotification"):
        TrainLoop(make_model(), make_loader(), None, None, None, nn.MSELoss()).callbacks_handler.register_callbacks(
            [EmailNotification("me", "me@example.com", "you@example.com")])
    # LogUpload uploads to a bucket (tests/cloud); without one it refuses the loop, or only warns.
    model = make_model()
    tl = TrainLoop(model, make_loader(), None, None, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss())
    with pytest.raises(ValueError, match="LogUpload has no cloud storage to upload .*training.log"):
        tl.callbacks_handler.register_callbacks([LogUpload(project_name="p", experiment_name="e",
                                                           local_model_result_folder_path="/results")])
    quiet = LogUpload(fail_if_cloud_missing=False)
    tl.callbacks_handler.register_callbacks([quiet])
    assert quiet.cloud_destination is None
