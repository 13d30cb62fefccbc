"""Which names say that what they name is secret: hyperparameter keys, header names and file names.

:mod:`aitoolbox.experiment.redaction` hides the values these names label; :class:`~aitoolbox.torchtrain.callbacks.
wandb.WandBTracking` never uploads the files they name. The rules are by name only: a value under an innocent name
is found by the value rules of :mod:`~aitoolbox.experiment.redaction` (URLs with a password, ``Secret``), or not
at all.

A key is split into words at every character that is not a letter or a digit and at camelCase boundaries
(``hfToken`` -> ``hf``, ``token``; ``AWS_SECRET_ACCESS_KEY`` -> ``aws``, ``secret``, ``access``, ``key``). It
looks secret when one of its words, compared case-insensitively, singular or plural:

- is in :data:`SECRET_WORDS` (``token``, ``key``, ``password``, ``secret``, ``credential``, ``auth``, ...);
- contains ``password``, ``passwd``, ``passphrase``, ``credential``, ``secret``, ``authorization`` or ``apikey``
  (``dbpassword``, ``clientsecret``, ``awssecretaccesskey``; not ``secretary``);
- is a compound of a qualifier and one of :data:`SECRET_WORDS` (``accesstoken``, ``apitoken``, ``privatekey``,
  ``masterkey``, ``dbpass``): the qualifiers are the words that make ``token``, ``key``, ``pass``... a credential
  (:data:`CREDENTIAL_QUALIFIERS`), so ``monkey``, ``turkey``, ``hotkey``, ``subtoken`` and ``bypass`` are not
  secret names. Whole words otherwise: ``keyboard``, ``tokenizer`` and ``passage`` are not secret either;
- is ``pat`` or ``sas`` after a qualifier (``GITHUB_PAT``, ``azure_sas``), ``id`` after ``session``, or ``jwt`` as
  the key's last word (``CI_JOB_JWT``; not ``jwt_algorithm``).

Letters are read as a person reads them (accents dropped, full-width forms and Cyrillic or Greek look-alikes read
as Latin letters): ``pässword`` and ``pаssword`` (Cyrillic ``а``) are ``password``.
"""
import functools
import os
import re
import unicodedata
from typing import Any, FrozenSet, List, Optional

__all__ = ["CREDENTIAL_QUALIFIERS", "MODEL_VOCABULARY_WORDS", "QUANTITY_WORDS", "SECRET_WORDS", "as_latin_letters",
           "is_credentials_file", "is_secret_key", "key_words", "names_a_model_part", "names_a_quantity",
           "secret_words_in"]

#: Words that make a key look secret (compared with the key's words, singular or plural).
SECRET_WORDS = frozenset({"token", "key", "secret", "password", "passwd", "passphrase", "pass", "pwd", "credential",
                          "apikey", "auth", "oauth", "authorization", "cookie", "signature", "sig", "webhook"})

#: Secret words that also name parts of models or training (a text's tokens, attention keys, a forward pass, a
#: significance level): under keys made only of these, values of numbers alone are kept.
MODEL_VOCABULARY_WORDS = frozenset({"token", "key", "pass", "sig"})

# Contained anywhere in a word, these make it secret (a word of its own or fused with others: "dbpassword").
_INFIX_WORDS = ("password", "passwd", "passphrase", "passcode", "credential", "secret", "authorization", "apikey",
                "sessionid", "sessid")
# Short words that name a credential only after a qualifier: a personal access token (``GITHUB_PAT``, ``hf_pat``),
# an Azure shared access signature (``azure_sas``, ``storage_sas``); alone they are abbreviations of anything.
_QUALIFIED_WORDS = frozenset({"pat", "sas"})
# Pairs of words that together name a credential: a session's identifier is its bearer's login (``SESSION_ID``).
_SECRET_PAIRS = frozenset({("session", "id"), ("sess", "id")})
# Words that name a credential as a key's last word (``CI_JOB_JWT``, ``jwt``), not before another
# (``jwt_algorithm``, ``jwt_issuer`` name its settings).
_LAST_WORDS = frozenset({"jwt", "jwts"})
_LAST_WORD_SUFFIXES = re.compile(r"v|v?[0-9]+")
# Words that contain "secret" and name no secret.
_NOT_SECRET = frozenset({"secretary", "secretaries", "secretarial", "secretariat", "secretariats", "secrete",
                         "secreted", "secretes", "secreting", "secretion", "secretions", "secretory"})
