"""File-system chores: nested folder creation, zipping a folder, unpacking .zip / .tar.gz archives."""
import os
import tarfile
import zipfile
from typing import List, Sequence, Tuple

from aitoolbox.experiment.local_save.atomic import TEMP_PREFIX, atomic_write


def create_folder_hierarchy(base_folder_path: str, folder_names: Sequence[str]) -> Tuple[str, List[str]]:
    """Create folders nested one inside the other under an existing folder; existing ones are kept.

    Args:
        base_folder_path: an existing folder under which the hierarchy is created.
        folder_names: the folder names, outermost first.

    Returns:
        The innermost folder's path, and the paths of the whole chain starting with ``base_folder_path``.

    Raises:
        ValueError: ``base_folder_path`` does not exist.
    """
    if not os.path.exists(base_folder_path):
        raise ValueError(f"The base folder {base_folder_path!r} does not exist: create it first or pass an "
                         f"existing folder")
    folder_path = base_folder_path
    chain = [folder_path]
    for name in folder_names:
        folder_path = os.path.join(folder_path, name)
        os.makedirs(folder_path, exist_ok=True)
        chain.append(folder_path)
    return folder_path, chain


def zip_folder(source_dir_path: str, zip_path: str) -> str:
    """Pack a folder's content into a .zip archive.

    The archive is written to a temporary file and renamed into place, so a crash never leaves a truncated
    archive at ``zip_path``.

    Args:
        source_dir_path: the folder whose content (not the folder itself) is archived.
        zip_path: where to write the archive; ``.zip`` is appended when missing.

    Returns:
        The archive's path, ending in ``.zip``.
    """
    if not zip_path.endswith(".zip"):
        zip_path += ".zip"
    zip_abs_path = os.path.abspath(zip_path)
    with atomic_write(zip_path, "wb") as handle, zipfile.ZipFile(handle, "w", zipfile.ZIP_DEFLATED) as archive:
        for dir_path, dir_names, file_names in os.walk(source_dir_path):
            dir_names.sort()
            rel_dir = os.path.relpath(dir_path, source_dir_path)
            if rel_dir != "" and rel_dir != "." and not file_names and not dir_names:
                archive.write(dir_path, rel_dir)  # keep empty folders
            for file_name in sorted(file_names):
                file_path = os.path.join(dir_path, file_name)
                # The archive may be written inside the folder it packs: leave it (and its temp file) out.
                if os.path.abspath(file_path) == zip_abs_path or file_name.startswith(TEMP_PREFIX):
                    continue
                archive.write(file_path, os.path.normpath(os.path.join(rel_dir, file_name)))
    return zip_path


def unzip_file(file_path: str, target_dir_path: str) -> None:
    """Unpack a .zip or .tar.gz archive into a folder.

    Args:
        file_path: the archive, ending in ``.zip`` or ``.tar.gz``.
        target_dir_path: the folder to unpack into (created when missing).

    Raises:
        ValueError: the archive is of another type.
    """
    if file_path.endswith(".zip"):
        with zipfile.ZipFile(file_path, "r") as archive:
            archive.extractall(target_dir_path)
    elif file_path.endswith(".tar.gz"):
        with tarfile.open(file_path, "r:gz") as archive:
            if hasattr(tarfile, "data_filter"):
                # The 'data' filter refuses members that would land outside target_dir_path or are devices.
                archive.extractall(target_dir_path, filter="data")
            else:
                # Python releases before 3.10.12 / 3.11.4 have no extraction filters: check the paths ourselves.
                _check_tar_members_stay_inside(archive, target_dir_path)
                archive.extractall(target_dir_path)
    else:
        raise ValueError(f"Cannot unpack {file_path!r}: only .zip and .tar.gz archives are supported")


def _check_tar_members_stay_inside(archive: tarfile.TarFile, target_dir_path: str) -> None:
    """Refuse an archive whose members (or link targets) would be written outside ``target_dir_path``."""
    root = os.path.realpath(target_dir_path)
    for member in archive.getmembers():
        paths = [member.name]
        if member.issym():
            paths.append(os.path.join(os.path.dirname(member.name), member.linkname))
        elif member.islnk():
            paths.append(member.linkname)
        for path in paths:
            destination = os.path.realpath(os.path.join(root, path))
            if os.path.commonpath([root, destination]) != root:
                raise ValueError(f"Refusing to unpack {member.name!r}: it would be written outside "
                                 f"{target_dir_path!r}")
        if member.isdev():
            raise ValueError(f"Refusing to unpack {member.name!r}: device files are not extracted")
