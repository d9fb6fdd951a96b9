"""Django settings, read from the environment. Each bad value fails with the fix in its message.

Variables: DARTBOARD_HOME, DATABASE_URL, REDIS_URL, SECRET_KEY, DARTBOARD_ENV, ALLOWED_HOSTS,
DARTBOARD_S3_BUCKET (+ AWS_S3_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY),
DARTBOARD_DEBUG, DARTBOARD_LEASE_TTL_S, DARTBOARD_WATCHDOG_PERIOD_S, DARTBOARD_WATCHDOG_GRACE_S,
DARTBOARD_DB_RETRY_S, DARTBOARD_REDIS_RETRY_S, DARTBOARD_ARTIFACTS, DARTBOARD_ARTIFACT_CACHE,
DARTBOARD_WEIGHT_SERVER,
DARTBOARD_WANDB_PROJECT (+ W&B's own WANDB_MODE, WANDB_DIR, WANDB_API_KEY, WANDB_ENTITY),
DARTBOARD_MLFLOW_TRACKING_URI, DARTBOARD_MLFLOW_EXPERIMENT.
See docs/configuration.md.
"""

from __future__ import annotations

import os
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from core.artifacts import s3_client_config, s3_transfer_config
from dartboard import config_env

try:
    DARTBOARD_HOME = config_env.dartboard_home()
    PRODUCTION = os.environ.get("DARTBOARD_ENV", "local").strip().lower() == "production"
    if os.environ.get("DARTBOARD_ENV", "local").strip().lower() not in ("local", "production", ""):
        raise config_env.SettingsError(
            f"DARTBOARD_ENV={os.environ['DARTBOARD_ENV']!r}: use 'local' (default) or 'production'."
        )
    SECRET_KEY = config_env.secret_key(DARTBOARD_HOME, production=PRODUCTION)
    DEBUG = config_env.env_bool("DARTBOARD_DEBUG", default=False)
    ALLOWED_HOSTS = config_env.env_list("ALLOWED_HOSTS")
    if PRODUCTION and not ALLOWED_HOSTS:
        raise config_env.SettingsError(
            "DARTBOARD_ENV=production needs ALLOWED_HOSTS, e.g. ALLOWED_HOSTS=dartboard.example.org."
        )
    if not ALLOWED_HOSTS:
        ALLOWED_HOSTS = ["127.0.0.1", "localhost", "[::1]", "testserver"]
    REDIS_URL, REDIS_EMBEDDED = config_env.redis_url(DARTBOARD_HOME)
    _redis_db = config_env.redis_db(REDIS_URL)
    _database_url = config_env.database_url(DARTBOARD_HOME)
    _lease_ttl_s = config_env.env_seconds("DARTBOARD_LEASE_TTL_S", 30.0)
    _watchdog_period_s = config_env.env_seconds("DARTBOARD_WATCHDOG_PERIOD_S", 10.0)
    _watchdog_grace_s = config_env.env_seconds("DARTBOARD_WATCHDOG_GRACE_S", 20.0)
    _db_retry_s = config_env.env_seconds("DARTBOARD_DB_RETRY_S", 90.0)
    _redis_retry_s = config_env.env_seconds("DARTBOARD_REDIS_RETRY_S", 60.0)
    DARTBOARD_ARTIFACTS = config_env.artifacts_url(DARTBOARD_HOME)
    _mlflow_tracking_uri = config_env.mlflow_tracking_uri()
except config_env.SettingsError as exc:
    raise ImproperlyConfigured(str(exc)) from None

BASE_DIR = Path(__file__).resolve().parent.parent
REDIS_SOCKET = config_env.embedded_redis_socket(DARTBOARD_HOME)
MEDIA_ROOT = DARTBOARD_HOME / "media"
CHECKPOINT_ROOT = DARTBOARD_HOME / "checkpoints"
LOG_ROOT = DARTBOARD_HOME / "logs"
# The files OSWorld tasks fetch by URL (envmanager.osworld_file_cache; manage.py osworld_cache).
OSWORLD_FILE_CACHE = DARTBOARD_HOME / "osworld-files"

