"""Gradient callbacks: clipping (of true, unscaled gradients, once per optimizer step) and gradient reports.

:class:`GradValueClip` and :class:`GradNormClip` clip right before each optimizer step.
:class:`GradientStatsPrint` prints per-layer gradient statistics and :class:`GradDistributionPlot` plots
per-layer gradient histograms, both from the gradients of the last optimizer step of each epoch.
"""
import inspect
import logging
import os
from numbers import Real
from typing import Any, Callable, List, Optional, Sequence

import numpy as np
import torch
from torch import nn

from aitoolbox.experiment.local_save.atomic import atomic_write
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback, AbstractExperimentCallback
from aitoolbox.torchtrain.precision.precision import Precision

logger = logging.getLogger(__name__)

LayersFn = Callable[[nn.Module], Sequence[nn.Module]]
GRAD_PLOT_FORMATS = ("png", "pdf")


def _check_positive_number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    return float(value)


class GradientCallbackBase(AbstractCallback):
    """Base of callbacks that work on the gradients in ``on_after_gradient_update`` / ``on_after_optimizer_step``.

    The loop calls those hooks for every callback that overrides them; registration also sets aitoolbox
    1.x's ``train_loop_obj.grad_cb_used`` flag for code that reads it.

    Args:
        callback_name: a name for messages.
        execution_order: position among the callbacks.
    """

    def __init__(self, callback_name: str, execution_order: int = 0):
        super().__init__(callback_name, execution_order=execution_order)

    def on_train_loop_registration(self) -> None:
        self.train_loop_obj.grad_cb_used = True


class GradientClipBase(GradientCallbackBase):
    """Clips the gradients of an optimizer's parameters right before that optimizer steps.

    With gradient accumulation the gradients of several batches are summed first, so clipping happens only
    in the ``on_after_gradient_update`` call of a batch that ends with an optimizer step. Under loss scaling
    the gradients are unscaled first, so the thresholds apply to true gradient values. With several
    optimizers each one's parameters are clipped separately.
    """

    def on_after_gradient_update(self, optimizer_idx: int) -> None:
        tl = self.train_loop_obj
        if not tl.should_execute_optimizer_update():
            return
        optimizer = tl.optimizers[optimizer_idx]
        tl.unscale_gradients(optimizer)
        self.clip(Precision.stepped_parameters(optimizer))

    def clip(self, parameters: List[torch.Tensor]) -> None:
        """Clip the ``.grad`` of these parameters in place."""
        raise NotImplementedError


class GradValueClip(GradientClipBase):
    """Clamp every gradient element to ``[-max_grad_value, max_grad_value]`` (``clip_grad_value_``).

    Args:
        max_grad_value: the largest absolute gradient value allowed (> 0).

    Raises:
        ValueError: ``max_grad_value`` is not a positive number.
    """

    def __init__(self, max_grad_value: float):
        super().__init__("Gradient value clipping")
        self.max_grad_value = _check_positive_number("max_grad_value", max_grad_value)

    def clip(self, parameters: List[torch.Tensor]) -> None:
        torch.nn.utils.clip_grad_value_(parameters, self.max_grad_value)


class GradNormClip(GradientClipBase):
    """Rescale the gradients so that their total norm is at most ``max_grad_norm`` (``clip_grad_norm_``).

    Args:
        max_grad_norm: the largest total gradient norm allowed (> 0).
        **kwargs: further ``torch.nn.utils.clip_grad_norm_`` arguments, e.g. ``norm_type=1.0``.

    Raises:
        ValueError: ``max_grad_norm`` is not a positive number.
        TypeError: a keyword argument ``clip_grad_norm_`` does not accept.
    """

    def __init__(self, max_grad_norm: float, **kwargs):
        super().__init__("Gradient norm clipping")
        self.max_grad_norm = _check_positive_number("max_grad_norm", max_grad_norm)
        accepted = set(inspect.signature(torch.nn.utils.clip_grad_norm_).parameters) - {"parameters", "max_norm"}
        unknown = sorted(set(kwargs) - accepted)
        if unknown:
            raise TypeError(f"GradNormClip got keyword argument(s) {unknown} that torch.nn.utils.clip_grad_norm_ "
                            f"does not accept; valid ones: {sorted(accepted)}")
        self.kwargs = kwargs

    def clip(self, parameters: List[torch.Tensor]) -> None:
        torch.nn.utils.clip_grad_norm_(parameters, self.max_grad_norm, **self.kwargs)


def _check_layers_fn(model_layers_extract_def) -> None:
    if not callable(model_layers_extract_def):
        raise TypeError("model_layers_extract_def must be a function taking the model and returning a list of its "
                        f"layers, e.g. lambda m: [m.fc1, m.fc2]; got {model_layers_extract_def!r}")


