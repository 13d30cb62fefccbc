"""Keep secrets in hyperparameters out of everything a run writes or sends.

Hyperparameter dicts often carry an API token or a database password next to the learning rate. aitoolbox
writes hyperparameters into the run folder (``hyperparams_list.txt``, ``hyperparams.json``, uploaded with
``cloud_save_mode``), every checkpoint, ``run_info.json``, the W&B config, the MLflow parameters and the final
e-mail. Each of those gets :func:`redact_hyperparams`'s copy, in which a secret value is replaced by
:data:`REDACTED`; the dict the training script holds keeps its real values. Nothing derived from a secret value
(a hash, a fingerprint) is written either: the run's identity (:mod:`~aitoolbox.experiment.local_save.
run_identity`) is computed from the redacted copy.

Which values are secret:

- A value whose key *looks secret* (:func:`~aitoolbox.experiment.secret_names.is_secret_key`: ``api_key``,
  ``hfToken``, ``dbpassword``, ``accesstoken``, ``Authorization``...), and everything under it, also a nested
  dict or a list (``{"credentials": {"user": ..., "pass": ...}}`` is redacted as a whole). A pair whose first
  item is such a name counts as a key and its value: ``[("Authorization", "Bearer ...")]``, a header list.
- Inside any text, wherever it is (also a dict's key, or the ``repr`` of an object): the user name and password
  of a URL (``postgresql://user:pw@host/db`` becomes ``postgresql://<redacted>@host/db``), the value of an
  assignment to a secret-looking name (``password=...``, ``api_key: ...``, ``?token=...``, ``Password=...;``)
  or of such a command-line option (``--password ...``, ``--api-key=...``), whatever is attached to a short
  ``-p`` (mysql's ``-pPASSWORD``), a PEM private key block, tokens of known forms (``ghp_...``, ``xoxb-...``,
  ``sk-...``, ``hf_...``, ``AKIA...``), and the token after ``Bearer``. See
  :func:`redact_text`. Bytes are searched as text and redacted whole.
- A name-value record (``{"name": "DB_PASSWORD", "value": ...}``, also with ``key``: Kubernetes' environment
  lists; ``val``, and prefixed pairs such as ``ParameterKey``/``ParameterValue``) whose name looks secret: its
  value, judged as if under that name. In a list (``sys.argv``), the item after a secret-looking option
  (``["--password", ...]``) or a capitalised secret-looking name (``["PASSWORD", ...]``), and after an
  authorization scheme the item that follows it (``("Authorization", "Bearer", ...)``). A dict's key that is not
  text (a tuple) is searched as any value.
- Any value wrapped in :class:`Secret` (or pydantic's ``SecretStr``/``SecretBytes``: any object with a
  ``get_secret_value`` method), whatever its key. This is how to add what the rules miss.

What is kept under a secret-looking key: None, booleans and empty strings (they hide nothing), and values made of
numbers alone under a key that names a part of a model or training
(:func:`~aitoolbox.experiment.secret_names.names_a_model_part`: ``max_tokens=512``, ``pad_token_id=0``,
``num_key_value_heads=8``; a dict only when its keys are numbers too: the names in a dict under ``api_keys`` may
be the keys themselves). A number under a credential's name (``api_key``, ``access_token``, ``pass`` alone) or
a password of digits (``password: 123456`` read from YAML) is redacted.

Nested dicts (any mapping), lists, tuples (namedtuples by their field names), sets, ``argparse.Namespace`` and
``types.SimpleNamespace`` objects and dataclass instances are searched and copied. Other objects are written by
the destinations as their ``repr``: one whose attributes hold a secret by the rules above becomes
:data:`REDACTED` as a whole, one whose ``repr`` holds a secret by the text rules becomes that ``repr`` redacted.
"""
import argparse
import copy
import dataclasses
import numbers
import re
import types
from typing import Any, Generic, List, Mapping, Optional, Tuple, TypeVar

from aitoolbox.experiment.secret_names import (
    SECRET_WORDS, is_credentials_file, is_secret_key, key_words, names_a_model_part, names_a_quantity,
    secret_words_in)

