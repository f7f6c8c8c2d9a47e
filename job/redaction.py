"""Secrets out of everything the job prints or stores: one place, by name and by value.

Everything that prints or stores settings, URIs, errors or config goes through here: run.json (job/runs.py), the
driver's and the actors' stdout/stderr and logging (`install`), the command line's error lines (job/cli.py).

What is redacted (replaced by REDACTED):
- by name: the value under a key named like a secret (`hf_token`, `apiKey`, `AWS_SECRET_ACCESS_KEY`,
  `SIGNING_PASSPHRASE`, `SENTRY_DSN`, `GH_PAT`), at any depth; a name that is a figure, an id or a piece of the
  model (`bytes_per_token`, `num_tokens`, `pad_token_id`, `num_key_value_heads`) is data and kept as written, as is
  prose ("bytes per token: layers × hidden size × 2");
- by value, wherever it appears in a string:
  - URL credentials: a password (`https://user:pw@host`) or a user part alone (a DSN: `https://<key>@host/1`);
  - query parameters that carry credentials (`X-Amz-Signature`, `X-Amz-Credential`, `X-Amz-Security-Token`,
    Azure SAS `sig`, `token`, `api_key`, ...: any parameter whose name is a secret's name);
  - `key=value` / `key: value` pairs whose key is a secret's name, inside any text (Azure connection strings'
    `AccountKey=…` and `SharedAccessSignature=…`, `password=…` in a DSN or a log line);
  - well-known token shapes. The patterns come from Yelp's detect-secrets (maintained, used by pre-commit hooks
    across the industry: AWS access key ids, GitHub `ghp_…`, GitLab `glpat-…`, Slack `xox…`, Azure storage keys,
    JWTs, private keys, Stripe, SendGrid, PyPI, npm, Discord), plus the shapes it lacks: Hugging Face `hf_…`,
    GitHub fine-grained `github_pat_…`, OpenAI-style `sk-…` (its own pattern matches only the legacy format).
    Its entropy and keyword plugins are left out: they would redact shard hashes and ordinary words.
"""

from __future__ import annotations

import io
import logging
import os
import re
import sys

REDACTED = "<redacted>"

# Words that make a key a secret's name, matched as whole words of the key (split at `_`, `-`, `.`, spaces and
# camelCase): `hf_token` and `apiKey` are secrets, `max_tokens` and `num_speculative_tokens` are not.
# Strong words name a secret whatever surrounds them; weak ones are also everyday words of this job (a model's
# tokens, a dict's keys, Ray's session) and name a secret only when no word of the key makes it a figure, an id, a
# path or a piece of the model: `bytes_per_token`, `pad_token_id`, `num_key_value_heads`, `session_dir` are data and
# are kept as written, `HF_TOKEN`, `AWS_SESSION_TOKEN`, `AWS_ACCESS_KEY_ID`, `private_key` are redacted.
_STRONG_SECRET_WORDS = {"apikey", "accountkey", "secret", "password", "passwd", "pwd", "passphrase", "credential",
                        "credentials", "authorization", "cookie", "dsn", "pat", "sas"}
_WEAK_SECRET_WORDS = {"key", "token", "session", "signature", "sig"}
_NOT_A_SECRET_WORDS = {
    # figures: how many, how big, per what
    "per", "num", "max", "min", "count", "bytes", "size", "dim", "len", "length", "lengths", "total", "rate", "freq",
    # a vocabulary's special tokens and their ids, and pieces of a model
    "id", "ids", "pad", "bos", "eos", "unk", "sep", "cls", "mask", "loss", "image", "video", "vision", "added",
    "heads", "head", "layer", "value", "values", "past", "embedding", "lm", "weighted", "wise", "alignment", "dict",
    "row", "dynamic", "shapes", "tokens", "column", "stage", "trainer", "measured", "cache", "sort", "partition",
    "end", "turn",
    # where a secret is, not the secret
    "dir", "path", "file", "name",
}
# `id` says "a vocabulary's token id" after `token`; after `key` it is AWS_ACCESS_KEY_ID, a credential.
_KEY_ID = ("key", "id")


