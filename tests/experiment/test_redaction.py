"""The redaction rules: which hyperparameter values count as secret, and what the redacted copy keeps."""
import argparse
import collections
import copy
import dataclasses
import json
import pickle

import numpy as np
import pytest

from aitoolbox.experiment.redaction import (
    REDACTED, Secret, is_credentials_file, is_secret_key, key_words, redact_hyperparams, redact_text)


@pytest.mark.parametrize("name", ["api_key", "apiKey", "APIKey", "API_KEY", "x-api-key", "apikey", "hfToken",
                                  "hf_token", "access_tokens", "AWS_SECRET_ACCESS_KEY", "client.secret",
                                  "db_password", "DB PASSWORD", "passwd", "credentials", "gcpCredential",
                                  "Authorization", "key", "Token", "key2", "ssh_passphrase"])
def test_keys_that_look_secret(name):
    assert is_secret_key(name)


@pytest.mark.parametrize("name", ["monkey", "keyboard", "hockey_team", "tokenizer", "tokenization", "passage_len",
                                  "secretary", "lr", "learning_rate", "author", "keystone", "passport", 3, None])
def test_keys_that_do_not(name):
    assert not is_secret_key(name)


def test_key_words_split_at_separators_and_camel_case():
    assert key_words("AWS_SECRET_ACCESS_KEY") == ["aws", "secret", "access", "key"]
    assert key_words("hfToken") == ["hf", "token"]
    assert key_words("APIKey2") == ["api", "key", "2"]
    assert key_words("optimizer.lr-max") == ["optimizer", "lr", "max"]


def test_secret_values_are_replaced_and_the_rest_kept():
    hyperparams = {"lr": 0.1, "api_key": "sk-1", "monkey": "george", "password": 123456,
                   "aws": {"region": "eu-west-1", "secret_access_key": "abc"},
                   "credentials": {"user": "me", "pw": "x"}, "stages": [{"token": "t1"}, {"depth": 3}],
                   "pair": ("a", {"key": "k"}), "db": Secret("postgresql://u:pw@h/db")}
    assert redact_hyperparams(hyperparams) == {
        "lr": 0.1, "api_key": REDACTED, "monkey": "george", "password": REDACTED,
        "aws": {"region": "eu-west-1", "secret_access_key": REDACTED},
        "credentials": REDACTED,  # everything under a secret key
        "stages": [{"token": REDACTED}, {"depth": 3}], "pair": ("a", {"key": REDACTED}), "db": REDACTED}


def test_model_sizes_named_token_or_key_are_kept():
    hyperparams = {"max_tokens": 512, "pad_token_id": 0, "num_key_value_heads": 8, "key_dims": [64, 64],
                   "token": {4: 4}, "eos_token": "</s>", "api_key": 12345, "secret_seed": 7,
                   "use_password": True, "hf_token": None, "access_token": "", "num_tokens": np.int64(7)}
    assert redact_hyperparams(hyperparams) == {
        "max_tokens": 512, "pad_token_id": 0, "num_key_value_heads": 8, "key_dims": [64, 64], "token": REDACTED,
        "eos_token": REDACTED, "api_key": REDACTED, "secret_seed": REDACTED,
        "use_password": True, "hf_token": None, "access_token": "", "num_tokens": 7}


def test_the_given_dict_is_not_changed_and_the_copy_is_new():
    hyperparams = {"nested": {"token": "t", "sizes": [1, 2]}, "tags": ["a"]}
    given = copy.deepcopy(hyperparams)
    redacted = redact_hyperparams(hyperparams)
    assert hyperparams == given
    assert redacted["tags"] == ["a"] and redacted["tags"] is not hyperparams["tags"]
    assert redacted["nested"]["sizes"] is not hyperparams["nested"]["sizes"]
    assert redact_hyperparams(None) == {}


