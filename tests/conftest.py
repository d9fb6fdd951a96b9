"""Shared fixtures: the Redis the suite uses, personas, and subprocess environments."""

from __future__ import annotations

import gc
import os
import shutil
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings

from hostagent.embedded_redis import EmbeddedRedis
from tests.helpers import NEEDS, needs

HEAVY_MARKERS = {"slow", *NEEDS}  # what `make test-fast` leaves out


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--unmarked-budget",
        type=float,
        default=None,
        help="fail the session when a test with none of the markers "
        f"{sorted(HEAVY_MARKERS)} takes longer than this many seconds (make test-fast)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test gets the markers its fixtures `need` (tests/helpers.py), through every
    fixture it uses directly or indirectly: a new test on a live fixture is marked live."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        kinds: set[str] = set()
        for defs in info.name2fixturedefs.values():
            for fixturedef in defs:
                kinds |= getattr(fixturedef.func, "dartboard_needs", frozenset())
        for kind in sorted(kinds):
            item.add_marker(kind)
    module_rank: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        module_rank[module] = min(module_rank.get(module, len(HEAVY_FIRST)), _heaviness(item))
    items.sort(key=lambda item: module_rank[item.nodeid.split("::")[0]])


# Modules heaviest first (by their heaviest test: `slow`, then live stacks, then browsers and
# desktops, then the rest; a stable sort, so pytest-django's database order holds within
# each). `make test` hands each xdist worker a whole module at a time (`--dist loadscope`,
# so a module's stack or vLLM server starts once) in this order: the minute-long live
# modules start first, and the run ends on short modules on every worker rather than one
# long test on one.
HEAVY_FIRST = ("slow", "live", "browser", "desktop")


def _heaviness(item: pytest.Item) -> int:
    for rank, marker in enumerate(HEAVY_FIRST):
        if item.get_closest_marker(marker):
            return rank
    return len(HEAVY_FIRST)


_over_budget: list[str] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """With --unmarked-budget: note a test without a heavy marker whose setup or call took
    longer than the budget (it belongs out of the fast path: mark it, or use a fixture that
    needs what it starts)."""
    yield
    budget = item.config.getoption("--unmarked-budget")
    if budget is None or call.when not in ("setup", "call") or call.duration <= budget:
        return
    if not any(item.get_closest_marker(m) for m in HEAVY_MARKERS):
        _over_budget.append(f"{item.nodeid} ({call.when} {call.duration:.1f} s)")


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _over_budget and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config: pytest.Config) -> None:
    """Freeze the heap at the end (controller and xdist workers): the collection pytest runs
    next and the interpreter's at exit then skip the objects of every module imported (torch,
    transformers, the tests'), which took each such pytest process seconds to minutes of CPU
    after its last test on 2 cores."""
    gc.freeze()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _over_budget:
        terminalreporter.section("unmarked slow tests")
        budget = terminalreporter.config.getoption("--unmarked-budget")
        terminalreporter.write_line(
            f"{len(_over_budget)} test(s) with none of the markers {sorted(HEAVY_MARKERS)} "
            f"took longer than {budget:g} s: mark them, or give them a fixture that "
            "`needs` what they start (tests/helpers.py):"
        )
        for line in _over_budget:
            terminalreporter.write_line(f"  {line}")


@pytest.fixture(scope="session", autouse=True)
def redis_server() -> Iterator[str]:
    """The embedded Redis (default) or the server named by TEST_REDIS_URL."""
    if not settings.REDIS_EMBEDDED:
        yield settings.REDIS_URL
        return
    with EmbeddedRedis(settings.REDIS_SOCKET) as redis:
        yield redis.url