def _words(key: str) -> list[str]:
    return [w.lower() for w in re.split(r"[_\-.\s]+|(?<=[a-z0-9])(?=[A-Z])", str(key)) if w]


def _names_a_secret(words: list[str]) -> bool:
    if any(w in _STRONG_SECRET_WORDS for w in words) or ("connection" in words and "string" in words):
        return True
    if not any(w in _WEAK_SECRET_WORDS for w in words):
        return False
    if any(words[i:i + 2] == list(_KEY_ID) for i in range(len(words) - 1)):
        return True
    return not any(w in _NOT_A_SECRET_WORDS for w in words)


def is_secret_name(key: str) -> bool:
    """Whether `key` names a secret (see _STRONG_SECRET_WORDS). A connection string is one whatever its words."""
    return _names_a_secret(_words(key))


# ---------------------------------------------------------------------------------------------------------------
# Value patterns
# ---------------------------------------------------------------------------------------------------------------

# scheme://user:password@ and scheme://token@ (userinfo without a password: a DSN's key). The user part of a
# user:password pair is kept (it says which account), the rest goes.
_URL_USERINFO = re.compile(r"(?P<scheme>\b[a-z][a-z0-9+.-]*://)(?P<user>[^/:@\s?#]*)(?::(?P<password>[^/@\s?#]*))?@",
                           re.I)
# name=value inside a URL query, a connection string or any text: the name decides (is_secret_name).
_KEY_VALUE = re.compile(r"(?P<key>[A-Za-z][\w.-]*)(?P<sep>\s*[=:]\s*)(?P<quote>[\"']?)(?P<value>[^\s;&\"',)}\]]+)")

_OWN_SHAPES = [
    r"\bhf_[A-Za-z0-9]{20,}",  # Hugging Face user access tokens
    r"\bgithub_pat_[A-Za-z0-9_]{22,}",  # GitHub fine-grained personal access tokens
    r"\bsk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{20,}",  # OpenAI-style API keys (and others of that form)
]

# detect-secrets plugins whose patterns are specific enough to run over every line the job prints.
_DETECT_SECRETS_PLUGINS = ("AWSKeyDetector", "AzureStorageKeyDetector", "GitHubTokenDetector", "GitLabTokenDetector",
                           "SlackDetector", "JwtTokenDetector", "StripeDetector", "SendGridDetector",
                           "PypiTokenDetector", "NpmDetector", "DiscordBotTokenDetector", "OpenAIDetector",
                           "SquareOAuthDetector", "PrivateKeyDetector")
_shapes: list[re.Pattern] | None = None


def _token_shapes() -> list[re.Pattern]:
    global _shapes
    if _shapes is None:
        patterns = [re.compile(p) for p in _OWN_SHAPES]
        try:
            from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class  # heavy: imported on use

            for cls in get_mapping_from_secret_type_to_class().values():
                if cls.__name__ in _DETECT_SECRETS_PLUGINS:
                    patterns += list(getattr(cls, "denylist", ()))
        except ImportError:  # the package is a dependency; without it the own shapes still apply
            pass
        _shapes = patterns
    return _shapes


def _prose_words(m: re.Match) -> list[str]:
    """The two words before a `key: value` match on its line: in prose the key is the last word of a phrase ("bytes
    per token: 4 × hidden size", "loss-mask token: an empty completion"), and the phrase decides."""
    line_start = m.string.rfind("\n", 0, m.start()) + 1
    before = m.string[line_start:m.start()]
    if before and not before[-1].isspace():
        return []  # inside a longer token (a URL's query): the key alone decides
    return _words(" ".join(before.split()[-2:]))


