"""Importing the optional NLP libraries only when a metric needs them, with an error that says what to install."""
import importlib
from types import ModuleType

EXTRA_HINT = "pip install aitoolbox[nlp]"

# The distribution on PyPI that provides each module, where the two names differ.
_PYPI_NAMES = {"rouge_score": "rouge-score"}


def import_optional(module_name: str, needed_for: str) -> ModuleType:
    """Import ``module_name``, or raise an ImportError naming the package and the aitoolbox extra.

    Args:
        module_name: the module to import, e.g. ``'sacrebleu'`` or ``'nltk.translate.bleu_score'``.
        needed_for: what needs it, for the message (e.g. ``'ROUGEMetric'``).

    Raises:
        ImportError: the module cannot be imported.
    """
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        top_level = module_name.split(".")[0]
        package = _PYPI_NAMES.get(top_level, top_level)
        raise ImportError(f"{needed_for} needs the {package!r} package, which is not installed: "
                          f"{EXTRA_HINT} (or pip install {package})") from error