# Secret words that are also the ends of ordinary words (monkey, subtoken, bypass): fused with a word they
# follow, they are secret only after one of the qualifiers.
_SUFFIX_WORDS = tuple(sorted(SECRET_WORDS))

#: The words before ``token``, ``key``, ``pass``... in a fused word that make it a credential's name
#: (``accesstoken``, ``privatekey``, ``dbpass``).
CREDENTIAL_QUALIFIERS = frozenset({
    "access", "account", "admin", "api", "app", "auth", "aws", "azure", "bearer", "bot", "client", "consumer",
    "csrf", "database", "db", "deploy", "dev", "developer", "discord", "encryption", "gcp", "gcs", "gh", "github",
    "gitlab", "gpg", "hf", "hmac", "hub", "id", "jwt", "licence", "license", "live", "login", "master", "mlflow",
    "my", "oauth", "openai", "pass", "personal", "pg", "pgp", "pin", "private", "prod", "product", "refresh", "root",
    "s3", "secret", "service", "session", "sign", "signing", "slack", "ssh", "staging", "storage", "subscription",
    "telegram", "upload", "user", "wandb", "webhook", "write", "xsrf"})

# Split points of a key: runs of capitals (an acronym, ending before a capitalised word), capitalised or
# lower-case words, and digits.
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")


# Letters of other scripts drawn like Latin ones (Cyrillic and Greek), read as those: a key spelt "pаssword" with a
# Cyrillic "а" is read by people, and by the program that reads it back, as "password".
_LOOK_ALIKES = str.maketrans(
    "\u0430\u0432\u0435\u043a\u043c\u043d\u043e\u0440\u0441\u0442\u0443\u0445\u0455\u0456\u0458\u0501\u051b\u051d"
    "\u0410\u0412\u0415\u041a\u041c\u041d\u041e\u0420\u0421\u0422\u0423\u0425\u0405\u0406\u0408"
    "\u03b1\u03b9\u03ba\u03bd\u03bf\u03c1\u03c5\u0391\u0392\u0395\u0396\u0397\u0399\u039a\u039c\u039d\u039f"
    "\u03a1\u03a4\u03a5\u03a7\u0131\u0261",
    "aBeKMHopcTyxsijdqwABEKMHOPCTYXSIJaikvopuABEZHIKMNOPTYXig")


def as_latin_letters(name: str) -> str:
    """``name`` as its reader sees it in Latin letters: compatibility forms folded (full-width "ｐａｓｓ"), accents
    dropped ("pässword"), look-alike Cyrillic and Greek letters read as Latin ones, "ß" as "ss"."""
    if name.isascii():
        return name
    decomposed = unicodedata.normalize("NFKD", name)
    kept = "".join(char for char in decomposed if not unicodedata.combining(char))
    return kept.translate(_LOOK_ALIKES).replace("\u00df", "ss")


def key_words(name: Any) -> List[str]:
    """The lower-case words of a key: ``'hfToken'`` -> ``['hf', 'token']``, ``'API-KEY2'`` -> ``['api', 'key',
    '2']``. Letters are read as a person reads them (:func:`as_latin_letters`): ``'ｐａｓｓｗｏｒｄ'`` and
    ``'pässword'`` -> ``['password']``."""
    return [word.lower() for word in _WORD.findall(as_latin_letters(str(name)))]


def _singulars(word: str) -> List[str]:
    forms = [word]
    if word.endswith("es"):
        forms.append(word[:-2])
    if word.endswith("s"):
        forms.append(word[:-1])
    return forms


