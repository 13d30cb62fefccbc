"""fit_distributed from interactive sessions: a Jupyter notebook and a script piped to ``python -``.

Neither has a script file that a fresh interpreter could import, so the model class defined there exists only
in that session: fit_distributed must fork (automatically) rather than spawn.
"""
import subprocess
import sys
import textwrap

import pytest

from tests.torchtrain.distributed.support import (
    SEED_PRELUDE, SEED_REPORT, SEED_SNIPPET, check_seed_result, script_env, seed_result)

FORK_CHECK = textwrap.dedent("""
    from aitoolbox.torchtrain.distributed.launcher import choose_start_method
    assert choose_start_method(None) == "fork"
""")


@pytest.mark.slow
def test_seed_snippet_in_a_jupyter_notebook(tmp_path):
    """Seed 000's multi-device snippet, unchanged, in notebook cells next to the notebook's own CNNModel class."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    cells = [SEED_PRELUDE, FORK_CHECK, textwrap.dedent(SEED_SNIPPET), textwrap.dedent(SEED_REPORT)]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source.strip()) for source in cells])
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=script_env())  # raises CellExecutionError with the cell's traceback on failure
    outputs = notebook.cells[-1].outputs
    text = "".join(output.get("text", "") for output in outputs
                   if output.get("output_type") == "stream" and output.get("name") == "stdout")
    check_seed_result(seed_result(text))


@pytest.mark.slow
@pytest.mark.extended
def test_script_piped_to_python_stdin(tmp_path):
    """``python - < script``: the code has no file; its top-level model class trains in forked processes."""
    program = SEED_PRELUDE + FORK_CHECK + textwrap.dedent(SEED_SNIPPET) + textwrap.dedent(SEED_REPORT)
    result = subprocess.run([sys.executable, "-"], input=program, env=script_env(), capture_output=True, text=True,
                            timeout=180, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-5000:]
    check_seed_result(seed_result(result.stdout))
    assert "CUDA is not available: fit_distributed trains with 2 CPU processes over gloo" in result.stderr