try:
    DATABASES = {"default": dj_database_url.parse(_database_url, conn_max_age=60)}
except Exception as exc:  # dj_database_url raises several types for a malformed URL
    raise ImproperlyConfigured(
        f"DATABASE_URL could not be parsed ({exc}). Use postgres://USER:PASSWORD@HOST:5432/NAME."
    ) from None
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Several worker processes write at once: wait for the lock instead of failing at once,
    # and let readers proceed while one writer writes (WAL).
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 30,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    DATABASES["default"]["CONN_MAX_AGE"] = 0
# A persistent connection is checked before a request (or a worker loop's iteration) reuses
# it, so a restarted PostgreSQL costs one reconnect, not one failed request per process.
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
# Workers retry transient database errors (a restart, a lock) this long before the write
# they were making fails with the reason (workers/dbutil.py).
DARTBOARD_DB_RETRY_S = _db_retry_s

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "rest_framework",
    "drf_spectacular",
    "datamanager",
    "workers",
    "dartboard",
    "hostagent",
]

MIDDLEWARE = [
    # Outermost: a database outage becomes a 503 saying so (dartboard/outage.py).
    "dartboard.outage.DatabaseOutageMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # Every page and API needs a login; views opt out with @login_not_required.
    "django.contrib.auth.middleware.LoginRequiredMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "dartboard.urls"
ASGI_APPLICATION = "dartboard.asgi.application"
WSGI_APPLICATION = None
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = DARTBOARD_HOME / "static"
MEDIA_URL = "/media/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Media (screenshots, checkpoints): the filesystem under DARTBOARD_HOME, or S3-compatible
# object storage so workers on other machines share files without a shared filesystem.
S3_BUCKET = os.environ.get("DARTBOARD_S3_BUCKET", "").strip()
if S3_BUCKET:
    _default_storage = {
        "BACKEND": "storages.backends.s3.S3Storage",
        "OPTIONS": {
            "bucket_name": S3_BUCKET,
            "endpoint_url": os.environ.get("AWS_S3_ENDPOINT_URL") or None,
            "default_acl": None,
            "querystring_auth": True,
            "client_config": s3_client_config(),
            "transfer_config": s3_transfer_config(),
        },
    }
else:
    _default_storage = {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(MEDIA_ROOT), "base_url": MEDIA_URL},
    }
STORAGES = {
    "default": _default_storage,
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
}

# Redis carries the Celery broker and results and the Channels layer in every mode.
CELERY_BROKER_URL = config_env.celery_url(REDIS_URL)
CELERY_RESULT_BACKEND = config_env.celery_url(REDIS_URL)
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
# A task is acknowledged when it ends. A worker that stops cleanly hands its task back; one
# that is killed leaves it unacknowledged until the visibility timeout (an hour), so live
# work is also guarded by leases and the watchdog below.
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# Redis restarts: workers and beat reconnect by themselves, for as long as it takes (the
# launcher restarts an embedded Redis; a server comes back when its operator starts it).
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_CONNECTION_RETRY = True
CELERY_BROKER_CONNECTION_MAX_RETRIES = None
# A running slot or trainer task goes on through a broker outage (its work is guarded by its
# lease); cancelling it would only lose the episode under way.
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = False
CELERY_REDIS_BACKEND_HEALTH_CHECK_INTERVAL = 10
CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS = {"retry_policy": {"timeout": 5.0}}
CELERY_TASK_DEFAULT_QUEUE = "default"
CELERY_TASK_ROUTES = {
    "workers.tasks.slot_serve": {"queue": "env"},
    "workers.tasks.episode_once": {"queue": "env"},
    "workers.tasks.eval_shard": {"queue": "env"},
    "workers.tasks.train_run": {"queue": "train"},
    "workers.tasks.sync_run": {"queue": "train"},
}
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": 3600,
    "socket_connect_timeout": 3,
    "socket_timeout": 30,
    "retry_on_timeout": True,
    "health_check_interval": 10,
}