@functools.lru_cache(maxsize=4096)  # keys repeat at every checkpoint: judge each word once
def _secret_word_of(word: str) -> Optional[str]:
    """The secret word that ``word`` (one lower-case word of a key) is or contains, or None."""
    for form in _singulars(word):
        if form in SECRET_WORDS:
            return form
    innocent_removed = word
    for innocent in _NOT_SECRET:  # "maxsecretary" holds "secret" only inside "secretary"
        innocent_removed = innocent_removed.replace(innocent, " ")
    for infix in _INFIX_WORDS:
        if infix in innocent_removed:
            return infix
    for form in _singulars(word):
        for suffix in _SUFFIX_WORDS:
            if form.endswith(suffix) and len(form) > len(suffix):
                prefix = form[:-len(suffix)]
                if any(prefix.endswith(qualifier) for qualifier in CREDENTIAL_QUALIFIERS):
                    return suffix
    return None


def secret_words_in(name: Any) -> FrozenSet[str]:
    """The secret words (of :data:`SECRET_WORDS`, or fused into a word, see the module) the key ``name`` holds;
    empty when it does not look secret."""
    words = key_words(name)
    found = {word for word in map(_secret_word_of, words) if word is not None}
    end = len(words)
    while end > 0 and _LAST_WORD_SUFFIXES.fullmatch(words[end - 1]):  # a version after it: CI_JOB_JWT_V2
        end -= 1
    if end > 0 and words[end - 1] in _LAST_WORDS:
        found.add("jwt")
    for before, word in zip(words, words[1:]):
        if (before, word) in _SECRET_PAIRS:
            found.add(before + word)
        if word in _QUALIFIED_WORDS and any(form in CREDENTIAL_QUALIFIERS for form in _singulars(before)):
            found.add(word)
    return frozenset(found)


def is_secret_key(name: Any) -> bool:
    """True when the key ``name`` looks secret (see the module's rules): ``api_key``, ``hfToken``,
    ``DB_PASSWORD``, ``credentials``, ``dbpassword``, ``accesstoken``; not ``monkey``, ``keyboard``,
    ``tokenizer``."""
    return bool(secret_words_in(name))


#: Words that make a key name a quantity (``signature_dim``, ``cookie_size``, ``password_len``,
#: ``max_token_count``): under such a key a number is a size or a count, not a credential.
QUANTITY_WORDS = frozenset({"dim", "dims", "size", "sizes", "len", "length", "lengths", "count", "counts", "num",
                            "max", "min", "width", "height", "depth", "bits", "limit", "limits", "ratio", "n"})


def names_a_quantity(name: Any) -> bool:
    """True when the secret-looking key ``name`` has a word of :data:`QUANTITY_WORDS` besides its secret words: a
    number under it is a size or a count (``signature_dim``, ``password_len``), kept by the redaction."""
    return any(word in QUANTITY_WORDS for word in key_words(name))


def names_a_model_part(name: Any) -> bool:
    """True when the secret-looking key ``name`` rather names a part of a model or of training, under which a number
    is a size or an index, not a credential: ``max_tokens``, ``pad_token_id``, ``num_key_value_heads``,
    ``key_dims``. That is when its secret words are all of :data:`MODEL_VOCABULARY_WORDS` (``token``, ``key``,
    ``pass``, ``sig``), standing as words of their own next to at least one other word, none of them fused with a
    qualifier nor following one (``api_key``, ``access_token``, ``hf_token``, ``accesstoken`` name credentials),
    and the key is not one of those words alone (``pass``, ``key``: a numeric PIN or key is still a secret)."""
    words = key_words(name)
    found = [_secret_word_of(word) for word in words]
    secret = [index for index, word in enumerate(found) if word is not None]
    if not secret or len(secret) == len(words):
        return False
    for index in secret:
        if found[index] not in MODEL_VOCABULARY_WORDS or found[index] not in _singulars(words[index]):
            return False  # a long secret word, or one fused with a qualifier ("accesstoken")
        if index > 0 and any(form in CREDENTIAL_QUALIFIERS for form in _singulars(words[index - 1])):
            return False  # "api_key", "access_token"; "pad_token_id" has its qualifier after the word
    return True