class _LayerGradients:
    """Keeps the weight gradients of chosen layers as they were at the last optimizer step.

    The loop clears gradients after each step (``zero_grad(set_to_none=True)``), so at epoch end the layers
    have none; references taken at the step keep that step's (unscaled) values at no copying cost.
    """

    def __init__(self, model_layers_extract_def: LayersFn):
        self.model_layers_extract_def = model_layers_extract_def
        self.grads: Optional[List[Optional[torch.Tensor]]] = None

    def current(self, model: nn.Module) -> List[Optional[torch.Tensor]]:
        return [getattr(layer.weight, "grad", None) for layer in self.model_layers_extract_def(model)]

    def at_epoch_end(self, model: nn.Module) -> List[Optional[torch.Tensor]]:
        """The gradients of the epoch's last step (or the current ones when no step has been seen)."""
        current = self.current(model)
        if self.grads is None or any(grad is not None for grad in current):
            return current
        return self.grads


class GradientStatsPrint(AbstractCallback):
    """Print the mean, standard deviation and share of zeros of chosen layers' weight gradients.

    At each epoch end it reports the gradients of the epoch's last optimizer step; with
    ``on_every_grad_update`` also after every backward pass (then still accumulating and, under loss scaling,
    scaled). Printed in the main process, as aitoolbox 1.x does.

    Args:
        model_layers_extract_def: a function taking the model and returning the layers to report, e.g.
            ``lambda model: [model.fc1, model.fc2]``.
        on_every_grad_update: also report after every backward pass.

    Raises:
        TypeError: ``model_layers_extract_def`` is not callable.
    """

    def __init__(self, model_layers_extract_def: LayersFn, on_every_grad_update: bool = False):
        super().__init__("Print model gradient stats", device_idx_execution=0)
        _check_layers_fn(model_layers_extract_def)
        self.model_layers_extract_def = model_layers_extract_def
        self.on_every_grad_update = on_every_grad_update
        self._grads = _LayerGradients(model_layers_extract_def)

    def on_train_loop_registration(self) -> None:
        if self.on_every_grad_update:
            self.train_loop_obj.grad_cb_used = True  # aitoolbox 1.x's flag; our loop always calls the hook

    def on_after_gradient_update(self, optimizer_idx: int) -> None:
        if self.on_every_grad_update and optimizer_idx == 0:
            self.gradients_report()

    def on_after_optimizer_step(self) -> None:
        self._grads.grads = self._grads.current(self.train_loop_obj.model)

    def on_epoch_end(self) -> None:
        self.gradients_report(self._grads.at_epoch_end(self.train_loop_obj.model))

    def on_exception(self, exception: BaseException) -> None:
        self._grads.grads = None  # the gradient tensors (GPU memory) of a stopped fit

    def gradients_report(self, gradients: Optional[List[Optional[torch.Tensor]]] = None) -> None:
        """Print the statistics of ``gradients`` (by default the layers' current gradients)."""
        if not self.train_loop_obj.is_main_process:
            return
        if gradients is None:
            gradients = self._grads.current(self.train_loop_obj.model)
        print('---> Model layers gradients stats')
        for i, grad in enumerate(gradients):
            if grad is None:
                print(f'Layer {i} grad are None')
                continue
            values = grad.detach().float().cpu().numpy()
            print(f'Layer {i} grads: Mean: {np.mean(values)}; Std {np.std(values)}')
            print(f'\tRatio of zero gradients: {float(np.count_nonzero(values == 0)) / values.size}')


