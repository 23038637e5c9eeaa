# `make run`: set up and run the finetune flow on the embedded defaults.  `make test`: set up and test.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
export RAY_AUTH_MODE ?= disabled
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup run test bench
setup: $(VENV)/.installed

# torch first (the pinned CPU/CUDA build), then the locked set as is, then ftflow itself.
$(VENV)/.installed: pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet --no-deps -r requirements.lock
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

run: setup
	$(PY) -m flows.finetune

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)