__all__ = ["REDACTED", "SECRET_WORDS", "Secret", "is_credentials_file", "is_secret_key", "key_words",
           "redact_hyperparams", "redact_message", "redact_text", "redact_value"]

#: What a secret value is replaced with.
REDACTED = "<redacted>"

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


# --- text ---------------------------------------------------------------------------------------------------
# A URL's user information (user name, password, or a token standing for them): everything between "scheme://"
# and the last "@" before the host's end. Greedy, so a password with an unencoded "@" is hidden whole.
# A password may hold "/", "?" or "#" left unencoded ("redis://:ab#cd@host"): after "user:" everything up to the
# "@" is taken ("https://host:8080/p?mail=a@b" loses its host and path: better a lost word than a leak). At most
# 256 characters each side of the ":", so that text of many URLs without an "@" is searched in linear time.
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)"
                           r"(?:[^\s/?#]*|[^\s/?#@:\"',<>]{0,256}:[^\s@\"',<>]{0,256})@")
# Incoming-webhook URLs whose path is the credential (Slack, Discord, Microsoft Teams): the path is redacted.
_WEBHOOK_URL = re.compile(r"(?P<base>(?:\bhttps?://)?\b(?:hooks\.slack\.com(?::\d+)?/(?:services|workflows|triggers)|"
                          r"(?:[A-Za-z0-9-]+\.)?discord(?:app)?\.com(?::\d+)?/api(?:/v\d+)?/webhooks|"
                          r"[A-Za-z0-9.-]*\.office\.com(?::\d+)?/webhook[A-Za-z0-9]*)/)[^\s\"'<>]+")
# "name" (or "two words", as in "API Key: ...") followed by "=" or ":" (quoted as in a dict's repr, or not): the
# start of an assignment.
_ASSIGNMENT = re.compile(r"(?<![\w.\-])(?P<name>(?:[^\W\d_][\w.\-]* )?[^\W\d][\w.\-]*)"
                         r"[\"']?[ \t]*(?::=|\?=|=>|[=:])[ \t]*[\"']?")
# The value assigned, unquoted: an optional HTTP authorization scheme and its token, up to a space, a quote, a "&"
# or a closing bracket; a "," or ";" ends it only before a space or the end (a list's separator), not inside it
# ("password=ab;cd" is one value: better a lost word than a leak).
_ASSIGNED_VALUE = re.compile(r"(?:(?i:bearer|basic|token|digest|negotiate|bot)[ \t]+)?"
                             r"(?:[^\s\"',;&)}\]]|[,;](?=[^\s,;])(?![A-Za-z_][A-Za-z0-9_.\-]*[=:]))+")
# A quoted value's opening, with a Python literal's prefix (b'...', r"...", f'...').
_OPENING_QUOTE = re.compile(r"(?:[bBrRuUfF]{1,2})?(?P<quote>[\"'])")
# A quoted value: everything up to its closing quote (an escaped quote, \" or \', does not close it).
_QUOTED_VALUE = {'"': re.compile(r'(?:[^"\\]|\\.)*'), "'": re.compile(r"(?:[^'\\]|\\.)*")}
_BEARER = re.compile(r"(?P<scheme>\b[Bb]earer[ \t]+)(?!<redacted>)[A-Za-z0-9\-._~+/]+=*")
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
# A command-line option and its value, in a string ("--password S", "--api-key=S", "-token S"): the option starts
# the string or follows a space, a quote or a bracket. Its value is the next word, also one starting with "-" (a
# password may; after a secret-looking option a flag taken for its value is a lost word, not a leak).
_OPTION = re.compile(r"(?<![^\s\"'(\[,=])--?(?P<name>[A-Za-z][A-Za-z0-9_.\-]*)(?:=|[ \t]+(?=\S))")
# mysql's and its clients' password option, attached to its value ("-pS"): "-p" alone asks for it instead.
# Whatever follows is taken for the password, also "-path" or "-p8080" elsewhere: better a lost word than a leak.
_SHORT_PASSWORD = re.compile(r"(?<![^\s\"'(\[,])-p(?!<redacted>)(?:'[^']*'|\"[^\"]*\"|[^\s\"',)\]}]+)")
# Commands that take a password in options of their own: curl's and wget's "-u user:password" ("-ubob:S",
# "-Lu bob:S", "--user", "--proxy-user"; after "curl" or "wget" only: docker's "-u ubuntu:ubuntu" is a user and a
# group), sshpass's "-p password" (after other options too), docker login's "-p password".
_USER_PASSWORD_OPTION = re.compile(
    r"(?P<head>\b(?:curl|wget)\b[^\n;|&]{0,400}?[ \t](?:-[A-Za-z]*u[ \t]*|--(?:proxy-|http-)?user(?:=|[ \t]+))"
    r"(?P<quote>[\"'])?[^\s:\"']*:)(?!<redacted>)(?(quote)[^\"']+|[^\s\"']+)")
