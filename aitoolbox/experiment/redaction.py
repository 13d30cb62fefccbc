"""Keep secrets in hyperparameters out of everything a run writes or sends.

Hyperparameter dicts often carry an API token or a database password next to the learning rate. aitoolbox
writes hyperparameters into the run folder (``hyperparams_list.txt``, ``hyperparams.json``, uploaded with
``cloud_save_mode``), every checkpoint, ``run_info.json``, the W&B config, the MLflow parameters and the final
e-mail. Each of those gets :func:`redact_hyperparams`'s copy, in which a secret value is replaced by
:data:`REDACTED`; the dict the training script holds keeps its real values.

Which values are secret:

- A value whose key *looks secret*. The key is split into words at every character that is not a letter or a
  digit and at camelCase boundaries (``hfToken`` -> ``hf``, ``token``; ``AWS_SECRET_ACCESS_KEY`` -> ``aws``,
  ``secret``, ``access``, ``key``), compared case-insensitively. It looks secret when one of its words is in
  :data:`SECRET_WORDS` (``token``, ``key``, ``secret``, ``password``, ``credential``, ...), singular or plural.
  Whole words, not substrings: ``monkey``, ``keyboard`` and ``tokenizer`` are not secret names.
- Everything under such a key, also a nested dict or a list (``{"credentials": {"user": ..., "pass": ...}}``
  is redacted as a whole).
- Any value wrapped in :class:`Secret` (or pydantic's ``SecretStr``/``SecretBytes``: any object with a
  ``get_secret_value`` method), whatever its key. This is how to add what the key rule misses.

What is kept under a secret-looking key: None, booleans and empty strings (they hide nothing), and, under
``token`` and ``key`` only, values made of numbers alone. Those two words also name parts of models, so
``max_tokens=512``, ``pad_token_id=0`` and ``num_key_value_heads=8`` stay readable in the logs; a password of
digits (``password: 123456`` read from YAML) is still redacted.

Nested dicts (any mapping), lists, tuples (namedtuples by their field names), sets, ``argparse.Namespace``
objects and dataclass instances are searched. Other objects are written by the destinations as their ``repr``:
wrap one holding a secret in :class:`Secret`.
"""
import argparse
import copy
import dataclasses
import numbers
import os
import re
from typing import Any, Generic, List, Mapping, Optional, TypeVar

__all__ = ["REDACTED", "SECRET_WORDS", "Secret", "is_credentials_file", "is_secret_key", "key_words",
           "redact_hyperparams", "redact_value"]

#: What a secret value is replaced with.
REDACTED = "<redacted>"

#: Words that make a hyperparameter's key look secret (compared with the key's words, singular or plural).
SECRET_WORDS = frozenset({"token", "key", "secret", "password", "passwd", "passphrase", "credential", "apikey",
                          "authorization"})

# Words that also name parts of models (a text's tokens, attention keys): a value of numbers alone is kept.
_MODEL_VOCABULARY_WORDS = frozenset({"token", "key"})

# Split points of a key: runs of capitals (an acronym, ending before a capitalised word), capitalised or
# lower-case words, and digits.
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")

T = TypeVar("T")


class Secret(Generic[T]):
    """A hyperparameter value that is never written or sent, whatever its key.

    ``str()`` and ``repr()`` hide it too, so even text made from it by other code does not show it. Read the value
    with :meth:`get_secret_value` (the name pydantic's ``SecretStr`` uses)::

        hyperparams = {"lr": 0.1, "db_url": Secret("postgresql://user:pw@host/db")}
        connect(hyperparams["db_url"].get_secret_value())

    The wrapped value travels to the processes of ``fit_distributed`` like any other hyperparameter.
    """

    __slots__ = ("_secret_value",)

    def __init__(self, value: T):
        if isinstance(value, Secret):
            value = value.get_secret_value()
        self._secret_value = value

    def get_secret_value(self) -> T:
        """The real value."""
        return self._secret_value

    def __repr__(self) -> str:
        return f"Secret({REDACTED!r})"

    def __str__(self) -> str:
        return REDACTED

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Secret) and other.get_secret_value() == self._secret_value

    def __hash__(self) -> int:
        return hash((Secret, self._secret_value))

    def __deepcopy__(self, memo: dict) -> "Secret[T]":
        return Secret(copy.deepcopy(self._secret_value, memo))


def key_words(name: Any) -> List[str]:
    """The lower-case words of a key: ``'hfToken'`` -> ``['hf', 'token']``, ``'API-KEY2'`` -> ``['api', 'key',
    '2']``."""
    return [word.lower() for word in _WORD.findall(str(name))]


def _secret_words_in(name: Any) -> set:
    found = set()
    for word in key_words(name):
        singular = word[:-1] if word.endswith("s") else word
        found.update(candidate for candidate in (word, singular) if candidate in SECRET_WORDS)
    return found


def is_secret_key(name: Any) -> bool:
    """True when the key ``name`` looks secret: one of its words (see :func:`key_words`) is in
    :data:`SECRET_WORDS`, singular or plural (``api_key``, ``hfToken``, ``DB_PASSWORD``, ``credentials``;
    not ``monkey``, ``keyboard``, ``tokenizer``)."""
    return bool(_secret_words_in(name))


def _holds_secret(value: Any) -> bool:
    return callable(getattr(value, "get_secret_value", None)) and not isinstance(value, type)


