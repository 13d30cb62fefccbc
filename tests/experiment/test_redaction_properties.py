"""Redaction as an invariant: however a secret is placed in a hyperparameter structure (under a secret-looking key
of any spelling, in a URL, an assignment in text, a header list, a dict's keys, wrapped in ``Secret``, a number
under a credential's name, a name-value record, a command line or argv list, a PEM private key, a tuple key), and
however deep in dicts, lists, tuples, namespaces and dataclasses, nothing a destination writes from the redacted
copy (its ``json.dumps(..., default=repr)`` and ``str``, and the run folder's hyperparameter files) shows it; the
given structure is not changed, and the plain values stay as they were."""
import argparse
import copy
import dataclasses
import json
import os
import tempfile
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aitoolbox.experiment.local_save.experiment_folder import ExperimentFolder, json_keys
from aitoolbox.experiment.redaction import REDACTED, Secret, redact_hyperparams, redact_text
from aitoolbox.experiment.result_reporting.hyperparam_reporter import HyperParamSourceReporter
from aitoolbox.experiment.secret_names import CREDENTIAL_QUALIFIERS, SECRET_WORDS, is_secret_key

# The quick tier draws a few dozen structures; the extended tier thousands (a few minutes).
PROPERTY_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EXTENDED_SETTINGS = settings(max_examples=2500, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Secrets: a marker no plain value holds, then characters a token or password has.
SECRET_TEXT = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._~+-", min_size=6,
                      max_size=24).map(lambda body: f"QX{body}XQ")
# Plain values: lower-case words and numbers (never the marker).
PLAIN_WORDS = ["adam", "relu", "cosine", "bpe", "val loss", "cnn", "eu-west-1", "db.internal", "/data/train"]
PLAIN = st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=False, allow_infinity=False), st.booleans(),
                  st.none(), st.sampled_from(PLAIN_WORDS))
PLAIN_KEYS = st.sampled_from(["lr", "batch_size", "optimizer", "depth", "dropout", "layers", "scheduler", "seed",
                              "tokenizer", "keyboard_layout", "monkey", "passage_len", "author"])


def spellings(words):
    """A key made of ``words`` in one of the spellings keys come in."""
    return st.sampled_from([
        "_".join(words), "-".join(words), ".".join(words), "".join(words), "_".join(words).upper(),
        words[0] + "".join(word.capitalize() for word in words[1:]), " ".join(words).title()])


@st.composite
def secret_keys(draw):
    word = draw(st.sampled_from(sorted(SECRET_WORDS)))
    word = word + draw(st.sampled_from(["", "s"]))
    if draw(st.booleans()):  # fused with a qualifier: accesstoken, dbpassword
        word = draw(st.sampled_from(sorted(CREDENTIAL_QUALIFIERS))) + word
    before = draw(st.lists(st.sampled_from(["db", "prod", "hf", "my", "aws", "x", "service"]), max_size=2))
    after = draw(st.lists(st.sampled_from(["value", "prod", "v2", "file"]), max_size=1))
    name = draw(spellings(before + [word] + after))
    # Fused all in one ("dbpasswordvalue"), a secret word counts only at the end, or when it is a long one.
    # Fused, the words before it must be qualifiers ("dbtoken", "hfapikey"; "xtoken" is no secret's name).
    fused_ambiguously = name.isalnum() and (after or not set(before) <= CREDENTIAL_QUALIFIERS)
    return "_".join(before + [word] + after) if fused_ambiguously else name


@st.composite
def placed_secrets(draw, secrets: list):
    """A value that holds one new secret, placed in one of the ways secrets reach hyperparameters."""
    secret = draw(SECRET_TEXT)
    secrets.append(secret)
    way = draw(st.integers(0, 13))
    if way == 0:
        return {draw(secret_keys()): secret}
    if way == 1:
        return Secret(secret)
    if way == 2:
        scheme = draw(st.sampled_from(["postgresql", "https", "redis", "mongodb+srv", "s3"]))
        user = draw(st.sampled_from(["", "trainer", "x-access-token"]))
        userinfo = f"{user}:{secret}" if draw(st.booleans()) else secret
        return f"{draw(st.sampled_from(['', '--db ', 'url is ']))}{scheme}://{userinfo}@db.internal:5432/runs"
    if way == 3:
        name = draw(secret_keys())
        separator = draw(st.sampled_from(["=", ": ", " = ", "='", '": "']))
        return f"{draw(st.sampled_from(['', 'cfg ', '?', 'Server=db;']))}{name}{separator}{secret}" \
               f"{draw(st.sampled_from(['', ';', '&page=2', ' --lr 0.1', chr(39)]))}"
    if way == 4:
        return [("Accept", "application/json"), (draw(st.sampled_from(["Authorization", "X-Api-Key", "Cookie"])),
                                                  draw(st.sampled_from(["Bearer ", "Basic ", ""])) + secret)]
    if way == 5:
        return {draw(secret_keys()): {secret: draw(st.integers(0, 9))}}
    if way == 6:
        return f"curl -H 'Bearer {secret}' https://api.internal"
    if way == 7:
        return {draw(secret_keys()): [secret, {"nested": secret}]}
    if way == 8:  # a number under a credential's name: the digits are the secret
        number = draw(st.integers(10**14, 10**15 - 1))
        secrets[-1] = str(number)
        name = draw(st.sampled_from(["api_key", "access_token", "pass", "key", "hf_token", "password", "pin_pass"]))
        return {name: number}
    if way == 9:  # a name-value record (Kubernetes' env list)
        name_key, value_key = draw(st.sampled_from([("name", "value"), ("key", "value"), ("Name", "Value")]))
        return [{name_key: draw(secret_keys()).upper(), value_key: secret}, {name_key: "LR", value_key: "0.1"}]
    if way == 10:  # a command line, as text or as an argv list
        option = "--" + draw(st.sampled_from(["password", "api-key", "hf_token", "db-pass", "client-secret"]))
        shape = draw(st.integers(0, 3))
        if shape == 0:
            return f"python train.py {option} {secret} --lr 0.1"
        if shape == 1:
            return f"python train.py {option}={secret}"
        if shape == 2:
            return ["train.py", option, secret, "--lr", "0.1"]
        return f"mysql -u root -p{secret} runs"
    if way == 11:  # a private key under an innocent name
        kind = draw(st.sampled_from(["", "RSA ", "EC ", "ENCRYPTED ", "OPENSSH "]))
        pem = f"-----BEGIN {kind}PRIVATE KEY-----\n{secret}\n-----END {kind}PRIVATE KEY-----\n"
        return {draw(PLAIN_KEYS): draw(st.sampled_from([pem, pem.encode(), pem[:-30]]))}
    if way == 12:  # a tuple key
        return {(draw(secret_keys()), secret): draw(PLAIN)}
    return {draw(secret_keys()): draw(st.sampled_from([secret.encode(), bytearray(secret.encode())]))}


