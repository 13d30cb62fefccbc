"""aitoolbox 1.x's module path of the prediction collate functions (they live in
:mod:`aitoolbox.torchtrain.train_loop.pred_collate_fns`)."""
from aitoolbox.torchtrain.train_loop.pred_collate_fns import (
    append_concat_predictions, append_predictions, keep_list_transf, torch_cat_transf)

__all__ = ["append_predictions", "append_concat_predictions", "torch_cat_transf", "keep_list_transf"]
