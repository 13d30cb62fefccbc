"""Attention heat maps of sequence-to-sequence models, drawn with matplotlib and saved as PNG files.

The figures are drawn on matplotlib's Agg canvas directly (no ``pyplot``), so plotting needs no display,
leaves the process's pyplot state and backend alone, and works in worker threads. aitoolbox 1.x drew them
with seaborn, which is not needed any more.
"""
import os
from typing import Any, List, Optional, Sequence

import numpy as np

from aitoolbox.experiment.core_metrics.abstract_metric import AbstractBaseMetric
from aitoolbox.nlp._optional import import_optional
from aitoolbox.nlp.experiment_evaluation import text_dump

HEATMAP_SUBFOLDER = "attention_heatmaps"


def _as_matrix(attention_matrix: Any) -> np.ndarray:
    if hasattr(attention_matrix, "detach"):
        attention_matrix = attention_matrix.detach().float().cpu().numpy()
    matrix = np.asarray(attention_matrix, dtype=np.float64)
    if matrix.ndim != 2:
        raise ValueError(f"an attention matrix must be 2-D (target tokens x source tokens), got shape {matrix.shape}")
    return matrix


class AttentionHeatMap(AbstractBaseMetric):
    """Save one attention heat map per sentence; the result is the list of PNG paths (``'Attention_HeatMap'``).

    The files are ``<plot_save_dir>/attention_heatmaps/attn_plot_<i>.png``. Each matrix is cut to the
    sentences' lengths (rows: target tokens, columns: source tokens), so padded matrices may be given. Under
    distributed training only the main process draws and saves the plots; every process returns their paths.

    Args:
        attention_matrices: per sentence a 2-D attention matrix (target x source), as arrays or tensors.
        source_sentences: per sentence the source tokens (the columns).
        target_sentences: per sentence the target (predicted) tokens (the rows).
        plot_save_dir: the folder to save into (created where missing).

    Raises:
        ValueError: the three lists differ in length, or a matrix is not 2-D or smaller than its sentences.
        ImportError: matplotlib is not installed (``pip install aitoolbox[nlp]``).
    """

    def __init__(self, attention_matrices: Sequence[Any], source_sentences: Sequence[Sequence[str]],
                 target_sentences: Sequence[Sequence[str]], plot_save_dir: str):
        lengths = (len(attention_matrices), len(source_sentences), len(target_sentences))
        if len(set(lengths)) != 1:
            raise ValueError("attention_matrices, source_sentences and target_sentences must have one entry per "
                             f"sentence each; their lengths are {lengths[0]}, {lengths[1]} and {lengths[2]}")
        self.attention_matrices = attention_matrices
        self.source_sentences = source_sentences
        self.target_sentences = target_sentences
        self.plot_save_dir = plot_save_dir
        super().__init__(None, None, metric_name="Attention_HeatMap", np_array=False)

    def calculate_metric(self) -> List[str]:
        import_optional("matplotlib.figure", "AttentionHeatMap")  # before emptying the plot folder
        dir_path = self.prepare_folder_for_saving(self.plot_save_dir)
        paths = []
        rows = zip(self.attention_matrices, self.source_sentences, self.target_sentences)
        for position, (matrix, source, target) in enumerate(rows):
            matrix = _as_matrix(matrix)
            if matrix.shape[0] < len(target) or matrix.shape[1] < len(source):
                raise ValueError(f"attention matrix {position} has shape {matrix.shape} but its sentences have "
                                 f"{len(target)} target and {len(source)} source tokens; it needs at least that")
            path = os.path.join(dir_path, f"attn_plot_{position}.png")
            if text_dump.is_main_process():  # the other processes name the files the main one writes
                self.plot_sentence_attention(matrix[:len(target), :len(source)], source, target, path)
            paths.append(path)
        return paths

    @staticmethod
    def plot_sentence_attention(attention_matrix: Any, sentence_source: Sequence[str], sentence_target: Sequence[str],
                                plot_file_path: Optional[str] = None) -> Any:
        """Draw one attention matrix with the source tokens along the top and the target tokens down the side.

        Args:
            attention_matrix: 2-D, one row per target token and one column per source token.
            sentence_source: the source tokens (column labels).
            sentence_target: the target tokens (row labels).
            plot_file_path: save the figure there as PNG (the folder must exist).

        Returns:
            The ``matplotlib.figure.Figure`` (new; aitoolbox 1.x returned None), e.g. for a notebook.

        Raises:
            ImportError: matplotlib is not installed (``pip install aitoolbox[nlp]``).
        """
        figure_module = import_optional("matplotlib.figure", "AttentionHeatMap")
        agg = import_optional("matplotlib.backends.backend_agg", "AttentionHeatMap")
        matrix = _as_matrix(attention_matrix)
        figure = figure_module.Figure(figsize=(8, 8))
        agg.FigureCanvasAgg(figure)
        axes = figure.add_subplot(1, 1, 1)
        image = axes.imshow(matrix, cmap="Reds", aspect="auto", vmin=0.)
        figure.colorbar(image, ax=axes)
        axes.set_xticks(range(len(sentence_source)))
        axes.set_xticklabels([str(token) for token in sentence_source], rotation=60, ha="left", fontsize=12)
        axes.set_yticks(range(len(sentence_target)))
        axes.set_yticklabels([str(token) for token in sentence_target], fontsize=12)
        axes.xaxis.tick_top()
        axes.xaxis.set_label_position("top")
        axes.set_xlabel("Source", fontsize=20)
        axes.set_ylabel("Hypothesis", fontsize=20)
        figure.tight_layout()
        if plot_file_path:
            figure.savefig(plot_file_path, format="png")
        return figure

    @staticmethod
    def prepare_folder_for_saving(output_plot_dir: str) -> str:
        """Create ``<output_plot_dir>/attention_heatmaps``, emptied of earlier plots, and return its path.

        Only that subfolder is emptied (aitoolbox 1.x deleted ``output_plot_dir`` with everything in it).
        """
        return text_dump.reset_subfolder(output_plot_dir, HEATMAP_SUBFOLDER)
