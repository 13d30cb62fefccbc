"""aitoolbox 1.2's name of ``aitoolbox.torchtrain.train_loop.components`` (renamed in 1.3): 1.2 scripts import
``tl_components.pred_collate_fns`` and ``tl_components.callback_handler``."""
