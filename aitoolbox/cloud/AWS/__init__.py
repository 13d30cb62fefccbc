"""aitoolbox 1.x's AWS modules: not supported yet."""
