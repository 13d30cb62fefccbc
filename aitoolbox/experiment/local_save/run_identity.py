"""Who a run is: the job that started it and a fingerprint of its hyperparameters, recorded in its folder.

``auto_resume`` continues a run only when it is this job's (see :func:`adoption_refusal`): a sweep's jobs, or a
new job started after an older one finished, each start their own run instead of continuing another's.

The job id is ``AITOOLBOX_RUN_ID`` when the user sets it, else ``SLURM_JOB_ID`` (kept by a SLURM requeue), else
torchrun's ``TORCHELASTIC_RUN_ID`` (kept by the restarts of one torchrun invocation; never its default ``none``).
The fingerprint is a hash of the *redacted* hyperparameters (:func:`~aitoolbox.experiment.redaction.
redact_hyperparams`), the copy the run folder's ``hyperparams.json`` shows anyway, in a form every process computes
alike (:mod:`~aitoolbox.experiment.local_save.stable_value`: no memory addresses): two runs with the same values have
the same fingerprint, and nothing derived from a secret value is written, so the record cannot be used to test
guesses of a password. Two runs whose hyperparameters differ only in secret values (a rotated token) have the same
fingerprint.

Records of another fingerprint format (version 1 hashed the real values with PBKDF2 and a public salt, which let a
reader of the bucket test guesses of a weak secret offline; version 2 hashed a ``repr`` form that differs between
processes) are not compared: the run counts as one whose hyperparameters are unknown.
"""
import dataclasses
import hashlib
import json
import logging
import os
from typing import Mapping, Optional

from aitoolbox.experiment.local_save.atomic import atomic_write_text
from aitoolbox.experiment.local_save.stable_value import UnstableValueError, stable_json
from aitoolbox.experiment.redaction import redact_hyperparams

logger = logging.getLogger(__name__)

RUN_IDENTITY_FILE = "aitoolbox_run.json"
#: The most a run's record may hold (64 KiB, as the bucket loaders bound it); a larger one is not a record.
MAX_RUN_IDENTITY_CHARS = 64 * 1024
# Where the job id comes from, in order of precedence.
JOB_ID_VARIABLES = ("AITOOLBOX_RUN_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")
# torchrun's value of TORCHELASTIC_RUN_ID when no --rdzv-id is given: every invocation has it, so it names none.
_TORCHRUN_DEFAULT_RUN_ID = "none"
#: The fingerprint's format: 3 hashes the redacted hyperparameters' stable form (1 and 2 are no longer compared).
FINGERPRINT_VERSION = 3


@dataclasses.dataclass(frozen=True)
class RunIdentity:
    """A run's job id (None when the job has none), where it came from, its hyperparameters' fingerprint and the
    fingerprint's format (:data:`FINGERPRINT_VERSION`; 1 for records that do not say)."""

    job_id: Optional[str]
    job_id_source: Optional[str]
    fingerprint: str
    fingerprint_version: int = FINGERPRINT_VERSION

    def describe(self) -> str:
        job = f"{self.job_id_source}={self.job_id}" if self.job_id else "no job id"
        return f"{job}, hyperparameters {self.fingerprint[:12]}"


def current_job_id(environ: Optional[Mapping[str, str]] = None):
    """``(job id, variable name)`` of this job from the environment, or ``(None, None)``."""
    environ = os.environ if environ is None else environ
    for name in JOB_ID_VARIABLES:
        value = (environ.get(name) or "").strip()
        if value and not (name == "TORCHELASTIC_RUN_ID" and value == _TORCHRUN_DEFAULT_RUN_ID):
            return value, name
    return None, None


def canonical_hyperparams(hyperparams: Optional[Mapping], strict: bool = True) -> bytes:
    """The bytes a fingerprint hashes: the redacted hyperparameters in their stable form (sorted keys; see
    :mod:`~aitoolbox.experiment.local_save.stable_value`). Secret values are replaced before anything is derived
    from them.

    Args:
        hyperparams: the run's hyperparameters.
        strict: raise for a value without a form that is the same in every process. False takes such a value by its
            ``repr``: the fingerprint then matches no other process's, so no later job continues the run by its
            hyperparameters (a run without ``auto_resume`` needs no more).

    Raises:
        UnstableValueError: (``strict``) a value without a stable form; the message names it.
    """
    redacted = redact_hyperparams(hyperparams) or {}
    try:
        return stable_json(redacted).encode("utf-8")
    except UnstableValueError:
        if strict:
            raise
        return json.dumps(redacted, sort_keys=True, default=repr).encode("utf-8")


