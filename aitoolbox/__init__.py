"""aitoolbox: a PyTorch training loop with mixed precision and multi-device training built in."""
import logging

from aitoolbox._logging import install_default_handler

__version__ = "2.0.0.dev0"

install_default_handler(logging.getLogger(__name__))