_SSHPASS = re.compile(r"(?P<head>\bsshpass(?:[ \t]+-[A-Za-z](?:[ \t]+[^-\s]\S*)?){0,4}?[ \t]+-p[ \t]*)(?!<redacted>)"
                      r"(?:'[^']*'|\"[^\"]*\"|\S+)")
_DOCKER_LOGIN_PASSWORD = re.compile(r"(?P<head>\bdocker[ \t]+login\b[^\n;|&]{0,400}?[ \t]-p[ \t]+)(?!<redacted>)\S+")
# A .netrc entry (on one line or several): "machine h login u password S", "default login u password S".
_NETRC_PASSWORD = re.compile(r"(?P<head>\b(?:machine[ \t]+\S+|default)(?:\s+(?:login|account|port)\s+\S+){0,3}"
                             r"\s+password\s+)(?!<redacted>)\S+")
# Credentials recognisable by their own form, wherever they stand: GitHub's tokens (ghp_..., github_pat_...), Slack's
# (xoxb-...), OpenAI's and Anthropic's keys (sk-...), Hugging Face's (hf_...), GitLab's (glpat-...), AWS access key
# ids (AKIA...), Google API keys (AIza...).
_KNOWN_TOKEN = re.compile(r"(?<![A-Za-z0-9])(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}|"
                          r"xox[abprs]-[A-Za-z0-9-]{10,}|sk-(?=[A-Za-z_-]*[0-9])[A-Za-z0-9_-]{32,}|hf_[A-Za-z0-9]{30,}|"
                          r"glpat-[A-Za-z0-9_-]{20,}|(?:AKIA|ASIA)[0-9A-Z]{16}|AIza[0-9A-Za-z_-]{35})(?![A-Za-z0-9])")
# A PEM private key block (PKCS#1, PKCS#8, encrypted, OpenSSH, PGP), the whole block; one cut short runs to the
# end of the text.
_PRIVATE_KEY = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY[A-Z ]*-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY[A-Z ]*"
                          r"-----|\Z)", re.DOTALL)


def redact_text(text: str) -> str:
    """``text`` with the secrets it shows replaced by :data:`REDACTED`: the user information of URLs
    (``scheme://user:password@`` -> ``scheme://<redacted>@``), the values assigned to secret-looking names
    (``password=...``, ``"api_key": "..."``, ``?token=...``, ``Authorization: Bearer ...``) or given to
    secret-looking command-line options (``--password ...``, ``--api-key=...``, mysql's ``-pPASSWORD``), PEM
    private key blocks and ``Bearer`` tokens. Used for every string of the hyperparameters."""
    return _redact_text(text, frozenset())


def redact_message(text: str) -> str:
    """:func:`redact_text` for a message that quotes a service's error (logged, or raised to the user): the same,
    except that the value assigned to a bare ``key`` is kept, as storage and tracking services name an object or
    a metric that way (``key='val_loss'``)."""
    return _redact_text(text, frozenset({"key", "keys"}))


def _redact_text(text: str, spared_names: frozenset) -> str:
    text = _PRIVATE_KEY.sub(REDACTED, text)  # first: a key's body may look like anything below
    text = _KNOWN_TOKEN.sub(REDACTED, text)
    text = _URL_USERINFO.sub(rf"\g<scheme>{REDACTED}@", text)
    text = _WEBHOOK_URL.sub(rf"\g<base>{REDACTED}", text)
    for command_option in (_USER_PASSWORD_OPTION, _SSHPASS, _DOCKER_LOGIN_PASSWORD, _NETRC_PASSWORD):
        text = command_option.sub(rf"\g<head>{REDACTED}", text)
    text = _redact_assigned(text, _OPTION, spared_names)
    text = _redact_assigned(text, _ASSIGNMENT, spared_names)
    text = _SHORT_PASSWORD.sub(f"-p{REDACTED}", text)
    return _BEARER.sub(rf"\g<scheme>{REDACTED}", text)


