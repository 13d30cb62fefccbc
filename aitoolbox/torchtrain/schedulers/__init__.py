"""Learning-rate scheduler callbacks: epoch-based ones in :mod:`.basic`, per-step warmup schedules in :mod:`.warmup`."""
