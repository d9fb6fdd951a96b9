"""Secrets out of text that leaves its process: a URL's password, a bearer token, a Dartboard
API token, a `NAME=value` whose name says secret, and any secret value the caller knows
(the tokens in a child's environment). Each becomes `***`.

    redact("GET http://u:pw@h/ Authorization: Bearer abc", known=["s3cr3t-value"])

Used on what a process prints before it is copied off its host (`hostagent.log_ship`) and on
the OSWorld wheel's log lines (`envmanager.osworld_env`). Patterns catch what looks like a
secret; `known` catches what is one whatever it looks like (a 43-character purpose token
printed bare).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MASK = "***"
MIN_KNOWN_CHARS = 8  # a shorter "secret" (a port, "1") would mask ordinary text

# `http://user:secret@host` and `dartboard:<token>@host` (a desktop's address).
_USERINFO = re.compile(r"(//[^\s/@:]*:|\bdartboard:)[^\s/@]+@")
_BEARER = re.compile(r"(\bBearer\s+)[A-Za-z0-9._~+/=-]{8,}", re.I)
# datamanager.services.tokens: dbt_<key id>_<secret>; the key id is public, the rest is not.
_API_TOKEN = re.compile(r"\b(dbt_[0-9a-f]+_)[A-Za-z0-9_-]+")
# What a variable or key holding a secret is named with (DARTBOARD_ADMIN_TOKEN, VLLM_API_KEY,
# AWS_SECRET_ACCESS_KEY, password).
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "API_KEY", "ACCESS_KEY", "PRIVATE_KEY")
_SECRET_NAME = rf"[A-Za-z0-9_.-]*(?:{'|'.join(SECRET_WORDS)})"
# `ADMIN_TOKEN=...`, `password: ...`; not `max_tokens=32` (the name ends in the word).
_ASSIGNMENT = re.compile(rf"(\b{_SECRET_NAME}['\"]?\s*[=:]\s*['\"]?)[^\s'\",;]+", re.I)


def secret_name(name: str) -> bool:
    """Whether an environment variable (or a setting) named `name` holds a secret."""
    upper = name.upper()
    return any(word in upper for word in SECRET_WORDS)


def redact_credentials(text: str) -> str:
    """`http://user:secret@host` -> `http://user:***@host` (and `dartboard:<token>@host`)."""
    return _USERINFO.sub(rf"\1{MASK}@", text)


def redact(text: str, *, known: Iterable[str] = ()) -> str:
    """`text` with every secret `redact_credentials` and the patterns above find, and every
    `known` value of at least MIN_KNOWN_CHARS characters, written as ***. Known values are
    replaced longest first, so one that contains another is masked whole."""
    for value in sorted({k for k in known if len(k) >= MIN_KNOWN_CHARS}, key=len, reverse=True):
        text = text.replace(value, MASK)
    text = redact_credentials(text)
    text = _BEARER.sub(rf"\1{MASK}", text)
    text = _API_TOKEN.sub(rf"\1{MASK}", text)
    return _ASSIGNMENT.sub(rf"\1{MASK}", text)
