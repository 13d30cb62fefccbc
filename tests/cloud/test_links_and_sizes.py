"""Issue 31 item 9, against moto's S3 and the GCS emulator: an upload never follows a symbolic link (a link
planted in an uploaded folder once sent its target, a credentials file, to the bucket), nor opens what is not a
regular file; a download never writes an object larger (or smaller) than its folder's marker lists."""
import json
import logging
import os
import threading

import pytest

from aitoolbox.cloud.errors import CloudIntegrityError, CloudStorageError
from aitoolbox.cloud.folders import FOLDER_MARKER, open_folder
from aitoolbox.cloud.layout import download_checkpoint
from aitoolbox.cloud.uploader import CloudUploader
from aitoolbox.torchtrain.train_loop import TrainLoopCheckpoint
from tests.cloud.buckets import create_bucket, make_storage, unique_bucket_name
from tests.hang_limits import HANG_LIMIT_S
from tests.torchtrain.train_loop.test_tracking import preset_arguments

SECRET = b"aws_secret_access_key = wJalrXUtnFEMI-planted-target"


@pytest.fixture
def records(monkeypatch, caplog):
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="aitoolbox")
    return caplog


def write(path, data: bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data)
    return str(path)


def bucket_contents(bucket) -> dict:
    return {obj.key: bucket.download_bytes(obj.key) for obj in bucket.list("")}


def planted_folder(root) -> str:
    """A folder with two real files and links to a credentials file and to a folder outside it."""
    outside = root / "home"
    write(outside / ".aws" / "credentials", SECRET)
    folder = root / "upload_me"
    write(folder / "model.pth", b"weights")
    write(folder / "sub" / "events.tfevents", b"events")
    os.symlink(outside / ".aws" / "credentials", folder / "notes.txt")
    os.symlink(outside / ".aws" / "credentials", folder / "sub" / "model_E9.pth")
    os.symlink(outside / ".aws", folder / "linked_dir")
    os.mkfifo(folder / "pipe")  # opening a FIFO to read it would wait for a writer forever
    return str(folder)


def link_warnings(records) -> list:
    return [record.getMessage() for record in records.records if "symbolic link" in record.getMessage()]


def in_time(function, *args):
    """``function(*args)`` in a thread joined with the hang limit (a FIFO opened for reading hangs)."""
    result, errors = [], []
    thread = threading.Thread(target=lambda: _collect(function, args, result, errors), daemon=True)
    thread.start()
    thread.join(HANG_LIMIT_S)
    assert not thread.is_alive(), f"{function.__name__} hangs"
    if errors:
        raise errors[0]
    return result[0]


def _collect(function, args, result, errors):
    try:
        result.append(function(*args))
    except BaseException as error:  # noqa: BLE001 - re-raised in the test's thread
        errors.append(error)


@pytest.mark.parametrize("how", ["storage", "uploader"])
def test_a_folder_upload_skips_links_and_special_files_with_one_warning(bucket, tmp_path, records, how):
    folder = planted_folder(tmp_path)
    if how == "storage":
        in_time(bucket.upload_folder, folder, "run/tb")
    else:
        with CloudUploader(bucket) as uploader:
            in_time(lambda: uploader.submit_folder(folder, "run/tb").result(HANG_LIMIT_S))
    contents = bucket_contents(bucket)
    assert sorted(contents) == ["run/tb/" + FOLDER_MARKER, "run/tb/model.pth", "run/tb/sub/events.tfevents"]
    assert [key for key, data in contents.items() if SECRET in data] == []
    assert json.loads(contents["run/tb/" + FOLDER_MARKER])["files"] == {"model.pth": 7, "sub/events.tfevents": 6}
    (warning,) = link_warnings(records)
    for name in ("notes.txt", "sub/model_E9.pth", "linked_dir", "pipe"):
        assert name in warning, warning
    assert folder in warning and "home" not in warning.replace(folder, "")  # names the links, not their targets


def test_a_single_link_is_uploaded_as_nothing_by_the_uploader_and_refused_by_a_direct_upload(bucket, tmp_path,
                                                                                             records):
    folder = planted_folder(tmp_path)
    link = os.path.join(folder, "notes.txt")
    with CloudUploader(bucket) as uploader:
        assert uploader.submit(link, "run/notes.txt").result(HANG_LIMIT_S) is None
        assert uploader.submit_folder(os.path.join(folder, "linked_dir"), "run/aws").result(HANG_LIMIT_S) is None
    assert len(link_warnings(records)) == 2
    with pytest.raises(ValueError, match="symbolic link"):
        bucket.upload_file(link, "run/notes.txt")
    with pytest.raises(ValueError, match="symbolic link"):
        bucket.upload_folder(os.path.join(folder, "linked_dir"), "run/aws")
    assert bucket_contents(bucket) == {}