class GradDistributionPlot(AbstractExperimentCallback):
    """Plot a histogram of each chosen layer's weight gradients at every epoch end.

    The gradients are those of the epoch's last optimizer step. Files go into the experiment folder:
    ``results/<grad_plots_dir_name>/epoch_<N>/layer_<i>.png``, or one ``epoch_<N>.pdf`` with a page per
    layer. Written in the main process; matplotlib is needed (imported when the callback is registered).

    Args:
        model_layers_extract_def: a function taking the model and returning the layers to plot.
        grad_plots_dir_name: the folder for the plots inside ``results/``.
        file_format: ``'png'`` (a file per layer) or ``'pdf'`` (a file per epoch).
        project_name: the project folder, or None to take the loop's.
        experiment_name: prefix of the run folder, or None to take the loop's.
        local_model_result_folder_path: root folder of all projects, or None to take the loop's.
        cloud_save_mode: also upload each plot to a bucket (``'s3'``, ``'gcs'``, ...; see :doc:`cloud_storage`);
            None or ``'local'``: local files only. With all three cloud arguments None the loop's are taken.
        bucket_name: the bucket (None with a cloud mode: ``'model-result'``, aitoolbox 1.8's default).
        cloud_dir_prefix: the folder inside the bucket that holds the projects.

    Raises:
        ValueError: a bad ``file_format`` or an unknown ``cloud_save_mode``.
        TypeError: ``model_layers_extract_def`` is not callable.
        ImportError: at registration, when matplotlib is not installed.
    """

    requires_experiment_folder = True

    def __init__(self, model_layers_extract_def: LayersFn, grad_plots_dir_name: str = "grad_distribution",
                 file_format: str = "png", project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 local_model_result_folder_path: Optional[str] = None, cloud_save_mode: Optional[str] = None,
                 bucket_name: Optional[str] = None, cloud_dir_prefix: Optional[str] = None):
        super().__init__("Gradient distribution plotter", project_name, experiment_name,
                         local_model_result_folder_path, cloud_save_mode, bucket_name, cloud_dir_prefix)
        _check_layers_fn(model_layers_extract_def)
        if file_format not in GRAD_PLOT_FORMATS:
            raise ValueError(f"file_format must be one of {list(GRAD_PLOT_FORMATS)}, got {file_format!r}")
        if not isinstance(grad_plots_dir_name, str) or not grad_plots_dir_name:
            raise ValueError(f"grad_plots_dir_name must be a folder name, got {grad_plots_dir_name!r}")
        self.model_layers_extract_def = model_layers_extract_def
        self.grad_plots_dir_name = grad_plots_dir_name
        self.file_format = file_format
        self._grads = _LayerGradients(model_layers_extract_def)

    def on_train_loop_registration(self) -> None:
        try:  # checked now so that a missing package fails before training, not after the first epoch
            import matplotlib  # noqa: F401
        except ImportError as error:
            raise ImportError("GradDistributionPlot needs matplotlib, which is not installed: pip install "
                              "matplotlib") from error
        super().on_train_loop_registration()

    def on_after_optimizer_step(self) -> None:
        self._grads.grads = self._grads.current(self.train_loop_obj.model)

    def on_epoch_end(self) -> None:
        if self.is_main_process:
            for path in self.gradient_plot():
                self.cloud_upload(path)

    def on_exception(self, exception: BaseException) -> None:
        self._grads.grads = None  # the gradient tensors (GPU memory) of a stopped fit

    def prepare_results_saver(self) -> None:
        """aitoolbox 1.x's set-up of the cloud saver: nothing to do (the bucket is known after registration, see
        :attr:`cloud_destination`)."""

    def create_plot_dirs(self) -> str:
        """Create (if needed) and return the folder of the plots, ``results/<grad_plots_dir_name>``."""
        return self.ensure_folder(os.path.join(self.experiment_folder.results_dir, self.grad_plots_dir_name))

    def gradient_plot(self) -> List[str]:
        """Plot the gradients of the epoch's last step now; returns the written file paths."""
        epoch = self.train_loop_obj.epoch
        plots_dir = self.create_plot_dirs()
        figures = []
        for i, grad in enumerate(self._grads.at_epoch_end(self.train_loop_obj.model)):
            if grad is None:
                logger.info("GradDistributionPlot: layer %d has no gradient at epoch %d", i, epoch + 1)
                continue
            figures.append((i, self.plot_gradient_distribution(grad.detach().float().cpu().numpy().ravel(), i)))
        if self.file_format == "pdf":
            from matplotlib.backends.backend_pdf import PdfPages
            path = os.path.join(plots_dir, f"epoch_{epoch}.pdf")
            with atomic_write(path, "wb") as handle, PdfPages(handle) as pages:
                for _, figure in figures:
                    pages.savefig(figure)
            return [path]
        epoch_dir = self.ensure_folder(os.path.join(plots_dir, f"epoch_{epoch}"))
        paths = []
        for i, figure in figures:
            paths.append(os.path.join(epoch_dir, f"layer_{i}.png"))
            with atomic_write(paths[-1], "wb") as handle:
                figure.savefig(handle, format="png")
        return paths

    @staticmethod
    def plot_gradient_distribution(gradients: np.ndarray, layer_name: Any) -> Any:
        """A histogram of one layer's flattened gradients, titled with the layer and the gradients' mean / std."""
        # Figure + the Agg canvas: no pyplot global state, the user's backend is left alone.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        figure = Figure(figsize=(10, 8))
        FigureCanvasAgg(figure)
        axes = figure.subplots()
        axes.hist(gradients, bins=50, density=True, alpha=0.8)
        axes.set_xlabel("Gradient magnitude")
        axes.set_ylabel("Density")
        axes.set_title(f"Gradient distribution for layer {layer_name}\n"
                       f"Mean: {np.mean(gradients):.6g}   Std: {np.std(gradients):.6g}")
        figure.tight_layout()
        return figure
