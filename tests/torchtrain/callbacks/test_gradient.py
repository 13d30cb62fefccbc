"""Gradient clipping against a hand-written loop that clips right before each optimizer step; gradient reports."""
import os

import numpy as np
import pytest
import torch
from torch import nn

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.gradient import (GradDistributionPlot, GradientCallbackBase, GradientStatsPrint,
                                                     GradNormClip, GradValueClip)
from aitoolbox.torchtrain.precision import LossScaler, Precision
from aitoolbox.torchtrain.train_loop import TrainLoop

LR = 0.1


def train_with_trainloop(model, loader, callbacks, num_epochs=2, grad_accumulation=3, optimizers=None,
                         precision=None):
    optimizers = optimizers or [torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)]
    tl = TrainLoop(model, loader, None, None, optimizers, nn.MSELoss(), end_auto_eval=False, show_progress=False)
    if precision is not None:
        tl.precision = precision
    tl.fit(num_epochs=num_epochs, grad_accumulation=grad_accumulation, callbacks=callbacks)
    return tl


@pytest.mark.parametrize("callback, clip", [
    (lambda: GradValueClip(0.05), lambda params: nn.utils.clip_grad_value_(params, 0.05)),
    (lambda: GradNormClip(0.2), lambda params: nn.utils.clip_grad_norm_(params, 0.2)),
    (lambda: GradNormClip(0.2, norm_type=1.0), lambda params: nn.utils.clip_grad_norm_(params, 0.2, norm_type=1.0)),
    (lambda: GradNormClip(0.2, norm_type=float("inf")),
     lambda params: nn.utils.clip_grad_norm_(params, 0.2, norm_type=float("inf"))),
])
def test_clipping_matches_a_hand_loop_with_grad_accumulation(make_model, make_loader, hand_train,
                                                             assert_params_equal, callback, clip):
    # 38 samples in batches of 4: 10 batches, steps after batches 3, 6, 9 and the last one (10)
    tl_model, hand_model, unclipped_model = make_model(), make_model(), make_model()
    train_with_trainloop(tl_model, make_loader(shuffle=True), [callback()])

    optimizer = torch.optim.SGD(hand_model.parameters(), lr=LR, momentum=0.9)
    hand_train(hand_model, make_loader(shuffle=True), [optimizer], num_epochs=2, grad_accumulation=3,
               before_step=lambda: clip(list(hand_model.parameters())))
    assert_params_equal(tl_model, hand_model)

    # the thresholds are low enough that clipping changes the result
    optimizer = torch.optim.SGD(unclipped_model.parameters(), lr=LR, momentum=0.9)
    hand_train(unclipped_model, make_loader(shuffle=True), [optimizer], num_epochs=2, grad_accumulation=3)
    assert any(not torch.equal(a, b) for a, b in zip(tl_model.parameters(), unclipped_model.parameters()))


def test_clipping_each_optimizer_separately(make_model, make_loader, hand_train, assert_params_equal):
    tl_model, hand_model = make_model(), make_model()

    def optimizers_of(model):
        return [torch.optim.SGD(model.hidden.parameters(), lr=LR), torch.optim.Adam(model.out.parameters(), lr=0.01)]

    train_with_trainloop(tl_model, make_loader(), [GradNormClip(0.1)], optimizers=optimizers_of(tl_model))

    def clip_per_optimizer():
        nn.utils.clip_grad_norm_(list(hand_model.hidden.parameters()), 0.1)
        nn.utils.clip_grad_norm_(list(hand_model.out.parameters()), 0.1)

    hand_train(hand_model, make_loader(), optimizers_of(hand_model), num_epochs=2, grad_accumulation=3,
               before_step=clip_per_optimizer)
    assert_params_equal(tl_model, hand_model)