def test_namespaces_dataclasses_and_namedtuples_are_searched():
    @dataclasses.dataclass(frozen=True)
    class Config:
        hub_token: str
        lr: float

    Pair = collections.namedtuple("Pair", "name password")
    args = argparse.Namespace(access_token="t", depth=3)
    config = Config("hf_abc", 0.1)
    redacted = redact_hyperparams({"args": args, "config": config, "pair": Pair("me", "pw"), "plain": Config})
    assert vars(redacted["args"]) == {"access_token": REDACTED, "depth": 3} and args.access_token == "t"
    assert redacted["config"] == Config(REDACTED, 0.1) and config.hub_token == "hf_abc"
    assert redacted["pair"] == Pair("me", REDACTED)
    assert redacted["plain"] is Config


def test_secret_hides_its_value_in_text_and_keeps_it_for_code():
    secret = Secret("pw-123")
    assert secret.get_secret_value() == "pw-123"
    assert "pw-123" not in str(secret) + repr(secret) + json.dumps({"s": secret}, default=repr)
    assert f"{secret}" == REDACTED and Secret(secret) == secret and len({secret, Secret("pw-123")}) == 1
    assert pickle.loads(pickle.dumps(secret)).get_secret_value() == "pw-123"  # travels to training processes
    assert copy.deepcopy(secret).get_secret_value() == "pw-123"


def test_objects_with_get_secret_value_count_as_secrets():
    class PydanticLike:  # pydantic's SecretStr has this method
        def get_secret_value(self):
            return "s"

    assert redact_hyperparams({"url": PydanticLike()}) == {"url": REDACTED}


def test_not_a_mapping_is_refused():
    with pytest.raises(TypeError, match="hyperparams must be a dict"):
        redact_hyperparams(["lr", 0.1])


@pytest.mark.parametrize("path", [".env", "conf/.env.local", "prod.env", "credentials.json", "client_secret.json",
                                  "token.pickle", "api_key.txt", "server.pem", "tls.key", "id_rsa", "id_ed25519.pub",
                                  ".netrc", ".git-credentials", "secrets.py", "db_passwords.py", "cert.p12"])
def test_credentials_files(path):
    assert is_credentials_file(path)


@pytest.mark.parametrize("path", ["train.py", "token_classification.py", "keys.py", "tokenizer.json",
                                  "requirements.txt", "config.yaml", "monkey.py", "README.md"])
def test_files_that_are_not_credentials(path):
    assert not is_credentials_file(path)


# --- issue 31 item 8: what the rules missed ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["dbpassword", "DBPASSWORD", "accesstoken", "apitoken", "authtoken", "clientsecret",
                                  "secretkey", "privatekey", "userpassword", "refreshTokens", "dbpasswd", "masterkey",
                                  "awssecretaccesskey", "passkey", "sshpassphrase", "googlecredentials", "db_pass",
                                  "DB_PWD", "auth", "oauth", "cookies", "X-Amz-Signature", "slack_webhook"])
def test_compound_and_more_keys_look_secret(name):
    assert is_secret_key(name)


@pytest.mark.parametrize("name", ["turkey", "donkey", "whiskey", "jockey", "hotkey", "turnkey", "subtoken",
                                  "padtoken", "maxtokens", "secretariat", "bypass", "compass", "passage", "author",
                                  "authority", "signal", "assignment"])
def test_compound_words_that_are_not_secret(name):
    assert not is_secret_key(name)


def test_the_names_of_a_secret_named_dict_are_redacted_with_its_values():
    # A dict under a secret key whose values are numbers: its keys (the API keys themselves) must not be written.
    redacted = redact_hyperparams({"api_keys": {"sk-live-abc123": 1}, "tokens": {"hf_abcdef": 3},
                                   "max_tokens": {"train": 512}, "key_sizes": {0: 64, 1: 128}})
    # Under "token" and "key" numbers are kept, in a dict only with numbers for its keys too.
    assert redacted == {"api_keys": REDACTED, "tokens": REDACTED, "max_tokens": REDACTED, "key_sizes": {0: 64, 1: 128}}


def test_header_lists_are_redacted_by_their_names():
    headers = [("Authorization", "Bearer eyJhbGciOi.abc.def"), ("Accept", "application/json"),
               ["X-Api-Key", "k-123"], ("Cookie", "session=s3cr3t")]
    redacted = redact_hyperparams({"headers": headers, "http": {"headers": tuple(headers)}})
    expected = [("Authorization", REDACTED), ("Accept", "application/json"), ["X-Api-Key", REDACTED],
                ("Cookie", REDACTED)]
    assert redacted == {"headers": expected, "http": {"headers": tuple(expected)}}


