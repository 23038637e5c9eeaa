# `make run`: set up and run the finetune flow on the embedded defaults (`ftflow run`).  `make test`: set up and test.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup browser run test lint bench stack-up stack-down
setup: $(VENV)/.installed

# torch first (the pinned CPU/CUDA build), then the locked set as is, then ftflow itself. Last,
# DeepSpeed's CPU Adam op (optimizer offload), built here once for this venv (42 s on 2 cores) rather
# than by the first offloaded run; without a compiler that run builds it, or says why it cannot.
$(VENV)/.installed: pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet --no-deps -r requirements.lock
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PY) infra/docker/build_ops.py CPUAdamBuilder >/dev/null 2>&1 || echo "DeepSpeed's CPU Adam not prebuilt: see ftflow doctor"
	touch $@

run: setup
	$(VENV)/bin/ftflow run

# Debian's Chromium, for the test that drives the Prefect UI (tests/test_stack.py): installed when
# missing and this user may (root, as in CI); otherwise that test says what to install.
browser:
	@command -v chromium >/dev/null || [ "$$(id -u)" != 0 ] || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

test: setup browser
	$(PY) -m pytest $(PYTEST_ARGS)

# ruff, configured in pyproject.toml: the lint rules, and the code as its formatter writes it.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The local stack (infra/local/stack.py): Prefect server + UI on 127.0.0.1:4200, a Ray head, and
# the runner serving deployments/ (scheduled retraining, on-demand batch inference).
stack-up: setup
	$(VENV)/bin/ftflow stack up

stack-down:
	$(VENV)/bin/ftflow stack down