def _redact_assigned(text: str, pattern: "re.Pattern", spared_names: frozenset) -> str:
    """``text`` with the value after each match of ``pattern`` (an assignment or an option, whose group ``name``
    is the name assigned to) redacted when that name looks secret."""
    pieces, done = [], 0
    for match in pattern.finditer(text):
        name = match.group("name")
        if match.start() < done or name.lower() in spared_names:
            continue
        value = _assigned_value(text, match) if is_secret_key(name) else None
        if value is None or value.group() in ("", REDACTED) or \
                (names_a_model_part(name) and _NUMBER.fullmatch(value.group())):
            continue
        pieces += [text[done:value.start()], REDACTED]
        done = value.end()
    return "".join(pieces) + text[done:]


def _assigned_value(text: str, match: "re.Match") -> Optional["re.Match"]:
    """The value after an assignment or option ``match``: a quoted one whole, to its closing quote (the pattern took
    the opening quote, or it starts the value: ``--password "a b"``), else one word (:data:`_ASSIGNED_VALUE`)."""
    start = match.end()
    quote = match.group()[-1:] if match.group()[-1:] in ("'", '"') else None
    if quote is None:  # a quote after the value's start: "a b", or a Python literal's b'...' or r"..."
        opening = _OPENING_QUOTE.match(text, start)
        if opening is not None:
            quote, start = opening.group("quote"), opening.end()
    return (_QUOTED_VALUE[quote] if quote else _ASSIGNED_VALUE).match(text, start)


# --- values -------------------------------------------------------------------------------------------------
def _holds_secret(value: Any) -> bool:
    return callable(getattr(value, "get_secret_value", None)) and not isinstance(value, type)


def _numbers_only(value: Any) -> bool:
    if value is None or isinstance(value, numbers.Number):  # also numpy's scalars
        return True
    if isinstance(value, Mapping):
        return all(_numbers_only(key) and _numbers_only(item) for key, item in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_numbers_only(item) for item in value)
    return False


def _keep_under_secret_key(name: Any, value: Any) -> bool:
    if value is None or isinstance(value, bool) or (isinstance(value, (str, bytes)) and len(value) == 0):
        return True
    return (names_a_model_part(name) or names_a_quantity(name)) and _numbers_only(value) and not _holds_secret(value)


def _shows_secret(name: str, value: Any) -> bool:
    """Whether an attribute of an arbitrary object holds a secret, judged without searching inside its value (an
    object's attributes may reach far: a dataset, a model)."""
    if is_secret_key(name) and not _keep_under_secret_key(name, value):
        return True
    return _holds_secret(value) or (isinstance(value, str) and redact_text(value) != value)


# An argv item that is an option whose value is the next item: "--password", "-api-key" (not "--password=S").
_ARGV_OPTION = re.compile(r"--?[A-Za-z][A-Za-z0-9_.\-]*")
# An argv or flat list item that names the next one: an environment variable's or a header's name, capitalised
# ("PASSWORD", "DB_PASSWORD", "Authorization", "X-Api-Key"). Lower-case words in a list are more often a list of
# names (columns, fields) than a name and its value.
_LIST_NAME = re.compile(r"[A-Z][A-Za-z0-9_\-]*|(?i:authorization|proxy-authorization|x-api-key)")
# An item standing between an option and its value (["--password", "=", S]).
_LIST_SEPARATORS = frozenset({"=", ":"})
# An HTTP authorization scheme: the item after it is the credential (("Authorization", "Bearer", S)).
_AUTH_SCHEMES = frozenset({"bearer", "basic", "token", "digest", "negotiate"})
# The keys that name a name-value record's entry ("name", "key"), as Kubernetes and most config formats spell them,
# and those of its value ("value", "val"); both may share a prefix (CloudFormation's "ParameterKey" and
# "ParameterValue", "OptionName" and "OptionValue").
_RECORD_NAME_KEYS = ("name", "key")
_RECORD_VALUE_KEYS = ("value", "val")