@pytest.mark.parametrize("value, expected", [
    ("postgresql://trainer:pw-51@db.internal:5432/runs", "postgresql://<redacted>@db.internal:5432/runs"),
    ("https://ghp_tok3n@github.com/org/repo.git", "https://<redacted>@github.com/org/repo.git"),
    ("--db redis://:pw-9@cache:6379/0 --lr 0.1", "--db redis://<redacted>@cache:6379/0 --lr 0.1"),
    ("https://example.com/path?api_key=k-1&page=2", "https://example.com/path?api_key=<redacted>&page=2"),
    ("Server=db;Database=runs;Password=pw-7;", "Server=db;Database=runs;Password=<redacted>;"),
    ("Authorization: Bearer eyJhbGciOi.abc.def", "Authorization: <redacted>"),
    ("curl -H 'Bearer eyJhbGciOi.abc.def' x", "curl -H 'Bearer <redacted>' x"),
    ("https://example.com/a?b=1", "https://example.com/a?b=1"),
    ("cnn_baseline", "cnn_baseline"),
])
def test_secrets_inside_strings_are_redacted_wherever_the_string_is(value, expected):
    assert redact_hyperparams({"dsn": value, "nested": [{"cmd": value}]}) == {"dsn": expected,
                                                                              "nested": [{"cmd": expected}]}


def test_simple_namespaces_and_objects_holding_secrets_are_searched():
    import types

    class Config:  # a plain class whose repr shows its fields, as many configuration classes do
        def __init__(self):
            self.password, self.depth = "pw-obj-1", 3

        def __repr__(self):
            return f"Config(password={self.password!r}, depth={self.depth})"

    class Plain:
        def __init__(self):
            self.depth = 3

    plain = Plain()
    redacted = redact_hyperparams({"ns": types.SimpleNamespace(password="pw-ns-1", depth=3), "config": Config(),
                                   "plain": plain, "url_object": types.SimpleNamespace(dsn="mysql://u:pw-2@h/db")})
    assert vars(redacted["ns"]) == {"password": REDACTED, "depth": 3}
    assert redacted["config"] == REDACTED and redacted["plain"] is plain
    assert vars(redacted["url_object"]) == {"dsn": "mysql://<redacted>@h/db"}
    assert "pw-" not in json.dumps(redacted, default=repr)


def test_top_level_dataclasses_and_namespaces_nested_anywhere_are_searched():
    @dataclasses.dataclass
    class Inner:
        token: str

    @dataclasses.dataclass
    class Outer:
        inner: Inner
        items: list

    value = {"run": [Outer(Inner("tok-1"), [argparse.Namespace(api_key="k-2")])]}
    text = json.dumps(redact_hyperparams(value), default=repr)
    assert "tok-1" not in text and "k-2" not in text and value["run"][0].inner.token == "tok-1"


@pytest.mark.parametrize("path", ["service-account.json", "my_service_account.json", ".s3cfg", ".boto", "kubeconfig",
                                  "prod.kubeconfig", ".dockercfg", ".envrc", ".my.cnf", ".mylogin.cnf", ".pgpass",
                                  ".databrickscfg", "kaggle.json", ".bash_history", "prod.tfvars",
                                  "terraform.tfstate", "putty.ppk", "proj/.kube/config", "proj/.docker/config.json",
                                  "proj/.aws/config", "proj/.ssh/known_hosts", "proj/.git/config",
                                  "proj/.config/gcloud/access_tokens.db", ".vault-token", ".yarnrc"])
def test_more_credentials_files(path):
    assert is_credentials_file(path)


def test_folders_above_the_uploaded_one_are_not_judged():
    # A project that lives below a folder named like one of credentials is uploaded as usual.
    assert not is_credentials_file("/home/me/.aws/tools/train.py", root="/home/me/.aws/tools")
    assert is_credentials_file("/home/me/project/.aws/config", root="/home/me/project")


