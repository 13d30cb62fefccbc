"""The ``unwritable_root`` fixture: a ``local_model_result_folder_path`` no experiment folder can be created in.

Two kinds: inside a read-only folder (chmod 0o500; skipped when running as root, which writes there all the
same), and under a regular file (which stops root too).
"""
import os

import pytest

KINDS = ["read-only folder", "under a file"]


@pytest.fixture(params=KINDS)
def unwritable_root(request, tmp_path) -> str:
    if request.param == "read-only folder":
        if os.geteuid() == 0:
            pytest.skip("running as root, which may write into a read-only folder")
        folder = tmp_path / "read_only"
        folder.mkdir()
        folder.chmod(0o500)
        yield str(folder / "results")
        folder.chmod(0o700)  # lets pytest remove it
    else:
        blocker = tmp_path / "a_file"
        blocker.write_text("a regular file, not a folder")
        yield str(blocker / "results")