@pytest.mark.slow
def test_a_link_planted_in_a_run_folder_never_reaches_the_bucket(s3_env, tmp_path, records):
    # The run's top-level files are uploaded with its first checkpoint: a link among them goes up as nothing.
    bucket = make_storage("s3", unique_bucket_name("s3"))
    create_bucket("s3", bucket.bucket_name)
    tl = TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", str(tmp_path / "runs"), {"lr": 0.1},
                             cloud_save_mode="s3", bucket_name=bucket.bucket_name, show_progress=False)
    write(tmp_path / "home" / "credentials", SECRET)
    os.symlink(tmp_path / "home" / "credentials", os.path.join(tl.experiment_folder.path, "credentials_link.txt"))
    tl.fit(num_epochs=1)
    contents = bucket_contents(bucket)
    assert any(key.endswith(".pth") for key in contents)
    assert [key for key, data in contents.items() if SECRET in data or key.endswith("credentials_link.txt")] == []
    assert any("credentials_link.txt" in warning for warning in link_warnings(records))


@pytest.mark.parametrize("stored_size", [5 * 1024 * 1024, 0])
def test_a_downloaded_object_of_another_size_than_its_marker_lists_is_refused_and_nothing_is_written(
        bucket, tmp_path, stored_size):
    folder = tmp_path / "model_exp_ts_E3"
    write(folder / "checkpoint.json", b"{}")
    write(folder / "__0_0.distcp", b"x")  # 1 byte, as the marker will say
    prefix = "run/checkpoint_model/model_exp_ts_E3"
    bucket.upload_folder(str(folder), prefix)
    bucket.upload_bytes(b"\0" * stored_size, prefix + "/__0_0.distcp")  # replaced after the marker was written

    target = tmp_path / "down"
    for download in (lambda: bucket.download_folder(prefix, str(target / "model_exp_ts_E3")),
                     lambda: download_checkpoint(bucket, prefix, str(target))):
        with pytest.raises(CloudIntegrityError) as raised:
            download()
        message = str(raised.value)
        assert "__0_0.distcp" in message and "1 byte" in message and FOLDER_MARKER in message
        assert isinstance(raised.value, CloudStorageError) and isinstance(raised.value, ValueError)
        assert not target.exists() or os.listdir(target) == []  # nothing written, no temporary folder left


def test_a_marker_too_large_to_be_one_is_refused_before_it_is_read(bucket, tmp_path, monkeypatch):
    import aitoolbox.cloud.layout as layout
    import aitoolbox.cloud.storage as storage
    folder = tmp_path / "model_exp_ts_E3"
    write(folder / "checkpoint.json", b"{}")
    prefix = "run/checkpoint_model/model_exp_ts_E3"
    bucket.upload_folder(str(folder), prefix)
    for module in (storage, layout):
        monkeypatch.setattr(module, "MAX_MARKER_BYTES", 20)  # the real bound is 16 MiB
    with pytest.raises(CloudIntegrityError, match="larger than 20 bytes"):
        bucket.folder_manifest(prefix)
    assert layout.list_cloud_checkpoints(bucket, "run/checkpoint_model") == []  # not a complete checkpoint


def test_the_bounded_writer_refuses_any_write_ending_past_the_bound(tmp_path):
    from aitoolbox.cloud.bounded import BoundedWriter, PastTheBound, went_past_the_bound
    with open(tmp_path / "file", "wb") as handle:
        writer = BoundedWriter(handle, 10)
        writer.seek(6)
        writer.write(b"6789")  # ranged parts at offsets, as S3's downloads write them
        writer.seek(0)
        writer.write(b"012345")
        writer.seek(10)
        with pytest.raises(PastTheBound) as raised:
            writer.write(b"x")
        writer.seek(8)
        with pytest.raises(PastTheBound):
            writer.write(b"abc")
    assert (tmp_path / "file").read_bytes() == b"0123456789"
    try:
        raise RuntimeError("the client's wrapper") from raised.value
    except RuntimeError as wrapped:
        assert went_past_the_bound(wrapped) and not went_past_the_bound(RuntimeError("other"))


def test_a_folder_file_shrunk_before_its_upload_fails_the_upload_and_no_marker_is_written(bucket, tmp_path):
    """A file rewritten in place (truncated) between open_folder and its upload: the upload fails naming the change,
    the folder is not complete (no marker listing the old size). GCS's small uploads, resumable with a size the
    client does not know, stored what was left as the whole object (review of stop 47)."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "results.csv").write_bytes(b"epoch,loss\n" + b"1,0.5\n" * 500)
    opened = open_folder(str(folder))
    (folder / "results.csv").write_bytes(b"epoch,loss\n1,0.5\n")
    with pytest.raises(ValueError, match="ended at byte 17 of the 3011 recorded"):
        bucket.upload_open_folder(opened, "run")
    assert not bucket.is_complete_folder("run")