def test_name_value_records_are_redacted_by_the_name_they_give():
    # Kubernetes' env lists and most config formats: the secret's name is a value, its value sits under "value".
    redacted = redact_hyperparams({"env": [{"name": "DB_PASSWORD", "value": "pw-41"}, {"name": "LR", "value": "0.1"},
                                           {"Key": "AWS_SECRET_ACCESS_KEY", "Value": 12345678}]})
    assert redacted == {"env": [{"name": "DB_PASSWORD", "value": REDACTED}, {"name": "LR", "value": "0.1"},
                                {"Key": "AWS_SECRET_ACCESS_KEY", "Value": REDACTED}]}


def test_numbers_under_credential_names_are_redacted_and_model_sizes_kept():
    redacted = redact_hyperparams({"api_key": 98765432101234, "access_token": 1234, "pass": 4321, "key": 7,
                                   "hf_token": 5, "id_token": 6, "max_tokens": 512, "bos_token_id": 1,
                                   "num_key_value_heads": 8, "key_dim": 64, "n_pass": 2})
    assert redacted == {"api_key": REDACTED, "access_token": REDACTED, "pass": REDACTED, "key": REDACTED,
                        "hf_token": REDACTED, "id_token": REDACTED, "max_tokens": 512, "bos_token_id": 1,
                        "num_key_value_heads": 8, "key_dim": 64, "n_pass": 2}
    assert redact_hyperparams({"cmd": "api_key=123456 max_tokens=512"}) == {
        "cmd": f"api_key={REDACTED} max_tokens=512"}


@pytest.mark.parametrize("value, expected", [
    ("python train.py --password pw-1 --lr 0.1", f"python train.py --password {REDACTED} --lr 0.1"),
    ("python train.py --password=pw-1", f"python train.py --password={REDACTED}"),
    ("run -api-key pw-1", f"run -api-key {REDACTED}"),
    ("mysql -u root -ppw-1 db", f"mysql -u root -p{REDACTED} db"),
    ("mysql -p'pw 1' db", f"mysql -p{REDACTED} db"),
    ("python train.py --max-tokens 512", "python train.py --max-tokens 512"),
])
def test_command_line_options_in_text_are_redacted(value, expected):
    assert redact_hyperparams({"cmd": value}) == {"cmd": expected}


def test_argv_lists_are_redacted_option_by_option():
    argv = ["train.py", "--password", "pw-1", "--max-tokens", "512", "--lr", "0.1", "--token=pw-2", "-ppw-3"]
    assert redact_hyperparams({"argv": argv, "t": tuple(argv)})["argv"] == [
        "train.py", "--password", REDACTED, "--max-tokens", "512", "--lr", "0.1", f"--token={REDACTED}",
        f"-p{REDACTED}"]


@pytest.mark.parametrize("kind", ["PRIVATE KEY", "RSA PRIVATE KEY", "ENCRYPTED PRIVATE KEY", "OPENSSH PRIVATE KEY"])
def test_private_keys_are_redacted_under_any_name(kind):
    pem = f"-----BEGIN {kind}-----\nMIIEvQIBADANBg\n-----END {kind}-----\n"
    redacted = redact_hyperparams({"cert": pem, "raw": pem.encode(), "cut": pem[:40], "note": f"key: {pem}"})
    assert "MIIEvQIBADANBg" not in repr(redacted)
    assert redacted["cert"] == f"{REDACTED}\n" and redacted["raw"] == REDACTED


def test_tuple_keys_of_dicts_are_redacted():
    redacted = redact_hyperparams({"k": {("token", "tk-1"): 1, ("lr", 0.1): 2, (1, 2): 3}})
    assert redacted["k"] == {("token", REDACTED): 1, ("lr", 0.1): 2, (1, 2): 3}


@pytest.mark.parametrize("text, expected", [
    ("train --password -x1!s3cret --lr 0.1", "train --password <redacted> --lr 0.1"),  # a value starting with "-"
    ("--api-key -k3y", "--api-key <redacted>"),
    ("--lr -0.5 --epochs 3", "--lr -0.5 --epochs 3"),  # a negative number after an ordinary option stays
])
def test_a_secret_option_s_value_starting_with_a_dash_is_redacted(text, expected):
    assert redact_text(text) == expected