@pytest.fixture(scope="session", autouse=True)
def _tests_checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The checkpoints tests build live under the session's temporary directory, which the
    tests count as a checkpoint root (a deployment's are DARTBOARD_CHECKPOINT_ROOTS): run
    create refuses a policy outside the roots."""
    settings.DARTBOARD_CHECKPOINT_ROOTS.append(str(tmp_path_factory.getbasetemp()))


@pytest.fixture(scope="session", autouse=True)
def _clean_home() -> Iterator[None]:
    yield
    shutil.rmtree(settings.DARTBOARD_HOME, ignore_errors=True)


def _clear_live_work_keys() -> None:
    from datamanager.live_work import redis_client

    client = redis_client()
    try:
        for pattern in (
            "dartboard:slot-lease:*",
            "dartboard:trainer-lease:*",
            "dartboard:eval-lease:*",
        ):
            for key in client.scan_iter(pattern):
                client.delete(key)
    finally:
        client.close()


@pytest.fixture(autouse=True)
def _process_state_restored(request: pytest.FixtureRequest) -> Iterator[None]:
    """What a test leaves in this process is put back after it, so the next test on the same
    xdist worker starts clean: torch's thread count, the slot worker's cached envs, the
    trainers and metric writers held per run; and, outside the live tests (whose stacks hold
    them for the whole module), the env slot and trainer leases in Redis."""
    import torch  # imported once per worker; nearly every test loads it anyway

    threads = torch.get_num_threads()
    yield
    if "workers.env_cache" in sys.modules:
        sys.modules["workers.env_cache"].env_cache_reset()
    if "workers.training_loop" in sys.modules:
        sys.modules["workers.training_loop"].trainers_forget_all()
    if "workers.exports" in sys.modules:
        sys.modules["workers.exports"].exports_close_all()
    torch.set_num_threads(threads)
    _no_event_loop_left(request.node.nodeid)
    if request.node.get_closest_marker("django_db") and not request.node.get_closest_marker("live"):
        _clear_live_work_keys()


def _no_event_loop_left(nodeid: str) -> None:
    """A test (or a fixture it started) that leaves an asyncio loop running on the test
    thread makes every later database test on this xdist worker fail with Django's
    SynchronousOnlyOperation, far from the cause. Playwright's sync API does this while it
    is started: run it on a thread of its own (envmanager/threaded.py) or stop it."""
    import asyncio

    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    pytest.fail(
        f"{nodeid} left an asyncio loop running on the test thread ({loop!r}): a Playwright "
        "sync API started here and not stopped? Run it on its own thread "
        "(envmanager.threaded.ThreadedEnv) or stop it before the test ends."
    )


@pytest.fixture
def live_work_keys_cleared() -> Iterator[None]:
    """Delete env slot and trainer leases and their watchdog markers, before the test and
    after it: a Redis server outlives the test database, so a run with the same id (SQLite
    reuses ids after a rollback) would find keys that read as a live or pending worker."""
    _clear_live_work_keys()
    yield
    _clear_live_work_keys()


def user_in_role(django_user_model, name: str, role: str, *, password: str = "") -> Any:
    from datamanager.roles import role_group

    user = django_user_model.objects.create_user(name, password=password or f"{name}-pass-123")
    user.groups.add(role_group(role))
    return user


@pytest.fixture
def researcher(django_user_model):
    """Ada, an RL researcher with the operator role: runs and curates."""
    return user_in_role(django_user_model, "ada", "operator", password="lovelace-pass-1")


@pytest.fixture
def ada_client(client, researcher):
    client.force_login(researcher)
    return client


@pytest.fixture
def grace_client(django_user_model):
    """Grace, the lab's admin (policy paths, desktop slots, reward overrides)."""
    from django.test import Client

    client = Client()
    client.force_login(user_in_role(django_user_model, "grace", "admin"))
    return client


@pytest.fixture
def viewer_client(django_user_model):
    """Victor, who may look at everything and change nothing."""
    from django.test import Client

    client = Client()
    client.force_login(user_in_role(django_user_model, "victor", "viewer"))
    return client


@pytest.fixture
@needs("live")
def subprocess_env(transactional_db) -> dict[str, str]:
    """Environment for worker processes a test starts: same home, test DB, same Redis."""
    return subprocess_environ()


def subprocess_environ() -> dict[str, str]:
    """`subprocess_env`'s environment, for a fixture that outlives one test (the test
    database must be set up: `django_db_setup`)."""
    from django.db import connection

    env = dict(os.environ)
    env["DJANGO_SETTINGS_MODULE"] = "dartboard.settings"
    env["DARTBOARD_HOME"] = str(settings.DARTBOARD_HOME)
    s = connection.settings_dict
    if s["ENGINE"] == "django.db.backends.sqlite3":
        env["DATABASE_URL"] = f"sqlite:///{s['NAME']}"
    else:
        user = s["USER"] or ""
        auth = f"{user}:{s['PASSWORD']}@" if s["PASSWORD"] else (f"{user}@" if user else "")
        env["DATABASE_URL"] = (
            f"postgres://{auth}{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"
        )
    if settings.REDIS_EMBEDDED:
        env.pop("REDIS_URL", None)
    else:
        env["REDIS_URL"] = settings.REDIS_URL
    return env


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory):
    """The untrained tiny Qwen3-VL policy, built once per test session."""
    from training.tiny_policy import build_tiny_policy

    return build_tiny_policy(tmp_path_factory.mktemp("policies") / "untrained")


def png_bytes(
    width: int = 160, height: int = 210, color: tuple[int, int, int] = (250, 250, 250)
) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="session")
@needs("live")
def s3_server():
    """moto's S3 server on 127.0.0.1 (a real S3 API), with a bucket `dartboard`; stopped at
    the end of the session."""
    from tests.private_services import PrivateS3

    server = PrivateS3()
    server.start()
    server.client().create_bucket(Bucket="dartboard")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_artifacts(s3_server, monkeypatch) -> str:
    """This process and the ones it starts reach the S3 server; returns the store URL."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return "s3://dartboard/artifacts"


@pytest.fixture(scope="session")
@needs("desktop", "live")
def osworld_desktop() -> Iterator[Any]:
    """One Dartboard desktop serving OSWorld's protocol for the session (tests/osworld_desktop.py),
    with the token the workers derive for its address from the test settings' master."""
    from rollout.auth import desktop_purpose, purpose_token
    from tests.helpers import free_port
    from tests.osworld_desktop import desktop_server

    port = free_port()
    token = purpose_token(settings.DARTBOARD_SERVICE_TOKEN, desktop_purpose(f"127.0.0.1:{port}"))
    with desktop_server(token=token, port=port) as server:
        yield server
