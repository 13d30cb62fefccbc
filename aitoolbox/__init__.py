"""aitoolbox: a PyTorch training loop with mixed precision and multi-device training built in.

The top level exports what aitoolbox 1.x exported: ``from aitoolbox import TrainLoop, TTModel, ...``.
"""
import logging

from aitoolbox._logging import install_default_handler
from aitoolbox.experiment import *  # noqa: F401,F403
from aitoolbox.torchtrain import *  # noqa: F401,F403
from aitoolbox.torchtrain.callbacks import *  # noqa: F401,F403

__version__ = "2.0.0.dev0"

install_default_handler(logging.getLogger(__name__))
