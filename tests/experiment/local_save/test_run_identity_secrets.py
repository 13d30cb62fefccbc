"""The run record (``aitoolbox_run.json``) holds nothing derived from a secret value: it is byte for byte the same
whatever the secrets are, so a reader of the run folder or the bucket cannot test guesses of a password against
it (issue 31 item 8: with a hash of the real values, ``sunshine1`` was recovered from seven guesses). auto_resume,
which compares fingerprints, keeps working: a rotated secret is no other run, other hyperparameters are."""
import hashlib
import json
import os
import urllib.parse

from hypothesis import given, settings
from hypothesis import strategies as st

from aitoolbox.experiment.local_save.run_identity import (
    FINGERPRINT_VERSION, RUN_IDENTITY_FILE, RunIdentity, adoption_refusal, hyperparams_fingerprint,
    parse_run_identity, this_run_identity, write_run_identity)
from aitoolbox.experiment.redaction import Secret

NO_JOB = {}  # an environment without a job id


def record_bytes(folder, hyperparams) -> bytes:
    path = write_run_identity(str(folder), this_run_identity(hyperparams, NO_JOB))
    with open(path, "rb") as handle:
        return handle.read()


def test_guessing_a_secret_from_the_record_is_impossible(tmp_path):
    hyperparams = {"lr": 0.1, "db_password": "sunshine1", "hf_token": "hf_abc", "results_db": Secret("pg://u:pw@h")}
    written = json.loads(record_bytes(tmp_path, hyperparams))
    guesses = ["123456", "password", "qwerty", "letmein", "dragon", "monkey1", "sunshine1"]
    matching = [guess for guess in guesses
                if hyperparams_fingerprint({**hyperparams, "db_password": guess}) == written["fingerprint"]]
    assert matching == guesses  # every guess fits equally: the record says nothing about the password
    assert written["fingerprint_version"] == FINGERPRINT_VERSION


@settings(max_examples=25, deadline=None)
@given(st.text(min_size=1, max_size=30), st.text(min_size=1, max_size=30))
def test_the_record_is_the_same_whatever_the_secret_values(tmp_path_factory, password, token):
    folder = tmp_path_factory.mktemp("run")
    reference = record_bytes(folder, {"lr": 0.1, "password": "x", "nested": {"api_key": "y"}, "url": "s3://a:b@h/p"})
    # A password in a URL is percent-encoded, as URLs need.
    drawn = record_bytes(folder, {"lr": 0.1, "password": password, "nested": {"api_key": token},
                                  "url": f"s3://a:{urllib.parse.quote(token, safe='')}@h/p"})
    assert drawn == reference


def test_other_hyperparameters_are_another_run_and_a_rotated_secret_is_not():
    this = this_run_identity({"lr": 0.1, "api_token": "rotated-token"}, NO_JOB)
    same_but_old_token = this_run_identity({"lr": 0.1, "api_token": "old-token"}, NO_JOB)
    other = this_run_identity({"lr": 0.2, "api_token": "rotated-token"}, NO_JOB)
    assert adoption_refusal(this, same_but_old_token) is None
    assert adoption_refusal(this, other) == "its hyperparameters differ from this job's"


def test_a_record_of_the_first_format_counts_as_no_record(tmp_path):
    # Written by the version that hashed real values with PBKDF2: that fingerprint is not compared (nor written
    # again); the run is continued as a run without a record is, by a job without an id only.
    old = {"job_id": None, "job_id_source": None,
           "fingerprint": hashlib.pbkdf2_hmac("sha256", b'{"lr": 0.1}', b"aitoolbox-run-fingerprint-v1", 10).hex()}
    recorded = parse_run_identity(json.dumps(old), os.path.join(str(tmp_path), RUN_IDENTITY_FILE))
    assert recorded == RunIdentity(None, None, old["fingerprint"], 1)
    assert adoption_refusal(this_run_identity({"lr": 0.1}, NO_JOB), recorded) is None
    assert adoption_refusal(this_run_identity({"lr": 0.1}, {"SLURM_JOB_ID": "5"}), recorded) is not None
    assert parse_run_identity(json.dumps({**old, "fingerprint_version": "2"}), "x") is None  # not a record
