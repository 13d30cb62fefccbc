"""aitoolbox 1.x's Google Cloud modules: not supported yet."""