def _numbers_only(value: Any) -> bool:
    if value is None or isinstance(value, numbers.Number):  # also numpy's scalars
        return True
    if isinstance(value, Mapping):
        return all(_numbers_only(item) for item in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_numbers_only(item) for item in value)
    return False


def _keep_under_secret_key(words: set, value: Any) -> bool:
    if value is None or isinstance(value, bool) or (isinstance(value, (str, bytes)) and len(value) == 0):
        return True
    return words <= _MODEL_VOCABULARY_WORDS and _numbers_only(value) and not _holds_secret(value)


def _redact_entry(key: Any, value: Any) -> Any:
    words = _secret_words_in(key)
    if words and not _keep_under_secret_key(words, value):
        return REDACTED
    return redact_value(value)


def _redact_attributes(obj: Any, names: List[str]) -> Any:
    """A shallow copy of ``obj`` with its attributes ``names`` redacted; ``obj`` itself when none changes."""
    changed = {}
    for name in names:
        value = getattr(obj, name)
        redacted = _redact_entry(name, value)
        if redacted is not value:
            changed[name] = redacted
    if not changed:
        return obj
    try:
        clone = copy.copy(obj)
        for name, value in changed.items():
            object.__setattr__(clone, name, value)  # also for frozen dataclasses
    except Exception:  # an object that cannot be copied: hide it whole rather than show its secret
        return REDACTED
    return clone


def redact_value(value: Any) -> Any:
    """``value`` with the secrets inside it replaced by :data:`REDACTED` (see the module's rules); ``value``
    itself is not changed. A :class:`Secret` becomes :data:`REDACTED`; dicts, lists, tuples and sets are
    rebuilt; other objects without a secret inside are returned as they are (not copied)."""
    if _holds_secret(value):
        return REDACTED
    if isinstance(value, Mapping):
        return {key: _redact_entry(key, item) for key, item in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple: its field names are keys
        return type(value)(*(_redact_entry(name, item) for name, item in zip(value._fields, value)))
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [redact_value(item) for item in value]
        return items if isinstance(value, list) else type(value)(items)
    if isinstance(value, argparse.Namespace):
        return _redact_attributes(value, list(vars(value)))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _redact_attributes(value, [field.name for field in dataclasses.fields(value)])
    return value


def redact_hyperparams(hyperparams: Optional[Mapping[str, Any]]) -> dict:
    """A copy of ``hyperparams`` to write or send, with every secret value replaced by :data:`REDACTED`.

    The rules are the module's (:mod:`aitoolbox.experiment.redaction`): values under keys that look secret
    (:func:`is_secret_key`), searched in nested dicts, lists, tuples, sets, ``argparse.Namespace`` objects and
    dataclasses, and values wrapped in :class:`Secret`. ``hyperparams`` is not changed.

    Args:
        hyperparams: the hyperparameters; None gives an empty dict.

    Returns:
        a new dict (every nested dict, list, tuple and set is new as well).

    Raises:
        TypeError: ``hyperparams`` is neither a mapping nor None.
    """
    if hyperparams is None:
        return {}
    if not isinstance(hyperparams, Mapping):
        raise TypeError(f"hyperparams must be a dict (or another mapping) or None, got "
                        f"{type(hyperparams).__name__}: {hyperparams!r}"[:300])
    return redact_value(hyperparams)


# --- files ----------------------------------------------------------------------------------------------------
# Files that hold credentials by their name or type (key material, SSH keys, tool login files).
_CREDENTIAL_FILE_NAMES = frozenset({".env", ".netrc", "_netrc", ".pgpass", ".git-credentials", ".npmrc", ".pypirc",
                                    ".htpasswd", "credentials", "id_rsa", "id_dsa", "id_ecdsa", "id_ed25519"})
_CREDENTIAL_FILE_EXTENSIONS = frozenset({".env", ".pem", ".key", ".p12", ".pfx", ".jks", ".keystore", ".kdbx",
                                         ".gpg", ".asc"})


def is_credentials_file(path: str) -> bool:
    """True for a file that is, by its name, likely to hold credentials: never uploaded as code.

    These are ``.env`` and ``.env.*`` files (``.env.local``), login files of tools (``.netrc``, ``.pgpass``,
    ``.git-credentials``, ``.npmrc``, ``.pypirc``, ``credentials``), key material (``*.pem``, ``*.key``,
    ``*.p12``, ``*.pfx``, ``*.jks``, SSH keys ``id_rsa``...), and files whose name looks secret by the key rule
    of :func:`is_secret_key` (``credentials.json``, ``client_secret.json``, ``token.pickle``, ``api_key.txt``).
    Python files are judged by the words ``secret``, ``password``, ``credential``... only: ``token`` and ``key``
    name code in NLP projects (``token_classification.py``, ``keys.py``), ``secrets.py`` is refused.
    """
    name = os.path.basename(os.fspath(path)).lower()
    stem, extension = os.path.splitext(name)
    if name in _CREDENTIAL_FILE_NAMES or name.startswith(".env.") or extension in _CREDENTIAL_FILE_EXTENSIONS:
        return True
    if any(name.startswith(ssh_key) for ssh_key in ("id_rsa", "id_dsa", "id_ecdsa", "id_ed25519")):
        return True
    words = _secret_words_in(stem)
    if extension == ".py":
        return bool(words - _MODEL_VOCABULARY_WORDS)
    return bool(words)
