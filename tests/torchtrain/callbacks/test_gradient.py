"""GradValueClip and GradNormClip against a hand-written loop that clips right before each optimizer step."""
import pytest
import torch
from torch import nn

from aitoolbox.torchtrain.callbacks.gradient import GradNormClip, GradValueClip
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