SECRET = "Hunter2Zq9"


@pytest.mark.parametrize("hyperparams", [
    {"cmd": f'train.py --password "{SECRET} two" --lr 0.1'},  # a quoted value, whole
    {"cmd": f"train.py --password '{SECRET}'"},
    {"cfg": f'password = "correct {SECRET} staple"'},
    {"cfg": json.dumps({"password": f"correct {SECRET} staple"})},
    {"cfg": json.dumps({"password": f"ab,{SECRET}"})},
    {"cfg": f"password=ab;{SECRET}"},  # a ";" inside a value does not end it
    {"cfg": json.dumps({"api_key": f'ab"{SECRET}'})},  # an escaped quote does not end it
    {"url": f"postgresql://user:ab/{SECRET}@host/db"},  # unencoded "/", "#", "?" in a URL's password
    {"url": f"redis://:ab#{SECRET}@host:6379"},
    {"url": f"mysql://u:ab?{SECRET}@host/db"},
    {"notify": f"https://hooks.slack.com/services/T000/B000/{SECRET}"},
    {"notify": f"https://discord.com/api/webhooks/123/{SECRET}"},
    {"cmd": f"sshpass -p {SECRET} ssh host"},
    {"cmd": f"curl -u admin:{SECRET} https://x"},
    {"cmd": f'curl --user "admin:{SECRET}" https://x'},
    {"netrc": f"machine example.com login u password {SECRET}\n"},
    {"env": ["USER", "bob", "PASSWORD", SECRET]},  # a flat list of names and values
    {"hdr": ("Authorization", "Bearer", SECRET)},
    {"argv": ["--password", "=", SECRET]},
    {"env": [{"name": "DB_PASSWORD", "val": SECRET}]},
    {"env": [{"name": "PGPASS", "value": SECRET}]},
    {"params": [{"ParameterKey": "DbPassword", "ParameterValue": SECRET}]},
    {"GITHUB_PAT": SECRET}, {"azure_sas": SECRET}, {"passcode": SECRET}, {"CI_JOB_JWT": SECRET},
    {"SESSIONID": SECRET}, {"session_id": SECRET},
    {"pässword": SECRET}, {"ｐａｓｓｗｏｒｄ": SECRET}, {"p\u0430ssword": SECRET},  # accented, full-width, Cyrillic "а"
], ids=lambda hyperparams: repr(hyperparams)[:40])
def test_the_shapes_a_review_found_leaking_are_redacted(hyperparams):
    """Issue 31, the second review's list of shapes that still showed a secret."""
    redacted = redact_hyperparams(hyperparams)
    assert SECRET not in repr(redacted) and SECRET not in json.dumps(redacted, ensure_ascii=False)


@pytest.mark.parametrize("hyperparams", [
    {"cmd": "docker run -u 1000:1000 image"},  # a uid:gid, not a user and a password
    {"url": "https://host/path?mail=a@b.com"},
    {"columns": ["input_ids", "token_type_ids", "label"]},  # lower-case names in a list: not names and values
    {"pad": ["PAD_TOKEN_ID", 0, "MAX_TOKENS", 512]},
    {"pat": 3, "sas_path": "/data/x.sas7bdat", "pattern": "*.png", "Straße": "Main"},
    {"session": "s1", "env": [{"name": "HOME", "value": "/root"}]},
])
def test_innocent_shapes_next_to_those_stay_as_they_are(hyperparams):
    assert redact_hyperparams(hyperparams) == hyperparams


@pytest.mark.parametrize("name", ["pässword", "ｐａｓｓｗｏｒｄ", "p\u0430ssword", "GITHUB_PAT", "hf_pat", "azure_sas",
                                  "passcode", "CI_JOB_JWT", "SESSIONID", "session_id", "PGPASS"])
def test_key_names_read_as_a_person_reads_them(name):
    assert is_secret_key(name)