# Liveness (workers/leases.py, workers/watchdog.py): every env slot and every run's
# trainer holds a Redis lease renewed by its worker. The watchdog (a Celery beat task,
# `celery -A dartboard beat`) re-enqueues the task of a lease that has lapsed for GRACE
# seconds: its worker died (a SIGKILLed worker's own task would only come back after the
# broker's visibility timeout).
DARTBOARD_LEASE_TTL_S = _lease_ttl_s
DARTBOARD_WATCHDOG_PERIOD_S = _watchdog_period_s
DARTBOARD_WATCHDOG_GRACE_S = _watchdog_grace_s
# How long a worker keeps trying Redis before an enqueue or a lease take fails (the watchdog
# brings that work back once Redis is up again).
DARTBOARD_REDIS_RETRY_S = _redis_retry_s
CELERY_BEAT_SCHEDULE = {
    "runs-watchdog": {
        "task": "workers.tasks.runs_watchdog",
        "schedule": DARTBOARD_WATCHDOG_PERIOD_S,
        # A pass that could not start before the next is due is dropped, not queued up.
        "options": {"queue": "default", "expires": DARTBOARD_WATCHDOG_PERIOD_S},
    },
    # A sweep's next member starts as the previous one ends (datamanager/services/sweeps.py).
    "sweeps-advance": {
        "task": "workers.tasks.sweeps_advance",
        "schedule": DARTBOARD_WATCHDOG_PERIOD_S,
        "options": {"queue": "default", "expires": DARTBOARD_WATCHDOG_PERIOD_S},
    },
}

# Publish/subscribe: a web process subscribes once to each group its sockets joined and Redis
# pushes each event to it, so a watching browser costs no Redis command, where the list-based
# `RedisChannelLayer` spent four or five on every event it delivered to every socket (BZPOPMIN,
# ZADD, ZPOPMIN and an EVAL on the socket's side, a ZADD into its channel on the writer's).
# Nothing is queued in Redis for a socket that is gone or slow; events are live-view hints and
# each socket coalesces its own (dartboard/consumers.py). Publish/subscribe channels span the
# server's databases, so the prefix carries the database number: two deployments (or two
# test workers) on one server with different databases do not hear each other.
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer",
        "CONFIG": {
            "hosts": [{"address": REDIS_URL}],
            "prefix": f"dartboard-db{_redis_db}",
        },
    }
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("DARTBOARD_LOG_LEVEL", "INFO")},
    "loggers": {"django.db.backends": {"level": "WARNING"}},
}

if PRODUCTION:
    SESSION_COOKIE_SECURE = config_env.env_bool("DARTBOARD_SECURE_COOKIES", default=True)
    CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE
# Behind a TLS-terminating proxy (docs/security.md): the proxy sets X-Forwarded-Proto,
# the browser's origin is trusted for CSRF, and HSTS tells browsers to stay on https.
DARTBOARD_TLS_PROXY = config_env.env_bool("DARTBOARD_TLS_PROXY", default=False)
if DARTBOARD_TLS_PROXY:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = True
    SECURE_REDIRECT_EXEMPT = [r"^health/$"]  # the orchestrator's probe speaks plain http
CSRF_TRUSTED_ORIGINS = config_env.env_list("CSRF_TRUSTED_ORIGINS")
SECURE_HSTS_SECONDS = int(config_env.env_seconds("DARTBOARD_HSTS_SECONDS", 0))
SECURE_HSTS_INCLUDE_SUBDOMAINS = False
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"

