"""Training-loop components: TrainLoop, TTModel, callbacks, precision and distribution."""