def hyperparams_fingerprint(hyperparams: Optional[dict], strict: bool = True) -> str:
    """A hex digest (SHA-256) of the redacted hyperparameters (:func:`canonical_hyperparams`; key order does not
    matter), the same in every process for equal values. It depends on no secret value: hyperparameters that differ
    only in secrets have the same one.

    Raises:
        UnstableValueError: (``strict``) a value without a stable form; the message names it.
    """
    return hashlib.sha256(canonical_hyperparams(hyperparams, strict=strict)).hexdigest()


def this_run_identity(hyperparams: Optional[dict], environ: Optional[Mapping[str, str]] = None,
                      strict: bool = True) -> RunIdentity:
    """The identity of a run this process starts now (``strict``: see :func:`hyperparams_fingerprint`)."""
    job_id, source = current_job_id(environ)
    return RunIdentity(job_id, source, hyperparams_fingerprint(hyperparams, strict=strict))


def write_run_identity(run_folder: str, identity: RunIdentity) -> str:
    """Record ``identity`` in the run folder (atomically); returns the file's path."""
    path = os.path.join(run_folder, RUN_IDENTITY_FILE)
    atomic_write_text(path, json.dumps(dataclasses.asdict(identity), indent=2, sort_keys=True))
    return path


def read_run_identity(run_folder: str) -> Optional[RunIdentity]:
    """The identity recorded in a run folder; None when there is none (a run written before identities were
    recorded) or it cannot be read."""
    path = os.path.join(run_folder, RUN_IDENTITY_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            # A record is a few hundred bytes; a planted larger one is not read into memory whole.
            text = handle.read(MAX_RUN_IDENTITY_CHARS + 1)
    except (OSError, UnicodeDecodeError) as error:
        logger.warning("auto_resume: %s cannot be read (%s); the run is treated as one without a record", path, error)
        return None
    if len(text) > MAX_RUN_IDENTITY_CHARS:
        logger.warning("auto_resume: %s is larger than the %d characters a run's record takes; the run is treated as "
                       "one without a record", path, MAX_RUN_IDENTITY_CHARS)
        return None
    return parse_run_identity(text, path)


def parse_run_identity(text: str, where: str) -> Optional[RunIdentity]:
    """The identity a :data:`RUN_IDENTITY_FILE` holds (read from ``where``, named in the warning); None when the
    text is not such a record."""
    try:
        record = json.loads(text)
        version = record.get("fingerprint_version", 1)
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"fingerprint_version is {version!r}, not a whole number")
        return RunIdentity(record["job_id"], record["job_id_source"], str(record["fingerprint"]), version)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as error:
        # RecursionError: JSON nested deeper than the parser goes (a planted file), not a record either.
        logger.warning("auto_resume: %s cannot be read (%s); the run is treated as one without a record", where, error)
        return None


def adoption_refusal(this: RunIdentity, recorded: Optional[RunIdentity]) -> Optional[str]:
    """Why a job with identity ``this`` must not continue a run recorded as ``recorded``; None when it may.

    A job continues only a run with its own hyperparameters and of its own job id (none: a run recorded without
    one), or a run written before identities were recorded (no record) when it has no job id. The job id alone
    is not enough: the jobs of a sweep inside one allocation (``srun`` steps, a loop in one ``sbatch``) share
    the allocation's ``SLURM_JOB_ID``. A record whose fingerprint is of another format cannot be compared (see the
    module): its hyperparameters count as the same.
    """
    if recorded is None:
        if this.job_id is None:
            return None
        return f"it has no job id recorded, and this job is {this.job_id_source}={this.job_id}"
    if this.job_id is not None:
        if recorded.job_id != this.job_id:
            other = f"{recorded.job_id_source}={recorded.job_id}" if recorded.job_id else "no job id"
            return f"it belongs to another job ({other}; this job is {this.job_id_source}={this.job_id})"
        if recorded.fingerprint_version == this.fingerprint_version and recorded.fingerprint != this.fingerprint:
            return (f"its hyperparameters differ from this job's (both are {this.job_id_source}={this.job_id}: "
                    "another run of the same allocation, such as a sweep's; give each its own AITOOLBOX_RUN_ID or "
                    "experiment_name to keep them apart)")
        return None
    if recorded.job_id is not None:
        return (f"it belongs to job {recorded.job_id_source}={recorded.job_id} and this job has no id (set "
                "AITOOLBOX_RUN_ID to the same value to continue it)")
    if recorded.fingerprint_version == this.fingerprint_version and recorded.fingerprint != this.fingerprint:
        return "its hyperparameters differ from this job's"
    return None