@pytest.mark.parametrize("callback, clip", [
    (lambda: GradValueClip(0.05), lambda params: nn.utils.clip_grad_value_(params, 0.05)),
    (lambda: GradNormClip(0.2), lambda params: nn.utils.clip_grad_norm_(params, 0.2)),
])
def test_clipping_sees_unscaled_gradients(make_model, make_loader, hand_train, assert_params_equal, callback, clip):
    # A power-of-two loss scale changes no bit of the unscaled gradients, so the scaled run must equal the
    # float32 hand loop exactly; clipping scaled gradients (1024x too large) would not.
    tl_model, hand_model = make_model(), make_model()
    train_with_trainloop(tl_model, make_loader(shuffle=True), [callback()],
                         precision=Precision("cpu", None, LossScaler(1024.0)))
    optimizer = torch.optim.SGD(hand_model.parameters(), lr=LR, momentum=0.9)
    hand_train(hand_model, make_loader(shuffle=True), [optimizer], num_epochs=2, grad_accumulation=3,
               before_step=lambda: clip(list(hand_model.parameters())))
    assert_params_equal(tl_model, hand_model)


def test_clipping_happens_once_per_optimizer_step(make_model, make_loader):
    calls = []

    class CountingClip(GradNormClip):
        def clip(self, parameters):
            calls.append(self.train_loop_obj.iteration)
            super().clip(parameters)

    train_with_trainloop(make_model(), make_loader(), [CountingClip(1.0)], num_epochs=1)
    assert calls == [2, 5, 8, 9]


