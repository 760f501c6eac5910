# Every target sets up .venv first. The venv sees the system's packages, so an existing (CUDA) torch is
# used as it is; only where no torch is importable is torch 2.13.0 installed.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test setup

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: setup
	$(PY) -m lightning_oomb.cli fit --config examples/passkey_cpu.yaml

test: setup
	$(PY) -m pytest -q -x
