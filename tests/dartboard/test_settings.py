"""Settings read from the environment fail loudly, with the fix in the message."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dartboard import config_env

ROOT = Path(__file__).resolve().parents[2]


def _django_setup(env_overrides: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {
        k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY")
    }
    env.update({"DJANGO_SETTINGS_MODULE": "dartboard.settings", "DARTBOARD_HOME": str(tmp_path)})
    env.update(env_overrides)
    return subprocess.run(
        [sys.executable, "-c", "import django; django.setup(); print('ok')"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )


@pytest.mark.parametrize(
    ("overrides", "fix"),
    [
        ({"DATABASE_URL": "mysql://x@y/z"}, "postgres://USER:PASSWORD@HOST:5432/NAME"),
        ({"REDIS_URL": "http://127.0.0.1:6379"}, "redis://HOST:PORT/DB"),
        ({"DARTBOARD_ENV": "production"}, "needs SECRET_KEY set explicitly"),
        ({"DARTBOARD_ENV": "production", "SECRET_KEY": "k" * 50}, "needs ALLOWED_HOSTS"),
        ({"DARTBOARD_ENV": "staging"}, "use 'local' (default) or 'production'"),
        ({"DARTBOARD_DEBUG": "maybe"}, "is not a boolean"),
        ({"DARTBOARD_MLFLOW_TRACKING_URI": "sqlite:///mlflow.db"}, "mlflow server --backend"),
        (
            {"DARTBOARD_MLFLOW_TRACKING_URI": "file:///tmp/mlruns", "MLFLOW_ALLOW_FILE_STORE": ""},
            "unless MLFLOW_ALLOW_FILE_STORE=true",
        ),
    ],
)
def test_bad_setting_fails_with_how_to_fix_it(overrides, fix, tmp_path):
    result = _django_setup(overrides, tmp_path)
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    assert fix in result.stderr


@pytest.mark.slow  # starts Django in a subprocess
def test_embedded_defaults_keep_everything_under_home(tmp_path):
    result = _django_setup({}, tmp_path)
    assert result.stdout.strip() == "ok", result.stderr
    key = (tmp_path / "secret_key").read_text()
    assert len(key) >= 40
    # The key is generated once and kept.
    _django_setup({}, tmp_path)
    assert (tmp_path / "secret_key").read_text() == key


def test_redis_url_defaults_to_embedded_socket(tmp_path, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    url, embedded = config_env.redis_url(tmp_path)
    assert embedded and url == f"unix://{tmp_path}/redis/redis.sock"
    assert config_env.celery_url(url) == f"redis+socket://{tmp_path}/redis/redis.sock"
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:6379/0")
    assert config_env.redis_url(tmp_path) == ("redis://127.0.0.1:6379/0", False)


def test_home_that_is_a_file_is_rejected(tmp_path, monkeypatch):
    f = tmp_path / "afile"
    f.write_text("x")
    monkeypatch.setenv("DARTBOARD_HOME", str(f))
    with pytest.raises(config_env.SettingsError, match="is a file, not a directory"):
        config_env.dartboard_home()


def test_tls_proxy_settings_for_a_production_deployment(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update({
        "DJANGO_SETTINGS_MODULE": "dartboard.settings", "DARTBOARD_HOME": str(tmp_path),
        "DARTBOARD_ENV": "production", "SECRET_KEY": "k" * 50,
        "ALLOWED_HOSTS": "dartboard.example.org", "DARTBOARD_TLS_PROXY": "1",
        "CSRF_TRUSTED_ORIGINS": "https://dartboard.example.org",
        "DARTBOARD_HSTS_SECONDS": "31536000",
    })  # fmt: skip
    code = (
        "import django; django.setup(); from django.conf import settings as s; "
        "print(s.SECURE_PROXY_SSL_HEADER, s.CSRF_TRUSTED_ORIGINS, s.SECURE_HSTS_SECONDS, "
        "s.SESSION_COOKIE_SECURE, s.SECURE_SSL_REDIRECT)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.stdout.strip() == (
        "('HTTP_X_FORWARDED_PROTO', 'https') ['https://dartboard.example.org'] 31536000 True True"
    ), result.stderr