@pytest.mark.parametrize("factory, message", [
    (lambda: GradValueClip(0), r"max_grad_value must be a number > 0, got 0"),
    (lambda: GradValueClip(-1.5), r"max_grad_value must be a number > 0, got -1.5"),
    (lambda: GradValueClip("1"), r"max_grad_value must be a number > 0, got '1'"),
    (lambda: GradValueClip(True), r"max_grad_value must be a number > 0, got True"),
    (lambda: GradNormClip(0.0), r"max_grad_norm must be a number > 0, got 0.0"),
    (lambda: GradNormClip(None), r"max_grad_norm must be a number > 0, got None"),
])
def test_clipping_rejects_bad_thresholds(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()


def test_grad_norm_clip_rejects_unknown_keywords():
    with pytest.raises(TypeError, match=r"keyword argument\(s\) \['nrm_type'\] that torch.nn.utils.clip_grad_norm_ "
                                        r"does not accept; valid ones: \[.*'norm_type'"):
        GradNormClip(1.0, nrm_type=2)


def test_gradient_callbacks_set_the_1x_flag(make_model, make_loader):
    tl = train_with_trainloop(make_model(), make_loader(num_samples=4), [GradValueClip(1.0)], num_epochs=1)
    assert tl.grad_cb_used and isinstance(GradValueClip(1.0), GradientCallbackBase)
    assert GradNormClip(1.0, norm_type=1.0).kwargs == {"norm_type": 1.0}


# --- GradientStatsPrint -------------------------------------------------------------------------------------
class LastStepGrads(AbstractCallback):
    """Copies the chosen layers' gradients at each optimizer step (what the reports should show)."""

    def __init__(self, layers_fn):
        super().__init__("grad copies")
        self.layers_fn, self.grads = layers_fn, None

    def on_after_optimizer_step(self):
        self.grads = [layer.weight.grad.clone() for layer in self.layers_fn(self.train_loop_obj.model)]


def expected_report(grads):
    lines = ["---> Model layers gradients stats"]
    for i, grad in enumerate(grads):
        values = grad.numpy()
        lines += [f"Layer {i} grads: Mean: {np.mean(values)}; Std {np.std(values)}",
                  f"\tRatio of zero gradients: {float(np.count_nonzero(values == 0)) / values.size}"]
    return lines


def test_gradient_stats_print_reports_the_last_step_of_each_epoch(make_model, make_loader, capsys):
    def layers(model):
        return [model.hidden, model.out]

    copies = LastStepGrads(layers)
    reports = []

    class CaptureAtEpochEnd(AbstractCallback):  # runs after the report: reads what it printed
        def on_epoch_end(self):
            reports.append((capsys.readouterr().out.splitlines(), copies.grads))

    callback = GradientStatsPrint(layers)
    train_with_trainloop(make_model(), make_loader(), [copies, callback, CaptureAtEpochEnd("capture", 1)])
    assert len(reports) == 2
    for printed, grads in reports:
        assert printed == expected_report(grads)
    assert callback.device_idx_execution == 0


def test_gradient_stats_print_on_every_gradient_update(make_model, make_loader, capsys):
    def layers(model):
        return [model.out]

    tl = train_with_trainloop(make_model(), make_loader(num_samples=8), [GradientStatsPrint(layers, True)],
                              num_epochs=1, grad_accumulation=1)
    printed = capsys.readouterr().out
    assert printed.count("---> Model layers gradients stats") == 2 + 1  # two batches and the epoch end
    assert tl.grad_cb_used
    tl = train_with_trainloop(make_model(), make_loader(num_samples=8), [GradientStatsPrint(layers)], num_epochs=1)
    assert not getattr(tl, "grad_cb_used", False)
    with pytest.raises(TypeError, match="model_layers_extract_def must be a function"):
        GradientStatsPrint([tl.model.out])


def test_gradient_callbacks_let_go_of_the_kept_gradients_on_exception(make_model, make_loader, tmp_path):
    pytest.importorskip("matplotlib")

    def layers(model):
        return [model.out]

    callbacks = [GradientStatsPrint(layers),
                 GradDistributionPlot(layers, project_name="proj", experiment_name="exp",
                                      local_model_result_folder_path=str(tmp_path))]
    tl = train_with_trainloop(make_model(), make_loader(num_samples=8), [], num_epochs=1)
    tl.callbacks_handler.register_callbacks(callbacks)
    for callback in callbacks:
        callback.on_after_optimizer_step()  # as after a step: references to the layers' gradients
    assert all(callback._grads.grads is not None for callback in callbacks)
    tl.callbacks_handler.on_exception(RuntimeError("stopped"))
    assert [callback._grads.grads for callback in callbacks] == [None, None]


# --- GradDistributionPlot -----------------------------------------------------------------------------------
@pytest.mark.parametrize("file_format", ["png", "pdf"])
def test_grad_distribution_plot_files(make_model, make_loader, tmp_path, file_format):
    pytest.importorskip("matplotlib")

    def layers(model):
        return [model.hidden, model.out]
    callback = GradDistributionPlot(layers, file_format=file_format, project_name="proj", experiment_name="exp",
                                    local_model_result_folder_path=str(tmp_path))
    tl = train_with_trainloop(make_model(), make_loader(), [callback])
    plots_dir = os.path.join(callback.experiment_folder.results_dir, "grad_distribution")
    assert callback.create_plot_dirs() == plots_dir
    assert callback.experiment_folder.timestamp == tl.experiment_timestamp
    if file_format == "png":
        assert sorted(os.listdir(plots_dir)) == ["epoch_0", "epoch_1"]
        assert sorted(os.listdir(os.path.join(plots_dir, "epoch_1"))) == ["layer_0.png", "layer_1.png"]
        with open(os.path.join(plots_dir, "epoch_1", "layer_0.png"), "rb") as handle:
            assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    else:
        assert sorted(os.listdir(plots_dir)) == ["epoch_0.pdf", "epoch_1.pdf"]
        with open(os.path.join(plots_dir, "epoch_0.pdf"), "rb") as handle:
            assert handle.read(4) == b"%PDF"


def test_grad_distribution_plot_arguments(make_model, make_loader):
    with pytest.raises(ValueError, match="file_format must be one of"):
        GradDistributionPlot(lambda m: [m.out], file_format="svg")
    with pytest.raises(ValueError, match="cloud_save_mode='dropbox' is not one of"):
        GradDistributionPlot(lambda m: [m.out], cloud_save_mode="dropbox")
    model = make_model()
    tl = TrainLoop(model, make_loader(), None, None, torch.optim.SGD(model.parameters(), lr=LR), nn.MSELoss())
    # Some of the folder details only (given none, the plots go into the plain loop's default run folder).
    with pytest.raises(ValueError, match="project_name, experiment_name and local_model_result_folder_path"):
        tl.callbacks_handler.register_callbacks([GradDistributionPlot(lambda m: [m.out], project_name="p")])
