"""Login throttling: at most MAX_FAILURES failed logins per username and client address in
WINDOW_S; past that the login form (the dashboard's and the admin's) refuses that pair, the
right password included, until the window ends, and says when to try again (the dashboard's
answers 429 with Retry-After). A successful login clears the pair's count.

The counts live in Django's cache: with the default local-memory cache, per web process (the
launcher and docker-compose run one). The client address is the connection's; behind the
TLS proxy (DARTBOARD_TLS_PROXY) it is the last X-Forwarded-For entry, the one the proxy
wrote (Caddy replaces a client's own header).
"""

from __future__ import annotations

import hashlib
import math
import time

from django.conf import settings
from django.core.cache import cache
from django.http import HttpRequest

MAX_FAILURES = 5
WINDOW_S = 15 * 60


def client_address(request: HttpRequest | None) -> str:
    if request is None:
        return "unknown"
    if settings.DARTBOARD_TLS_PROXY:
        forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")[-1].strip()
        if forwarded:
            return forwarded
    return str(request.META.get("REMOTE_ADDR") or "unknown")


def _keys(username: str, address: str) -> tuple[str, str]:
    # Hashed: a username may hold any character, and some caches restrict key characters.
    pair = hashlib.sha256(f"{username.casefold()}\0{address}".encode()).hexdigest()
    return f"dartboard:login-failures:{pair}", f"dartboard:login-window:{pair}"


def login_retry_after(*, username: str, address: str) -> int | None:
    """Seconds until the pair may try again, or None when it may try now."""
    count_key, window_key = _keys(username, address)
    if cache.get(count_key, 0) < MAX_FAILURES:
        return None
    ends = cache.get(window_key)
    if ends is None:  # the window ended between the two reads
        return None
    return max(1, math.ceil(ends - time.time()))


def login_failed(*, username: str, address: str) -> None:
    """Count one failed login of the pair; the first failure opens its window."""
    count_key, window_key = _keys(username, address)
    cache.add(window_key, time.time() + WINDOW_S, WINDOW_S)
    cache.add(count_key, 0, WINDOW_S)
    try:
        cache.incr(count_key)
    except ValueError:  # the window ended between add and incr: this failure opens a new one
        cache.set(window_key, time.time() + WINDOW_S, WINDOW_S)
        cache.set(count_key, 1, WINDOW_S)


def login_succeeded(*, username: str, address: str) -> None:
    cache.delete_many(list(_keys(username, address)))


def wait_words(seconds: int) -> str:
    """'3 seconds', '1 minute', '15 minutes': how long to wait, rounded up."""
    if seconds < 60:
        return f"{seconds} second{'s' if seconds != 1 else ''}"
    minutes = math.ceil(seconds / 60)
    return f"{minutes} minute{'s' if minutes != 1 else ''}"
