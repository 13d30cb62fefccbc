"""Under distributed training only the main process writes the NLP text dumps and heat maps; every process
computes the metrics and returns the same result."""
import os

import pytest
import torch

from aitoolbox.nlp.experiment_evaluation.attention_heatmap import AttentionHeatMap
from aitoolbox.nlp.experiment_evaluation.NLP_metrics import ExactMatchTextMetric
from tests.distributed_helpers import run_distributed

pytest.importorskip("matplotlib")


def dump_worker(rank, world_size, root):
    # Each rank names a folder of its own: only the main process's may come into being.
    folder = os.path.join(root, f"rank{rank}")
    exact_match = ExactMatchTextMetric([["a", "cat"], ["dog"]], [["cat"], ["bird"]],
                                       output_text_dir=os.path.join(folder, "answers")).get_metric()
    plots = AttentionHeatMap([torch.eye(2)], [["le", "chat"]], [["the", "cat"]], os.path.join(folder, "attention"))
    return exact_match, [os.path.relpath(path, folder) for path in plots.get_metric()]


def test_only_the_main_process_writes_files(tmp_path):
    results = run_distributed(dump_worker, world_size=2, args=(str(tmp_path),))
    assert results[0] == results[1] == (50., [os.path.join("attention", "attention_heatmaps", "attn_plot_0.png")])
    assert sorted(os.listdir(tmp_path / "rank0" / "answers")) == ["answer_pred_true_0.txt", "answer_pred_true_1.txt"]
    assert os.path.isfile(tmp_path / "rank0" / "attention" / "attention_heatmaps" / "attn_plot_0.png")
    assert not os.path.exists(tmp_path / "rank1")