# Flower (the Celery monitor), which the web serves to admins at /flower/ (dartboard/flower.py).
DARTBOARD_FLOWER_URL = os.environ.get("DARTBOARD_FLOWER_URL") or "http://127.0.0.1:5555"
# The rollout service: the router (or inference workers) env slots send requests to. Image
# bounds are not settings: they come from the policy's processor (core/imaging.py).
DARTBOARD_INFERENCE_URLS = config_env.env_list("DARTBOARD_INFERENCE_URLS") or [
    "http://127.0.0.1:8100"
]
# Who starts a run's processes: "per-run" (a host agent, hostagent/agent.py, starts each
# run's inference workers, router, trainer and env workers when it starts, and stops them
# when it stops; what `make run` does), "shared" (every run uses the rollout service at
# DARTBOARD_INFERENCE_URLS and the shared Celery queues, started by whoever deploys them), or
# "auto": per-run while a host agent is alive (reported in the last minute), else shared.
DARTBOARD_PROCESSES = config_env.env_choice(
    "DARTBOARD_PROCESSES", ("auto", "shared", "per-run"), "auto"
)
# CPU inference workers a host agent runs at once on a host without GPUs (runs past it wait).
DARTBOARD_CPU_INFERENCE_SLOTS = config_env.env_int("DARTBOARD_CPU_INFERENCE_SLOTS", 2)
# CPU trainer replicas a host agent takes at once, across runs (unset: any); a run whose
# replicas do not fit one host spreads them over several (hostagent/cluster.py).
DARTBOARD_CPU_TRAINER_SLOTS = config_env.env_optional_int("DARTBOARD_CPU_TRAINER_SLOTS")
# Env workers a host agent runs at once, across runs (unset: any).
DARTBOARD_ENV_SLOTS = config_env.env_optional_int("DARTBOARD_ENV_SLOTS")
# The env kinds a host agent offers, of those it can run (unset: all it can; "none": none,
# a host kept for training and inference).
DARTBOARD_ENV_KINDS = config_env.env_kinds("DARTBOARD_ENV_KINDS")
# Where this host's runs' routers and inference workers listen, and what its agent reports:
# the host's address on the cluster's private network when runs span hosts.
DARTBOARD_HOST_ADDRESS = os.environ.get("DARTBOARD_HOST_ADDRESS", "").strip() or "127.0.0.1"
# A run fails when one of its processes failed at start this many times in a row.
DARTBOARD_START_FAILURES = config_env.env_int("DARTBOARD_START_FAILURES", 5)
# The master secret, held by the web and the workers only; each other process gets the token
# of its purpose, derived from it (rollout/auth.py): the env slots' inference token, the
# trainer's router-admin token, one token per desktop. The rollout service loads weights only
# from these roots.
DARTBOARD_SERVICE_TOKEN = config_env.service_token(DARTBOARD_HOME, production=PRODUCTION)
try:
    DARTBOARD_INFERENCE_TOKEN = config_env.purpose_setting(
        name="DARTBOARD_INFERENCE_TOKEN",
        purpose="inference",
        master=DARTBOARD_SERVICE_TOKEN,
        production=PRODUCTION,
    )
    DARTBOARD_ADMIN_TOKEN = config_env.purpose_setting(
        name="DARTBOARD_ADMIN_TOKEN",
        purpose="router-admin",
        master=DARTBOARD_SERVICE_TOKEN,
        production=PRODUCTION,
    )
except config_env.SettingsError as exc:
    raise ImproperlyConfigured(str(exc)) from None
# Published versions go to the artifact store (core/artifacts.py) and are fetched by reference,
# checksums verified, into each host's cache: no host reads another's disk.
DARTBOARD_ARTIFACT_CACHE = Path(
    os.environ.get("DARTBOARD_ARTIFACT_CACHE") or DARTBOARD_HOME / "artifact-cache"
)
# The address the trainer's weight server listens on, which inference workers pull new
# versions from over torch.distributed (training/weight_server.py): the trainer host's, as
# the inference hosts reach it (by default its cluster address, DARTBOARD_HOST_ADDRESS).
# "off": workers load every version from its checkpoint.
DARTBOARD_WEIGHT_SERVER = (
    os.environ.get("DARTBOARD_WEIGHT_SERVER") or DARTBOARD_HOST_ADDRESS
).strip()
if DARTBOARD_WEIGHT_SERVER == "off":
    DARTBOARD_WEIGHT_SERVER = ""
DARTBOARD_CHECKPOINT_ROOTS = [
    str(CHECKPOINT_ROOT),
    str(BASE_DIR / "policies"),
    str(DARTBOARD_HOME / "policies"),
    *[r for r in os.environ.get("DARTBOARD_CHECKPOINT_ROOTS", "").split(os.pathsep) if r],
]

