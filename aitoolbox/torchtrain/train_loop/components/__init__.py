"""aitoolbox 1.x's ``train_loop.components`` package: the parts user code imports from it are re-exported."""