def redact_text(text: str) -> str:
    """`text` with every secret the value patterns find replaced by REDACTED (see the module docstring)."""
    if not text or not isinstance(text, str):
        return text

    def userinfo(m: re.Match) -> str:
        if m["password"] is not None:
            return f"{m['scheme']}{m['user']}:{REDACTED}@"
        return f"{m['scheme']}{REDACTED}@" if m["user"] else m[0]

    def key_value(m: re.Match) -> str:
        prose = _prose_words(m) if m["sep"].strip() == ":" else []  # `name=value` is never prose: the name decides
        if m["value"] == REDACTED or not _names_a_secret(prose + _words(m["key"])):
            return m[0]
        if m["sep"].strip() == ":" and m["sep"] != ":" and m["value"].isalpha() and m["value"].islower() and \
                len(m["value"]) <= 4:
            # "name: word" with a space is prose as often as YAML: "no loss-mask token: an empty completion" lost its
            # "an". Only a short lowercase word is let through; "password: hunter2" stays redacted.
            return m[0]
        return f"{m['key']}{m['sep']}{m['quote']}{REDACTED}"

    text = _URL_USERINFO.sub(userinfo, text)
    text = _KEY_VALUE.sub(key_value, text)
    for pattern in _token_shapes():
        text = pattern.sub(REDACTED, text)  # the whole match (a pattern's groups may be just a prefix)
    return text


def redact(value):
    """A copy of `value` (JSON-like) without secrets: values under secret-named keys, and `redact_text` of every
    string."""
    if isinstance(value, dict):
        return {k: (REDACTED if is_secret_name(k) and value[k] not in (None, "", {}, []) else redact(v))
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


def is_secret_env(name: str, value: str) -> bool:
    """An environment variable that holds a secret: by its name, or by its value's shape."""
    return is_secret_name(name) or redact_text(str(value)) != str(value)


def split_env(env_vars: dict) -> tuple[dict, dict]:
    """(plain, secret) environment variables. Only the plain ones may go into a Ray runtime_env (Ray writes runtime
    envs to its logs and shows them in the dashboard); the secret ones are handed to an actor at construction and
    set in its own process (`apply_secret_env`)."""
    plain, secret = {}, {}
    for k, v in env_vars.items():
        (secret if is_secret_env(k, v) else plain)[k] = v
    return plain, secret


# ---------------------------------------------------------------------------------------------------------------
# Everything a process prints
# ---------------------------------------------------------------------------------------------------------------


class _RedactingStream(io.TextIOBase):
    """A text stream that redacts every line before it reaches the wrapped one (line-buffered: a secret split over
    two writes is still whole when the line is redacted)."""

    def __init__(self, stream):
        self._stream, self._pending = stream, ""

    def write(self, s: str) -> int:
        self._pending += s
        if "\n" in self._pending or "\r" in self._pending:
            cut = max(self._pending.rfind("\n"), self._pending.rfind("\r")) + 1
            self._stream.write(redact_text(self._pending[:cut]))
            self._pending = self._pending[cut:]
            self._stream.flush()
        return len(s)

    def flush(self) -> None:
        if self._pending:
            self._stream.write(redact_text(self._pending))
            self._pending = ""
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self):
        return getattr(self._stream, "encoding", "utf-8")

    def __getattr__(self, name):  # buffer, errors, reconfigure, ...: the wrapped stream's
        return getattr(self._stream, name)


class _RedactingFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact_text(message)
        if clean != message:
            record.msg, record.args = clean, ()
        return True


def install() -> None:
    """Redact everything this process prints from now on: sys.stdout, sys.stderr and every logging handler of the
    root logger (a handler made later by basicConfig writes to the wrapped streams). Idempotent."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _RedactingStream):
            setattr(sys, name, _RedactingStream(stream))
    root = logging.getLogger()
    for handler in root.handlers:
        if not any(isinstance(f, _RedactingFilter) for f in handler.filters):
            handler.addFilter(_RedactingFilter())
    if not any(isinstance(f, _RedactingFilter) for f in root.filters):
        root.addFilter(_RedactingFilter())


def apply_secret_env(secret_env: dict) -> None:
    """In an actor, first thing: the secrets its driver handed it, set in this process only (its engine's
    subprocesses inherit them), and everything it prints redacted."""

    os.environ.update({k: str(v) for k, v in secret_env.items()})
    install()
