"""Reading Dartboard's settings from the environment, failing loudly with a fix.

Pure helpers (no Django import) so the launcher and the settings module share them.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path
from urllib.parse import urlparse

from rollout.auth import purpose_token

PRIVATE_DIRS = ("logs", "run", "redis")  # 0700 under DARTBOARD_HOME (itself 0700)
# Files only this user may read: secrets, the database (sessions), logs, the launcher's pids.
PRIVATE_FILES = (
    "secret_key",
    "service_token",
    "dartboard.sqlite3",
    "dartboard.sqlite3-wal",
    "dartboard.sqlite3-shm",
    "logs/*",
    "run/*",
    "redis/*",
)


class SettingsError(Exception):
    """A setting read from the environment is missing or malformed."""


def dartboard_home() -> Path:
    """DARTBOARD_HOME (default ./var): SQLite file, media, checkpoints, logs, Redis socket."""
    raw = os.environ.get("DARTBOARD_HOME", "var")
    home = Path(raw).expanduser().resolve()
    if home.exists() and not home.is_dir():
        raise SettingsError(
            f"DARTBOARD_HOME={raw!r} is a file, not a directory. "
            "Point DARTBOARD_HOME at a directory (it is created if missing), e.g. DARTBOARD_HOME=./var."
        )
    return home


def embedded_redis_socket(home: Path) -> Path:
    return home / "redis" / "redis.sock"


def redis_url(home: Path) -> tuple[str, bool]:
    """(url, embedded). REDIS_URL if set, else the embedded Redis socket under DARTBOARD_HOME."""
    raw = os.environ.get("REDIS_URL", "").strip()
    if not raw:
        return f"unix://{embedded_redis_socket(home)}", True
    parsed = urlparse(raw)
    if parsed.scheme not in ("redis", "rediss", "unix"):
        raise SettingsError(
            f"REDIS_URL={raw!r} has scheme {parsed.scheme!r}; use redis://HOST:PORT/DB, "
            "rediss://... or unix:///path/to/redis.sock (or unset it for the embedded Redis)."
        )
    if parsed.scheme in ("redis", "rediss") and not parsed.hostname:
        raise SettingsError(f"REDIS_URL={raw!r} names no host; use e.g. redis://127.0.0.1:6379/0.")
    return raw, False


def artifacts_url(home: Path) -> str:
    """DARTBOARD_ARTIFACTS, else a directory under DARTBOARD_HOME."""
    raw = os.environ.get("DARTBOARD_ARTIFACTS", "").strip()
    if not raw:
        return f"file://{home / 'artifacts'}"
    parsed = urlparse(raw)
    if not (parsed.scheme == "file" and parsed.path.startswith("/")) and not (
        parsed.scheme == "s3" and parsed.netloc
    ):
        raise SettingsError(
            f"DARTBOARD_ARTIFACTS={raw!r}: use s3://BUCKET/PREFIX (with AWS_S3_ENDPOINT_URL for "
            "an S3-compatible server) or file:///absolute/path"
        )
    return raw


def redis_db(url: str) -> int:
    """The database number a Redis URL names: `redis://host:6379/2` -> 2, `unix:///s?db=3` -> 3,
    0 where it names none."""
    parsed = urlparse(url)
    if parsed.scheme == "unix":
        query = dict(part.split("=", 1) for part in parsed.query.split("&") if "=" in part)
        raw = query.get("db", "0")
    else:
        raw = parsed.path.lstrip("/") or "0"
    if not raw.isdigit():
        raise SettingsError(f"REDIS_URL={url!r} names database {raw!r}; use a number, e.g. /0.")
    return int(raw)


def celery_url(url: str) -> str:
    """Celery/kombu spell a unix socket `redis+socket:///path`."""
    if url.startswith("unix://"):
        return "redis+socket://" + url[len("unix://") :]
    return url


def database_url(home: Path) -> str:
    raw = os.environ.get("DATABASE_URL", "").strip()
    if not raw:
        return f"sqlite:///{home / 'dartboard.sqlite3'}"
    scheme = urlparse(raw).scheme
    if scheme not in ("sqlite", "postgres", "postgresql", "pgsql"):
        raise SettingsError(
            f"DATABASE_URL={raw!r}: scheme {scheme!r} is not supported. Use "
            "postgres://USER:PASSWORD@HOST:5432/NAME or sqlite:////absolute/path.sqlite3 "
            "(or unset it for SQLite under DARTBOARD_HOME)."
        )
    return raw


def secret_key(home: Path, *, production: bool) -> str:
    """SECRET_KEY from the environment; generated once under DARTBOARD_HOME for local use."""
    return _home_secret(home, name="SECRET_KEY", filename="secret_key", production=production)


def service_token(home: Path, *, production: bool) -> str:
    """DARTBOARD_SERVICE_TOKEN, the master secret the web and the workers hold (and derive
    every purpose's token from, rollout.auth); from the environment, else generated once
    under DARTBOARD_HOME for local use. It is given to no other process."""
    return _home_secret(
        home, name="DARTBOARD_SERVICE_TOKEN", filename="service_token", production=production
    )


def purpose_setting(*, name: str, purpose: str, master: str, production: bool) -> str:
    """A purpose's token (DARTBOARD_INFERENCE_TOKEN, DARTBOARD_ADMIN_TOKEN): from the
    environment where a deployment sets it (compose, whose services cannot derive it), else
    derived from the master."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return purpose_token(master, purpose)
    if len(raw) < (32 if production else 16) or not raw.isascii():
        raise SettingsError(
            f"{name} must be ASCII and at least {32 if production else 16} characters; "
            f"unset it to derive it from DARTBOARD_SERVICE_TOKEN, or print the derived one "
            f"with `python -m rollout.auth {purpose}`."
        )
    return raw


def home_make_private(home: Path) -> list[Path]:
    """DARTBOARD_HOME and its logs/run/redis directories 0700, its secrets, SQLite database,
    logs and pid files 0600: the modes a 077 umask gives new ones, put on those an older
    start left readable. Returns the paths whose mode changed."""
    home.mkdir(parents=True, exist_ok=True)
    changed = [p for p in (home, *(home / d for d in PRIVATE_DIRS)) if _chmod(p, 0o700)]
    for pattern in PRIVATE_FILES:
        changed += [p for p in home.glob(pattern) if not p.is_dir() and _chmod(p, 0o600)]
    return changed


def _chmod(path: Path, mode: int) -> bool:
    """Set `mode` on an existing path (links are not followed); True if it changed."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(info.st_mode) or stat.S_IMODE(info.st_mode) == mode:
        return False
    path.chmod(mode)
    return True


def _home_secret(home: Path, *, name: str, filename: str, production: bool) -> str:
    raw = os.environ.get(name, "").strip()
    if raw:
        if production and len(raw) < 32:
            raise SettingsError(
                f"{name} is shorter than 32 characters; generate a long random one."
            )
        return raw
    if production:
        raise SettingsError(
            f"DARTBOARD_ENV=production needs {name} set explicitly, e.g. "
            f"{name}=$(python -c 'import secrets; print(secrets.token_urlsafe(50))')."
        )
    path = home / filename
    if path.exists():
        return path.read_text().strip()
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = secrets.token_urlsafe(50)
    # Written with O_EXCL so two processes starting at once agree on one key.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as fh:
        fh.write(key)
    return key


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}={raw!r} is not a boolean; use 1/0, true/false, yes/no or on/off.")


def env_list(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    raw = (os.environ.get(name) or "").strip()
    if not raw:
        return default
    if raw not in choices:
        raise SettingsError(f"{name}={raw!r} is not one of {', '.join(choices)}.")
    return raw


def env_int(name: str, default: int) -> int:
    """A whole number >= 0 from the environment (default when unset)."""
    raw = (os.environ.get(name) or "").strip()
    if not raw:
        return default
    if not raw.isdigit():
        raise SettingsError(f"{name}={raw!r} is not a whole number >= 0; e.g. {name}={default}.")
    return int(raw)


def env_optional_int(name: str) -> int | None:
    """A whole number >= 0 from the environment, or None when unset."""
    raw = (os.environ.get(name) or "").strip()
    if not raw:
        return None
    return env_int(name, 0)


ENV_KINDS = ("desktop", "miniwob", "osworld", "sim")


def env_kinds(name: str) -> tuple[str, ...] | None:
    """A comma-separated list of env kinds, "none" for none, or None when unset."""
    raw = (os.environ.get(name) or "").strip()
    if not raw:
        return None
    if raw == "none":
        return ()
    kinds = tuple(sorted({k.strip() for k in raw.split(",") if k.strip()}))
    unknown = [k for k in kinds if k not in ENV_KINDS]
    if unknown:
        raise SettingsError(
            f"{name}={raw!r} names {', '.join(unknown)}, not an env kind; use some of "
            f"{', '.join(ENV_KINDS)} (comma-separated), or none."
        )
    return kinds


def env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment (default when unset)."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise SettingsError(f"{name}={raw!r} is not a positive number of seconds; e.g. {name}=30.")
    return value


# Tracking stores the installed mlflow-skinny opens itself. Its SQL store (sqlite://,
# postgresql://) needs SQLAlchemy, which only the full `mlflow` package brings: serve one
# with `mlflow server --backend-store-uri sqlite:///mlflow.db` and point at it over http.
_MLFLOW_SCHEMES = ("file", "http", "https", "databricks")


def mlflow_tracking_uri() -> str:
    """DARTBOARD_MLFLOW_TRACKING_URI ("" when unset: no MLflow export)."""
    raw = os.environ.get("DARTBOARD_MLFLOW_TRACKING_URI", "").strip()
    if not raw:
        return ""
    parsed = urlparse(raw)
    if parsed.scheme not in _MLFLOW_SCHEMES:
        raise SettingsError(
            f"DARTBOARD_MLFLOW_TRACKING_URI={raw!r}: use http(s)://HOST:PORT for an MLflow "
            "server (e.g. `mlflow server --backend-store-uri sqlite:///mlflow.db`), "
            "file:///absolute/path for a local store, or databricks. SQL stores such as "
            "sqlite:// need the full mlflow package; Dartboard installs mlflow-skinny."
        )
    if parsed.scheme == "file" and not env_bool("MLFLOW_ALLOW_FILE_STORE", default=False):
        raise SettingsError(
            f"DARTBOARD_MLFLOW_TRACKING_URI={raw!r}: MLflow refuses its file store (maintenance "
            "mode) unless MLFLOW_ALLOW_FILE_STORE=true is set too; set it, or use an MLflow "
            "server over http."
        )
    return raw