# --- files ----------------------------------------------------------------------------------------------------
# Files that hold credentials by their name: tool login and configuration files, SSH keys, shell histories.
_CREDENTIAL_FILE_NAMES = frozenset({
    ".env", ".envrc", ".netrc", "_netrc", ".pgpass", ".git-credentials", ".npmrc", ".yarnrc", ".yarnrc.yml",
    ".pypirc", ".htpasswd", "credentials", "id_rsa", "id_dsa", "id_ecdsa", "id_ed25519", ".s3cfg", ".boto",
    "kubeconfig", ".kubeconfig", ".dockercfg", ".my.cnf", ".mylogin.cnf", ".databrickscfg", ".terraformrc",
    "terraform.rc", ".vault-token", "kaggle.json", ".bash_history", ".zsh_history", ".python_history",
    ".psql_history", ".mysql_history", ".sqlite_history", ".rediscli_history", "authorized_keys", "known_hosts",
    ".gitconfig", ".git-credential-cache", "htpasswd", "shadow", "passwd"})
_CREDENTIAL_FILE_EXTENSIONS = frozenset({
    ".env", ".pem", ".key", ".p12", ".pfx", ".jks", ".keystore", ".kdbx", ".gpg", ".asc", ".ppk", ".tfvars",
    ".tfstate", ".kubeconfig", ".ovpn", ".crt", ".cer", ".der", ".p8", ".keytab"})
# Folders whose every file is a credential or a tool's private state (also the tools' configuration folders that
# keep tokens: .docker/config.json, .kube/config, .aws/config).
_CREDENTIAL_FOLDERS = frozenset({".ssh", ".gnupg", ".aws", ".kube", ".docker", ".azure", ".gcloud",
                                 ".git", ".password-store", ".vault", ".config/gcloud", ".terraform.d"})
# Parts of names that mark a cloud service account's key (service-account.json, my-sa_service_account.json).
_SERVICE_ACCOUNT = re.compile(r"service[-_. ]?account|serviceaccount", re.IGNORECASE)


def is_credentials_file(path: str, root: Optional[str] = None) -> bool:
    """True for a file that is, by its name or its folder, likely to hold credentials: never uploaded as code.

    These are ``.env`` and ``.env.*`` files, login and configuration files of tools (``.netrc``, ``.pgpass``,
    ``.git-credentials``, ``.npmrc``, ``.pypirc``, ``.s3cfg``, ``.boto``, ``kubeconfig``, ``.dockercfg``,
    ``.envrc``, ``.my.cnf``, ``.databrickscfg``, ``kaggle.json``, ``credentials``...), shell histories, key
    material (``*.pem``, ``*.key``, ``*.p12``, ``*.pfx``, ``*.jks``, ``*.ppk``, certificates, SSH keys
    ``id_rsa``...), Terraform variables and state, cloud service-account keys (``service-account.json``), files
    inside folders of credentials (``.ssh/``, ``.aws/``, ``.kube/``, ``.docker/``, ``.gnupg/``, ``.git/``...),
    and files whose name looks secret by :func:`is_secret_key` (``credentials.json``, ``client_secret.json``,
    ``token.pickle``, ``api_key.txt``). Python files are judged by the words other than ``token``, ``key`` and
    ``pass``: those name code in NLP projects (``token_classification.py``, ``keys.py``); ``secrets.py`` is refused.

    Args:
        path: the file.
        root: the folder being uploaded; only the folders below it are judged (a project kept under a folder
            named ``.git`` elsewhere is not refused as a whole). None: every folder of ``path``.
    """
    path = os.fspath(path)
    name = os.path.basename(path).lower()
    stem, extension = os.path.splitext(name)
    if name in _CREDENTIAL_FILE_NAMES or name.startswith((".env.", ".envrc.")) or \
            extension in _CREDENTIAL_FILE_EXTENSIONS or _SERVICE_ACCOUNT.search(name):
        return True
    if any(name.startswith(ssh_key) for ssh_key in ("id_rsa", "id_dsa", "id_ecdsa", "id_ed25519")):
        return True
    inside = os.path.relpath(path, root) if root is not None else path
    folders = [part.lower() for part in re.split(r"[\\/]+", os.path.dirname(inside)) if part]
    if any(part in _CREDENTIAL_FOLDERS for part in folders) or \
            any("/".join(pair) in _CREDENTIAL_FOLDERS for pair in zip(folders, folders[1:])):
        return True
    words = secret_words_in(stem)
    if extension == ".py":
        return bool(words - MODEL_VOCABULARY_WORDS)
    return bool(words)
