"""file_system: nested folders, zipping a folder atomically, unpacking .zip and .tar.gz."""
import os
import tarfile
import zipfile

import pytest

from aitoolbox.utils.file_system import _check_tar_members_stay_inside, create_folder_hierarchy, unzip_file, zip_folder


def _make_tree(root):
    os.makedirs(os.path.join(root, "pkg", "sub"))
    os.makedirs(os.path.join(root, "empty"))
    with open(os.path.join(root, "top.txt"), "w") as f:
        f.write("top")
    with open(os.path.join(root, "pkg", "sub", "deep.py"), "w") as f:
        f.write("x = 1\n")


def test_create_folder_hierarchy_returns_the_chain_and_keeps_existing_folders(tmp_path):
    first, chain = create_folder_hierarchy(str(tmp_path), ["a", "b"])
    assert first == os.path.join(tmp_path, "a", "b") and os.path.isdir(first)
    assert chain == [str(tmp_path), os.path.join(tmp_path, "a"), first]
    second, _ = create_folder_hierarchy(str(tmp_path), ["a", "c"])
    assert os.path.isdir(first) and os.path.isdir(second)
    with pytest.raises(ValueError, match="does not exist"):
        create_folder_hierarchy(str(tmp_path / "missing"), ["a"])


@pytest.mark.parametrize("target", ["code", "code.zip"])
def test_zip_folder_appends_the_extension_and_round_trips(tmp_path, target):
    source = tmp_path / "src"
    _make_tree(str(source))
    zip_path = zip_folder(str(source), str(tmp_path / target))
    assert zip_path == str(tmp_path / "code.zip")
    with zipfile.ZipFile(zip_path) as archive:
        names = set(archive.namelist())
    assert {"top.txt", "pkg/sub/deep.py", "empty/"} <= names
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".tmp-")]

    unzip_file(zip_path, str(tmp_path / "out"))
    assert (tmp_path / "out" / "pkg" / "sub" / "deep.py").read_text() == "x = 1\n"
    assert (tmp_path / "out" / "empty").is_dir()


def test_zip_written_inside_the_zipped_folder_does_not_contain_itself(tmp_path):
    _make_tree(str(tmp_path))
    zip_path = zip_folder(str(tmp_path), str(tmp_path / "self"))
    with zipfile.ZipFile(zip_path) as archive:
        assert "self.zip" not in archive.namelist() and "top.txt" in archive.namelist()


def test_unzip_tar_gz_and_reject_other_archives(tmp_path):
    _make_tree(str(tmp_path / "src"))
    tar_path = str(tmp_path / "src.tar.gz")
    with tarfile.open(tar_path, "w:gz") as archive:
        archive.add(str(tmp_path / "src" / "top.txt"), arcname="top.txt")
    unzip_file(tar_path, str(tmp_path / "out"))
    assert (tmp_path / "out" / "top.txt").read_text() == "top"
    with pytest.raises(ValueError, match=".zip and .tar.gz"):
        unzip_file(str(tmp_path / "src.rar"), str(tmp_path / "out"))


def _tar_with_escaping_member(tmp_path):
    payload = tmp_path / "payload.txt"
    payload.write_text("x")
    tar_path = str(tmp_path / "evil.tar.gz")
    with tarfile.open(tar_path, "w:gz") as archive:
        archive.add(str(payload), arcname="../escaped.txt")
    return tar_path


def test_tar_member_escaping_the_target_is_refused(tmp_path):
    tar_path = _tar_with_escaping_member(tmp_path)
    (tmp_path / "out").mkdir()
    with pytest.raises((tarfile.TarError, ValueError)):
        unzip_file(tar_path, str(tmp_path / "out"))
    assert not (tmp_path / "escaped.txt").exists()
    # The check used on Python releases without tarfile's extraction filters refuses it too.
    with tarfile.open(tar_path, "r:gz") as archive, pytest.raises(ValueError, match="outside"):
        _check_tar_members_stay_inside(archive, str(tmp_path / "out"))


def test_tar_gz_unpacks_on_pythons_without_extraction_filters(tmp_path, monkeypatch):
    monkeypatch.delattr(tarfile, "data_filter")
    _make_tree(str(tmp_path / "src"))
    tar_path = str(tmp_path / "src.tar.gz")
    with tarfile.open(tar_path, "w:gz") as archive:
        archive.add(str(tmp_path / "src"), arcname="src")
    unzip_file(tar_path, str(tmp_path / "out"))
    assert (tmp_path / "out" / "src" / "pkg" / "sub" / "deep.py").read_text() == "x = 1\n"
