"""Sphinx configuration of the aitoolbox user guide and API reference.

Build (warnings are errors)::

    pip install -e ".[docs]"
    sphinx-build -W --keep-going -b html docs docs/_build/html

The Read the Docs theme is used when ``sphinx_rtd_theme`` is installed, Sphinx's bundled alabaster theme
otherwise (``AITOOLBOX_DOCS_THEME=alabaster`` forces the fallback).
"""
import importlib
import os
import sys
from pathlib import Path

DOCS_DIR = Path(__file__).resolve().parent
REPO_ROOT = DOCS_DIR.parent
# Document the working tree even when the package is not installed.
sys.path.insert(0, str(REPO_ROOT))

import aitoolbox  # noqa: E402

project = "aitoolbox"
author = "aitoolbox contributors"
copyright = "aitoolbox contributors"
release = aitoolbox.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

# Google-style docstrings only.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# "Attributes:" sections become field lists, not separate (indexed) object descriptions: a class shown
# in two places must not declare its attributes twice.
napoleon_use_ivar = True

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autoclass_content = "class"
# Overridden methods without a docstring of their own (hooks, torch.autograd.Function.forward) are left out
# rather than repeating the base class text.
autodoc_inherit_docstrings = False
# Type hints of the public API name torch types; they are shown, not resolved into links.
autodoc_type_aliases = {}

exclude_patterns = ["_build"]
templates_path = []
root_doc = "index"
pygments_style = "sphinx"


def _theme() -> str:
    requested = os.environ.get("AITOOLBOX_DOCS_THEME")
    if requested:
        return requested
    try:
        importlib.import_module("sphinx_rtd_theme")
    except ImportError:
        return "alabaster"
    return "sphinx_rtd_theme"


html_theme = _theme()
html_title = f"aitoolbox {release}"
html_theme_options = {"navigation_depth": 3} if html_theme == "sphinx_rtd_theme" else {}


# --- optional API sections ----------------------------------------------------------------------------
# A block of api.rst between ".. optional-api: <module>" and ".. end-optional-api" is dropped when the
# module cannot be imported, so the reference builds (with -W) from a tree where that part is missing.
OPTIONAL_START = ".. optional-api:"
OPTIONAL_END = ".. end-optional-api"


def _importable(module_name: str) -> bool:
    try:
        importlib.import_module(module_name)
    except Exception:  # any failure to import means: do not document it
        return False
    return True


def _drop_unimportable_sections(app, docname, source) -> None:
    if docname != "api":
        return
    kept, skipping = [], False
    for line in source[0].splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith(OPTIONAL_START):
            skipping = not _importable(stripped[len(OPTIONAL_START):].strip())
            continue
        if stripped == OPTIONAL_END:
            skipping = False
            continue
        if not skipping:
            kept.append(line)
    source[0] = "".join(kept)


def setup(app):
    app.connect("source-read", _drop_unimportable_sections)
