"""The hostile-file corpus (:mod:`tests.security.corpus`) fed to every loading entry point.

Each case runs in a process of its own kind (:mod:`tests.security.worker`: several cases per process, one after
another) with a limit on its address space, and is held to the Security page (:func:`tests.security.isolated.
assert_safe`): no code from the file ran (the marker file a payload would create is absent), the process survived
(no signal), memory stayed bounded, and the error is a documented one naming the file. The entry points:
``TrainLoop.load_checkpoint``, ``load_checkpoint_file``, ``PyTorchLocalModelLoader`` (by path and by the
experiment's parts, then ``init_model``), ``ModelLoadContinueTraining``, ``auto_resume``, ``load_sharded_checkpoint``,
``read_full_model_state_dict``, and the S3 and GCS loaders (``load_model``, ``load_newest_checkpoint``,
``auto_resume`` from a bucket) against the local servers of the cloud tests.

The quick tier takes a representative few dozen cases, each through one entry point; the extended tier
(``--extended``) every case through every entry point (several hundred).
"""
import os
import shutil
from typing import Dict, List

import pytest

from tests.security import corpus, hostile
from tests.security.isolated import assert_safe, passed_over, run_cases

SEED = 31
PROJECT, EXPERIMENT, TIMESTAMP = "proj", "exp", "2024-01-02_03-04-05"
FILE_ENTRIES = ["loop", "file", "loader", "loader_parts", "continue", "auto_resume"]
# load_checkpoint_file of a folder reads the training state and checks the index, not the weights: the entry
# points that load the weights stand for it.
FOLDER_ENTRIES = ["sharded", "consolidate", "loop", "loader", "auto_resume", "loader_parts"]
BUCKET_ENTRIES = ["bucket_load_model", "bucket_newest", "bucket_auto_resume"]

pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to (save|load) in a single process")


def checkpoint_path(root: str, folder: bool) -> str:
    name = f"model_{EXPERIMENT}_{TIMESTAMP}_E1"
    return os.path.join(root, PROJECT, f"{EXPERIMENT}_{TIMESTAMP}", "checkpoint_model",
                        name if folder else f"{name}.pth")


def local_cases(hostiles: List[corpus.Hostile], work: str, every_entry: bool) -> List[dict]:
    """The cases of ``hostiles``, built under ``work``: through every entry point, or each through one (in turn)."""
    cases = []
    for index, case in enumerate(hostiles):
        entries = FOLDER_ENTRIES if case.folder else FILE_ENTRIES
        for entry in entries if every_entry else [entries[index % len(entries)]]:
            number = len(cases)
            root = os.path.join(work, f"case{number}")
            path = checkpoint_path(root, case.folder)
            marker = os.path.join(work, f"case{number}.marker")
            case.build(path, marker)
            cases.append({"id": f"{case.name}@{entry}", "entry": entry, "path": path, "root": root,
                          "project": PROJECT, "experiment": EXPERIMENT, "timestamp": TIMESTAMP, "epoch": 1,
                          "marker": marker, "names": [path], "may_load": case.may_load or entry in case.unread_by})
    return cases


def warm_up(work: str, template: str) -> List[dict]:
    """Valid checkpoints through each entry point, so that a case's memory is what loading it costs."""
    root = os.path.join(work, "warm")
    path = checkpoint_path(root, False)
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as handle:
        handle.write(hostile.torch_bytes(hostile.small_checkpoint()))
    shutil.copytree(template, checkpoint_path(root, True).replace("_E1", "_E0"))
    entries = FILE_ENTRIES + ["sharded", "consolidate"]
    return [{"entry": entry, "path": path if entry not in ("sharded", "consolidate")
             else checkpoint_path(root, True).replace("_E1", "_E0"), "root": root, "project": PROJECT,
             "experiment": EXPERIMENT, "timestamp": TIMESTAMP, "epoch": 1} for entry in entries]


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> str:
    """A valid sharded checkpoint, copied and changed by the folder cases."""
    return hostile.sharded_checkpoint(str(tmp_path_factory.mktemp("template") / f"model_{EXPERIMENT}_{TIMESTAMP}_E1"))


def run_and_judge(cases: List[dict], work: str, warm: List[dict]) -> Dict[str, dict]:
    results = run_cases(cases, os.path.join(work, "worker"), warm_up=warm)
    failures = []
    for case in cases:
        try:
            assert_safe(case, results[case["id"]])
        except AssertionError as failure:
            failures.append(str(failure)[:1500])
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures)
    return results