# Benchmarks: emulate slow (OSWorld-like) environments; see envmanager/latency.py.
DARTBOARD_ENV_LATENCY = os.environ.get("DARTBOARD_ENV_LATENCY", "off")
DARTBOARD_ENV_LATENCY_SCALE = float(os.environ.get("DARTBOARD_ENV_LATENCY_SCALE", "1"))

# Experiment trackers (workers/exports.py): when set, every trainer update's scalars also go
# to this W&B project (W&B reads its own WANDB_* variables: WANDB_MODE=offline needs no
# network) and to this MLflow tracking server or store, besides TensorBoard.
DARTBOARD_WANDB_PROJECT = os.environ.get("DARTBOARD_WANDB_PROJECT", "").strip()
DARTBOARD_MLFLOW_TRACKING_URI = _mlflow_tracking_uri
DARTBOARD_MLFLOW_EXPERIMENT = (
    os.environ.get("DARTBOARD_MLFLOW_EXPERIMENT", "").strip() or "dartboard"
)

# CPU threads of each torch process started by the launcher's workers (trainer).
DARTBOARD_TORCH_THREADS = int(os.environ.get("DARTBOARD_TORCH_THREADS", "1"))

# The REST API (dartboard/api/): bearer tokens from the account page or the browser's own
# session (with CSRF), the dashboard's roles, JSON errors, the OpenAPI schema at
# /api/v1/schema/. Writes are limited per token (per user for a session) to
# DARTBOARD_API_WRITES_PER_MINUTE, counted in Django's cache.
DARTBOARD_API_WRITES_PER_MINUTE = config_env.env_int("DARTBOARD_API_WRITES_PER_MINUTE", 60)
# Tokens whose writes are not limited, by key id (`dbt_<key id>_...`, comma-separated):
# none unless named, for a script that must write faster (a bulk import, the schema's fuzz
# test). Read per request, so a test names its token with pytest-django's `settings`.
DARTBOARD_API_UNLIMITED_TOKENS = config_env.env_list("DARTBOARD_API_UNLIMITED_TOKENS")
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "dartboard.api.auth.BearerTokenAuthentication",
        "dartboard.api.auth.SessionWithCsrfAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["dartboard.api.auth.RolePermission"],
    "DEFAULT_THROTTLE_CLASSES": ["dartboard.api.auth.WriteThrottle"],
    "DEFAULT_THROTTLE_RATES": {"writes": f"{DARTBOARD_API_WRITES_PER_MINUTE}/min"},
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": [
        "rest_framework.parsers.JSONParser",
        "dartboard.api.errors.YamlParser",
    ],
    "EXCEPTION_HANDLER": "dartboard.api.errors.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Dartboard API",
    "DESCRIPTION": (
        "Runs, sweeps, metrics, trajectories, tasks, evaluations and hosts of a Dartboard "
        "server, on the dashboard's rules and roles. Send a token from your account page as "
        "`Authorization: Bearer dbt_...`. Errors are JSON: `code`, `message`, `field` and "
        "every problem in `errors`."
    ),
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    "SCHEMA_PATH_PREFIX": "/api/v1",
    # One name per status set in the generated clients (the models' own choices).
    "ENUM_NAME_OVERRIDES": {
        "RunStatusEnum": "datamanager.models.RunStatus",
        "TrajectoryStatusEnum": "datamanager.models.TrajectoryStatus",
        "EvalStatusEnum": "datamanager.models.EvalStatus",
        "SlotStatusEnum": "datamanager.models.SlotStatus",
        "PlacementStateEnum": "datamanager.models.PlacementState",
        "EnvKindEnum": "datamanager.models.EnvKind",
        "PurposeEnum": "datamanager.models.Purpose",
    },
    # The database's integer ranges (32-bit on PostgreSQL, 64-bit on SQLite) left out: the
    # schema is the same whichever database serves it (dartboard/api/schemas.py).
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "dartboard.api.schemas.without_database_ranges",
    ],
}
