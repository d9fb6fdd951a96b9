# Dartboard's image for docker-compose.yml: Debian bookworm, the apt packages of the Makefile's
# APT_PACKAGES (tests/test_layout.py checks they agree), the pinned lock.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DARTBOARD_HOME=/var/lib/dartboard \
    MINIWOB_CHROME_BINARY=/usr/bin/chromium \
    MINIWOB_CHROMEDRIVER=/usr/bin/chromedriver

RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       chromium chromium-driver xvfb openbox xdotool xterm x11-utils x11-xserver-utils scrot imagemagick \
       python3-tk fonts-dejavu-core bubblewrap postgresql \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY requirements.lock requirements.txt requirements-osworld.txt requirements-sandbox.txt requirements-cuda.txt ./
RUN pip install -r requirements.lock
# A GPU host's agent (docker-compose.yml's `agent`, built with TORCH=cuda): torch's CUDA build
# and its libraries over the lock's CPU torch, as `make torch-cuda` installs them.
ARG TORCH=cpu
ARG TORCH_CUDA_INDEX=https://pypi.org/simple
RUN if [ "$TORCH" = cuda ]; then \
      pip install --force-reinstall --no-deps --index-url "$TORCH_CUDA_INDEX" -r requirements-cuda.txt; \
    elif [ "$TORCH" != cpu ]; then echo "TORCH is cpu or cuda, not $TORCH" >&2; exit 2; fi
# OSWorld's wheel without its pins, and the desktop sandbox's pyautogui (see the Makefile).
RUN pip install --no-deps -r requirements-osworld.txt \
 && pip install --no-deps --target /usr/local/sandbox-site -r requirements-sandbox.txt

COPY . .

# Every service runs as this unprivileged user; its home (DARTBOARD_HOME) is per container.
RUN useradd --create-home --home-dir /var/lib/dartboard --uid 10001 dartboard
USER dartboard
EXPOSE 8000 8100 8101
CMD ["python", "-m", "dartboard.serve", "--host", "0.0.0.0", "--port", "8000"]