def test_the_corpus_quick_tier(tmp_path, template):
    """A few dozen cases of every family, each through one entry point, in one process."""
    work = str(tmp_path)
    hostiles = corpus.file_cases(SEED, extended=False) + corpus.folder_cases(SEED, extended=False, template=template)
    cases = local_cases(hostiles, work, every_entry=False)
    assert len(cases) >= 40 and {case["entry"] for case in cases} == set(FILE_ENTRIES + FOLDER_ENTRIES)
    results = run_and_judge(cases, work, warm_up(work, template))
    refused = [result for result in results.values() if result["outcome"] == "error"]
    skipped = [case for case in cases if passed_over(case, results[case["id"]])]
    assert len(refused) + len(skipped) >= len(cases) - sum(case["may_load"] for case in cases)


@pytest.mark.extended
@pytest.mark.parametrize("family", ["files", "folders"])
def test_the_corpus_through_every_entry_point(tmp_path, template, family):
    """Every case of the corpus through every entry point (several hundred cases)."""
    work = str(tmp_path)
    hostiles = corpus.file_cases(SEED, extended=True) if family == "files" else \
        corpus.folder_cases(SEED, extended=True, template=template)
    cases = local_cases(hostiles, work, every_entry=True)
    assert len(cases) >= (400 if family == "files" else 200)
    run_and_judge(cases, work, warm_up(work, template))


# --- buckets --------------------------------------------------------------------------------------------------------
def bucket_cases(hostiles: List[corpus.Hostile], bucket, service: str, work: str, every_entry: bool,
                 label: str = "") -> List[dict]:
    """The cases of ``hostiles`` placed in ``bucket`` (each under a prefix of its own, starting ``label``) where a
    run's checkpoint of epoch 1 goes; loaded into an empty local folder."""
    cases = []
    for index, case in enumerate(hostiles):
        if not case.uploadable:
            continue
        for entry in BUCKET_ENTRIES if every_entry else [BUCKET_ENTRIES[index % len(BUCKET_ENTRIES)]]:
            number = len(cases)
            staging = os.path.join(work, f"staging{number}")
            path = checkpoint_path(staging, case.folder)
            marker = os.path.join(work, f"case{number}.marker")
            case.build(path, marker)
            prefix = f"{label}case{number}"
            key = f"{prefix}/{os.path.relpath(path, staging)}"
            if case.folder:
                bucket.upload_folder(path, key)
            else:
                bucket.upload_file(path, key)
            cases.append({"id": f"{label}{case.name}@{entry}", "entry": entry, "service": service,
                          "bucket": bucket.bucket_name, "prefix": prefix, "root": os.path.join(work, f"local{number}"),
                          "project": PROJECT, "experiment": EXPERIMENT, "timestamp": TIMESTAMP, "epoch": 1,
                          "path": None, "marker": marker, "names": [os.path.basename(path)],
                          "may_load": case.may_load or entry in case.unread_by})
    return cases


def _bucket_hostiles(template: str, extended: bool) -> List[corpus.Hostile]:
    files = corpus.file_cases(SEED, extended=extended)
    folders = corpus.folder_cases(SEED, extended=extended, template=template)
    if extended:
        return files + folders
    wanted = {"refused-os.system-hyperparams-p2", "numpy-object-field-array-in-early_stop", "bomb-lying-size",
              "index-int-with-rank-local", "entry-absolute", "index-planted", "truncated"}
    return [case for case in files + folders if case.name in wanted or case.name.split("-")[0] in wanted]


@pytest.mark.slow  # the servers, the uploads and a process of its own: about a minute
def test_the_corpus_through_the_bucket_loaders(service, bucket, tmp_path, template):
    """Hostile checkpoints planted in a bucket (moto's S3, the GCS emulator), loaded by the 1.x cloud loaders
    and by ``auto_resume`` from the bucket."""
    work = str(tmp_path)
    cases = bucket_cases(_bucket_hostiles(template, extended=False), bucket, service, work, every_entry=False)
    assert len(cases) >= 7
    run_and_judge(cases, work, warm_up(work, template))


@pytest.mark.extended
def test_the_whole_corpus_through_the_bucket_loaders(service, bucket, tmp_path, template):
    """Every case of the corpus through a bucket loader (each through one, in turn), the quick tier's through all
    three."""
    work = str(tmp_path)
    cases = bucket_cases(_bucket_hostiles(template, extended=True), bucket, service, work, every_entry=False)
    cases += bucket_cases(_bucket_hostiles(template, extended=False), bucket, service, os.path.join(work, "all"),
                          every_entry=True, label="all-")
    assert len(cases) >= 150
    run_and_judge(cases, work, warm_up(work, template))
