"""Test settings: the project's settings with a throwaway DARTBOARD_HOME.

TEST_DATABASE_URL / TEST_REDIS_URL select a PostgreSQL server and a Redis server; without
them the suite runs on SQLite and an embedded Redis (started by tests/conftest.py).
"""

import os
import secrets
import tempfile

_home = tempfile.mkdtemp(prefix="dartboard-test-")
os.environ["DARTBOARD_HOME"] = _home
os.environ.pop("DARTBOARD_ENV", None)
# The suite runs a dozen torch processes (three xdist workers, inference servers, trainers,
# vLLM) on a few cores, so each gets one thread: a second one finds no idle core to run on.
# Where a process is given more (a pretraining config's `threads`, vLLM), libgomp's threads
# wait passively instead of busy-waiting between parallel regions, which spun away the
# others' time (bench/omp_wait.py and docs/benchmarks.md, *Torch processes sharing two
# cores*). Set before torch loads libgomp, and inherited by every process the tests start.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The master token, and the rollout service's purpose tokens derived from it, in the
# environment so the servers and clients tests start (in this process and in subprocesses)
# agree: a server reads DARTBOARD_INFERENCE_TOKEN and DARTBOARD_ADMIN_TOKEN, a PolicyClient
# sends the first, a RouterAdmin the second (rollout/auth.py).
os.environ["DARTBOARD_SERVICE_TOKEN"] = secrets.token_urlsafe(32)
from rollout.auth import ServiceTokens  # noqa: E402

os.environ.update(ServiceTokens.derived(os.environ["DARTBOARD_SERVICE_TOKEN"]).environ())
for _var, _test_var in (("DATABASE_URL", "TEST_DATABASE_URL"), ("REDIS_URL", "TEST_REDIS_URL")):
    if os.environ.get(_test_var):
        os.environ[_var] = os.environ[_test_var]
    else:
        os.environ.pop(_var, None)
# Under pytest-xdist each worker gets a Redis database of its own on a shared server (its
# Celery queues, leases and channel groups must not meet another worker's); the embedded
# Redis is per worker already (its socket lives in this worker's DARTBOARD_HOME). PostgreSQL
# test databases get pytest-django's per-worker suffix.
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw") and os.environ.get("REDIS_URL"):
    _base, _, _db = os.environ["REDIS_URL"].rpartition("/")
    _first = int(_db) if _db.isdigit() else 0
    os.environ["REDIS_URL"] = f"{_base}/{_first + int(_worker[2:])}"

from dartboard.settings import *  # noqa: E402,F403
from dartboard.settings import DARTBOARD_HOME, DATABASES  # noqa: E402

# Worker processes started by tests must reach the test database: a file, not :memory:.
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"]["TEST"] = {"NAME": str(DARTBOARD_HOME / "test.sqlite3")}

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast logins in tests
