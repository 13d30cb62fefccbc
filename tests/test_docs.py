"""The documentation in docs/ builds with Sphinx with warnings treated as errors.

This is the command of docs/conf.py (``sphinx-build -W --keep-going -b html docs docs/_build/html``), run into
a temporary folder so the working tree stays clean. It imports every documented module (autodoc), so it also
catches docstrings whose formatting Sphinx cannot parse. Skipped when Sphinx is not installed
(``pip install -e ".[docs]"``).
"""
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sphinx")

REPO_ROOT = Path(__file__).resolve().parents[1]
# A build takes 10-20 s on 2 idle cores; generous for a loaded machine.
TIMEOUT_S = 600


@pytest.mark.slow
def test_docs_build_with_warnings_as_errors(tmp_path):
    output_dir = tmp_path / "html"
    completed = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-d", str(tmp_path / "doctrees"),
         str(REPO_ROOT / "docs"), str(output_dir)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert completed.returncode == 0, f"sphinx-build failed:\n{completed.stdout[-6000:]}\n{completed.stderr[-6000:]}"
    for page in ("index", "quickstart", "trainloop", "callbacks", "mixed_precision", "distributed", "checkpointing",
                 "examples", "migrating", "api", "faster_training", "sharded_training", "cloud_storage", "tracking",
                 "weight_averaging", "nlp", "security", "lr_finder", "performance", "profiling",
                 "spike_rollback"):
        assert (output_dir / f"{page}.html").is_file(), f"{page}.html was not built"
    api_page = (output_dir / "api.html").read_text(encoding="utf-8")
    assert "aitoolbox.torchtrain.train_loop.train_loop.TrainLoop" in api_page  # autodoc imported the package