def _record_names(record: Mapping) -> dict:
    """The value keys of a name-value record whose name looks secret, each with that name:
    ``{"name": "DB_PASSWORD", "value": S}`` -> ``{"value": "DB_PASSWORD"}``; empty for any other mapping."""
    keys = {key.lower(): key for key in record if isinstance(key, str)}
    named = {}
    for lower, key in keys.items():
        value_word = next((word for word in _RECORD_VALUE_KEYS if lower.endswith(word)), None)
        if value_word is None:
            continue
        prefix = lower[:-len(value_word)]
        for name_key in _RECORD_NAME_KEYS:
            name = record[keys[prefix + name_key]] if prefix + name_key in keys else None
            if isinstance(name, str) and is_secret_key(name):
                named[key] = name
                break
    return named


class _Redactor:
    """One pass over a value; ``redact`` returns ``(copy, whether anything was redacted)``. Containers are always
    rebuilt; other objects are copied only when something in them is redacted."""

    def __init__(self):
        self._active: set = set()  # ids of the containers being searched: a cycle is not followed again

    def entry(self, key: Any, value: Any) -> Tuple[Any, bool]:
        """``value`` found under the name ``key``."""
        if is_secret_key(key) and not _keep_under_secret_key(key, value):
            return REDACTED, True
        return self.redact(value)

    def redact(self, value: Any) -> Tuple[Any, bool]:
        if isinstance(value, str):
            text = redact_text(value)
            return text, text != value
        if isinstance(value, (bytes, bytearray)):  # written as their repr: a secret in them shows
            text = bytes(value).decode("latin-1")
            return (REDACTED, True) if redact_text(text) != text else (value, False)
        if value is None or isinstance(value, (numbers.Number, type)):
            return value, False
        if _holds_secret(value):
            return REDACTED, True
        if id(value) in self._active:  # a container holding itself: its copy must not show the original
            return f"<cycle: {type(value).__name__}>", True
        self._active.add(id(value))
        try:
            return self._redact_object(value)
        finally:
            self._active.discard(id(value))

    def _redact_object(self, value: Any) -> Tuple[Any, bool]:
        if isinstance(value, Mapping):
            return self._redact_mapping(value)
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple: its field names are keys
            pairs = [self.entry(name, item) for name, item in zip(value._fields, value)]
            return type(value)(*(item for item, _ in pairs)), any(changed for _, changed in pairs)
        if isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], str) and \
                is_secret_key(value[0]):  # ("Authorization", "Bearer ..."): a name and its value
            name, name_changed = self.redact(value[0])
            item, changed = self.entry(value[0], value[1])
            return type(value)([name, item]), changed or name_changed
        if isinstance(value, (list, tuple)):
            pairs = self._redact_arguments(value)
            items = [item for item, _ in pairs]
            return (items if isinstance(value, list) else type(value)(items)), any(changed for _, changed in pairs)
        if isinstance(value, (set, frozenset)):
            pairs = [self.redact(item) for item in value]
            return type(value)(item for item, _ in pairs), any(changed for _, changed in pairs)
        if isinstance(value, (argparse.Namespace, types.SimpleNamespace)):
            return self._redact_attributes(value, list(vars(value)))
        if dataclasses.is_dataclass(value):
            return self._redact_attributes(value, [field.name for field in dataclasses.fields(value)])
        return self._redact_other(value)

    def _redact_mapping(self, value: Mapping) -> Tuple[dict, bool]:
        # A name-value record, as Kubernetes lists environment variables ({"name": "DB_PASSWORD", "value": ...}):
        # its "value" is judged by the name the record gives, and that name (a variable's, not a secret) is kept.
        named = _record_names(value)
        names = {id(name) for name in named.values()}
        changed, result = False, {}
        for key, item in value.items():
            if key in named:
                result[key], item_changed = self.entry(named[key], item)
                changed = changed or item_changed
                continue
            if id(item) in names:  # the name itself: only its text is searched
                result[key], item_changed = self.redact(item)
                changed = changed or item_changed
                continue
            new_key, key_changed = self._redact_key(key)
            result[new_key], item_changed = self.entry(key, item)
            changed = changed or key_changed or item_changed
        return result, changed

    def _redact_key(self, key: Any) -> Tuple[Any, bool]:
        """A dict's key, redacted as any value (a tuple ``("token", S)`` too); one that can no longer be a key (a
        copied object that is not hashable) becomes :data:`REDACTED`."""
        new_key, changed = self.redact(key)
        try:
            hash(new_key)
        except TypeError:
            return REDACTED, True
        return new_key, changed

    def _redact_arguments(self, items: Any) -> List[Tuple[Any, bool]]:
        """The items of a list or tuple redacted, each after a name that looks secret and has no value of its own
        judged as that name's value: an option (``["--password", S]``, as ``sys.argv`` holds it, also with a
        ``"="`` item between), a capitalised name (``["PASSWORD", S]``, an environment or header list), and after
        an authorization scheme the item that follows it (``("Authorization", "Bearer", S)``)."""
        pairs, option = [], None
        for item in items:
            if option is not None and isinstance(item, str) and \
                    (item in _LIST_SEPARATORS or item.lower() in _AUTH_SCHEMES):
                pairs.append((item, False))  # the value is the next item
                continue
            if option is not None and not (isinstance(item, str) and _NUMBER.fullmatch(item) and
                                           names_a_model_part(option)):  # "--max-tokens 512" as in text
                pairs.append(self.entry(option, item))
            else:
                pairs.append(self.redact(item))
            option = None
            if isinstance(item, str) and is_secret_key(item) and (_ARGV_OPTION.fullmatch(item) or (
                    _LIST_NAME.fullmatch(item) and not names_a_model_part(item))):
                option = item.lstrip("-")
        return pairs

    def _redact_attributes(self, obj: Any, names: List[str]) -> Tuple[Any, bool]:
        """A shallow copy of ``obj`` with its attributes ``names`` redacted; ``obj`` itself when none is."""
        changed = {}
        for name in names:
            value = getattr(obj, name)
            redacted, was_changed = self.entry(name, value)
            if was_changed:
                changed[name] = redacted
        if not changed:
            return obj, False
        try:
            clone = copy.copy(obj)
            for name, value in changed.items():
                object.__setattr__(clone, name, value)  # also for frozen dataclasses
        except Exception:  # an object that cannot be copied: hide it whole rather than show its secret
            return REDACTED, True
        return clone, True

    def _redact_other(self, value: Any) -> Tuple[Any, bool]:
        # Written as its repr by every destination. Its own attributes are looked at (not copied: an arbitrary
        # object may not survive a copy), and its repr's text.
        if isinstance(value, types.ModuleType):
            return value, False
        attributes = getattr(value, "__dict__", None)
        if isinstance(attributes, dict) and any(_shows_secret(name, item) for name, item in list(attributes.items())
                                                if isinstance(name, str) and not name.startswith("__")):
            return REDACTED, True
        try:
            text = repr(value)
        except Exception:  # a repr that fails fails the destination too; nothing to show
            return value, False
        redacted = redact_text(text)
        return (redacted, True) if redacted != text else (value, False)


def redact_value(value: Any) -> Any:
    """``value`` with the secrets inside it replaced (see the module's rules); ``value`` itself is not changed.
    A :class:`Secret` becomes :data:`REDACTED`; dicts, lists, tuples and sets are rebuilt; other objects without
    a secret inside are returned as they are (not copied)."""
    return _Redactor().redact(value)[0]


def redact_hyperparams(hyperparams: Optional[Mapping[str, Any]]) -> dict:
    """A copy of ``hyperparams`` to write or send, with every secret value replaced by :data:`REDACTED`.

    The rules are the module's (:mod:`aitoolbox.experiment.redaction`): values under keys that look secret
    (:func:`~aitoolbox.experiment.secret_names.is_secret_key`), searched in nested dicts, lists, tuples, sets,
    namespaces and dataclasses, secrets inside text (:func:`redact_text`), and values wrapped in :class:`Secret`.
    ``hyperparams`` is not changed.

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
                        f"{type(hyperparams).__name__}: {redact_text(repr(hyperparams))}"[:300])
    return redact_value(hyperparams)
