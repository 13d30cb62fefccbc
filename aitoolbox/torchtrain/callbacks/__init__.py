"""Callbacks: code that runs at fixed points of the training loop (see :mod:`.abstract` for the hooks)."""