@dataclasses.dataclass
class Config:
    name: str
    value: object


def containers(children):
    return st.one_of(
        st.dictionaries(PLAIN_KEYS, children, max_size=3),
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(PLAIN_KEYS, children, max_size=3).map(lambda items: argparse.Namespace(**items)),
        st.dictionaries(PLAIN_KEYS, children, max_size=3).map(lambda items: types.SimpleNamespace(**items)),
        children.map(lambda child: Config("run", child)))


@st.composite
def hyperparams_with_secrets(draw):
    secrets: list = []
    leaves = st.one_of(PLAIN, placed_secrets(secrets))
    tree = st.recursive(leaves, containers, max_leaves=8)
    hyperparams = draw(st.dictionaries(PLAIN_KEYS, tree, min_size=1, max_size=4))
    hyperparams["lr"] = 0.125
    hyperparams["placed"] = draw(placed_secrets(secrets))  # at least one secret in every example (an innocent key)
    return hyperparams, secrets


def check_nothing_written_shows_a_secret(drawn) -> None:
    hyperparams, secrets = drawn
    given_copy = copy.deepcopy(hyperparams)
    redacted = redact_hyperparams(hyperparams)
    written = json.dumps(json_keys(redacted), default=repr) + str(redacted) + repr(redacted)
    assert [secret for secret in secrets if secret in written] == []
    assert redacted["lr"] == 0.125
    assert hyperparams == given_copy  # the script's dict keeps its real values


@PROPERTY_SETTINGS
@given(hyperparams_with_secrets())
def test_no_secret_survives_in_anything_written_from_the_redacted_copy(drawn):
    check_nothing_written_shows_a_secret(drawn)


def check_no_written_file_shows_a_secret(drawn) -> None:
    """The run folder's ``hyperparams_list.txt`` and ``hyperparams.json`` (both writers), searched byte by byte."""
    hyperparams, secrets = drawn
    with tempfile.TemporaryDirectory() as root:
        ExperimentFolder(root, "proj", "exp", "ts").save_hyperparams(hyperparams, copy_script=False)
        HyperParamSourceReporter("proj", "exp", "ts2", root).save_hyperparams_to_text_file(hyperparams)
        written = b""
        for folder, _, names in os.walk(root):
            for name in names:
                with open(os.path.join(folder, name), "rb") as handle:
                    written += handle.read()
    assert written and [secret for secret in secrets if secret.encode() in written] == []


@PROPERTY_SETTINGS
@given(hyperparams_with_secrets())
def test_no_secret_survives_in_the_written_hyperparameter_files(drawn):
    check_no_written_file_shows_a_secret(drawn)


@pytest.mark.extended
@EXTENDED_SETTINGS
@given(hyperparams_with_secrets())
def test_no_secret_survives_in_the_written_hyperparameter_files_extended(drawn):
    check_no_written_file_shows_a_secret(drawn)


@pytest.mark.extended
@EXTENDED_SETTINGS
@given(hyperparams_with_secrets())
def test_no_secret_survives_in_anything_written_from_the_redacted_copy_extended(drawn):
    check_nothing_written_shows_a_secret(drawn)


@PROPERTY_SETTINGS
@given(secret_keys())
def test_every_spelling_of_a_secret_name_looks_secret(name):
    assert is_secret_key(name), name


@PROPERTY_SETTINGS
@given(st.lists(st.sampled_from(["max", "num", "tokenizer", "keyboard", "monkey", "turkey", "passage", "author",
                                 "signal", "compass", "bypass", "hotkey", "subtoken", "secretary", "layers", "lr"]),
                min_size=1, max_size=3).flatmap(spellings))
def test_innocent_names_do_not(name):
    assert not is_secret_key(name), name


@PROPERTY_SETTINGS
@given(st.text())
def test_redacting_text_never_fails_and_is_idempotent(text):
    once = redact_text(text)
    assert redact_text(once) == once
    assert (once == text) or REDACTED in once
