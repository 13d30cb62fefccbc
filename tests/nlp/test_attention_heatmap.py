"""Attention heat maps: one PNG per sentence, drawn without pyplot, with the sentence lengths checked."""
import os

import numpy as np
import pytest
import torch

from aitoolbox.nlp.experiment_evaluation.attention_heatmap import AttentionHeatMap

image = pytest.importorskip("matplotlib.image")

SOURCES = [["le", "chat", "noir"], ["bonjour"]]
TARGETS = [["the", "black", "cat"], ["hello", "there"]]


def attention(rows, columns, seed):
    weights = torch.rand(rows, columns, generator=torch.Generator().manual_seed(seed))
    return weights / weights.sum(dim=1, keepdim=True)


def test_one_png_per_sentence(tmp_path):
    matrices = [attention(5, 4, 0), attention(3, 2, 1)]  # padded: larger than the sentences
    heatmaps = AttentionHeatMap(matrices, SOURCES, TARGETS, str(tmp_path / "plots"))
    folder = tmp_path / "plots" / "attention_heatmaps"
    assert heatmaps.get_metric() == [str(folder / "attn_plot_0.png"), str(folder / "attn_plot_1.png")]
    assert heatmaps.get_metric_dict() == {"Attention_HeatMap": heatmaps.get_metric()}
    pixels = image.imread(heatmaps.get_metric()[0])
    assert pixels.shape[:2] == (800, 800)  # 8 x 8 inches at 100 dpi
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 10  # drawn, not blank


def test_plot_cuts_the_matrix_to_the_sentences_and_labels_the_axes():
    matrix = np.arange(12, dtype=float).reshape(3, 4)
    figure = AttentionHeatMap.plot_sentence_attention(matrix[:2, :3], ["a", "b", "c"], ["x", "y"])
    axes = figure.axes[0]
    assert [label.get_text() for label in axes.get_xticklabels()] == ["a", "b", "c"]
    assert [label.get_text() for label in axes.get_yticklabels()] == ["x", "y"]
    assert axes.images[0].get_array().shape == (2, 3)
    assert axes.get_xlabel() == "Source" and axes.get_ylabel() == "Hypothesis"


def test_replotting_replaces_old_plots_only(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    AttentionHeatMap([attention(3, 3, 0), attention(2, 1, 1)], SOURCES, TARGETS, str(tmp_path))
    AttentionHeatMap([attention(3, 3, 0)], SOURCES[:1], TARGETS[:1], str(tmp_path))
    assert os.listdir(tmp_path / "attention_heatmaps") == ["attn_plot_0.png"]
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="their lengths are 1, 2 and 2"):
        AttentionHeatMap([attention(3, 3, 0)], SOURCES, TARGETS, str(tmp_path))
    with pytest.raises(ValueError, match="attention matrix 0 has shape \\(2, 3\\) but its sentences have 3 target"):
        AttentionHeatMap([attention(2, 3, 0), attention(2, 1, 0)], SOURCES, TARGETS, str(tmp_path))
    with pytest.raises(ValueError, match="must be 2-D"):
        AttentionHeatMap([torch.rand(1, 3, 3), attention(2, 1, 0)], SOURCES, TARGETS, str(tmp_path))
