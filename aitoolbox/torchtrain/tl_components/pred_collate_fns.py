"""aitoolbox 1.2's module path of the prediction collate functions."""
from aitoolbox.torchtrain.train_loop.components.pred_collate_fns import (
    __all__, append_concat_predictions, append_predictions, keep_list_transf, torch_cat_transf)  # noqa: F401
