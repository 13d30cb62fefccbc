"""Data helpers: feed definitions that tell TrainLoop how to run a plain ``nn.Module``."""