@pytest.mark.parametrize("hyperparams", [
    {"netrc": f"machine api.host\n  login bob\n  password {SECRET}\n"},  # .netrc, one token pair a line
    {"cmd": f"curl -H 'Authorization: token {SECRET}' https://api.github.com"},
    {"cmd": f"Authorization: Bot {SECRET}"},
    {"headers": ["authorization", "Bearer", SECRET]}, {"headers": ("authorization", "token", SECRET)},
    {"cmd": f"pässword={SECRET}"}, {"cmd": f"\u0440\u0430ssword={SECRET}"}, {"cfg": str({"pässword": SECRET})},
    {"cfg": str({"password": SECRET.encode()})}, {"cmd": f"password=r'{SECRET}'"},  # Python literals' prefixes
    {"cmd": f"curl -ubob:{SECRET} https://x"}, {"cmd": f"curl -Lu bob:{SECRET} https://x"},
    {"cmd": f'curl -u "bob:a b {SECRET}" https://x'},
    {"cmd": f"docker login -u bob -p {SECRET} registry"}, {"cmd": f"sshpass -v -p {SECRET} ssh host"},
    {"make": f"PASSWORD := {SECRET}"}, {"make": f"PASSWORD ?= {SECRET}"}, {"cfg": f"password => '{SECRET}'"},
    {"hook": f"https://discord.com/api/v10/webhooks/123/{SECRET}"},
    {"hook": f"hooks.slack.com/services/T0/B0/{SECRET}"}, {"hook": f"https://hooks.slack.com:443/services/T0/{SECRET}"},
    {"x": "ghp_" + "a" * 36}, {"x": "sk-proj-" + "b1" * 20}, {"x": "xoxb-123-456-" + SECRET}, {"x": "AKIA" + "C" * 16},
    {"CI_JOB_JWT_V2": SECRET},
], ids=lambda hyperparams: repr(hyperparams)[:40])
def test_near_variants_of_those_shapes_are_redacted(hyperparams):
    """Issue 31, the third review's near-variants of the shapes above."""
    redacted = redact_hyperparams(hyperparams)
    text = repr(redacted) + json.dumps(redacted, ensure_ascii=False)
    assert SECRET not in text and "a" * 36 not in text and "b1" * 20 not in text and "C" * 16 not in text


def test_a_container_holding_itself_is_copied_without_its_original():
    config = {"password": SECRET}
    config["self"] = config
    assert SECRET not in repr(redact_hyperparams({"cfg": config}))


@pytest.mark.parametrize("hyperparams", [
    {"gen_kwargs": "max_new_tokens=128,temperature=0.7,top_p=0.9"},  # a list of assignments after a size name
    {"model_args": "num_key_value_heads=8;head_dim=128"},
    {"cfg": '{"tracking":"http://localhost:5000/api","owner":"ml-team@corp.com"}'},  # compact JSON
    {"urls": "http://localhost:8080/v1,git@github.com:org/repo.git"},
    {"cmd": "docker run -u ubuntu:ubuntu image"}, {"jwt_algorithm": "HS256"},
    {"note": "login with password reset enabled"},
    {"shards": ",".join(f"http://minio:9000/ds/shard-{i:05d}.tar" for i in range(50))},
])
def test_readable_values_near_those_shapes_are_kept(hyperparams):
    assert redact_hyperparams(hyperparams) == hyperparams


def test_numbers_under_names_of_quantities_are_kept_so_sweeps_over_them_stay_apart():
    """Review of issue 33's restart half, D2: a sweep over ``signature_dim`` in one allocation continued the other
    step's run, as both redacted copies read '<redacted>'."""
    from aitoolbox.experiment.local_save.run_identity import this_run_identity
    kept = {"signature_dim": 8, "cookie_size": 3, "password_len": 12}
    assert redact_hyperparams(kept) == kept
    assert redact_hyperparams({"password": 1234, "api_key": 5}) == {"password": REDACTED, "api_key": REDACTED}
    assert this_run_identity({"signature_dim": 4}) != this_run_identity({"signature_dim": 8})
    assert redact_hyperparams({"data_dir": "/data/sk-learn-preprocessed-features-v2"})["data_dir"].startswith("/data/sk")
