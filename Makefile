# Every target sets up .venv first: `make demo` the package and what it needs to run, `make test` the test extras
# too (pytest, pytest-xdist, peft, torchao, bitsandbytes, gguf, pyarrow, matplotlib, lm_eval). The venv sees the
# system's packages, so an existing (CUDA) torch is used as it is; only where no torch is importable is torch
# 2.13.0 installed.
# Commands outside make: `source .venv/bin/activate` first, or call them as .venv/bin/lightning-oomb, .venv/bin/python.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --progress-bar off

.PHONY: demo test setup

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@echo "== $(VENV): a virtual environment that also sees this system's packages"
	python3 -m venv --system-site-packages $(VENV)
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "== torch $$($(PY) -c 'import torch; print(torch.__version__)') is installed: used as it is"; \
	else \
		echo "== installing torch 2.13.0 (no torch importable)"; \
		$(PIP) torch==2.13.0; \
	fi
	@echo "== installing lightning_oomb (editable) and its dependencies: lightning, transformers, torchmetrics, tensorboard, jsonargparse"
	$(PIP) -e .
	touch $@

$(VENV)/.dev: $(VENV)/.installed
	@echo "== installing the test extras: pytest, pytest-xdist, peft, torchao, bitsandbytes, gguf, pyarrow, datasets, matplotlib, lm_eval"
	$(PIP) -e ".[dev]"
	touch $@

demo: setup
	$(PY) -m lightning_oomb.cli fit --config examples/passkey_cpu.yaml

# The tests in two worker processes (pytest-xdist), each with its share of the cores (tests/conftest.py): the
# interpreted kernels and the programs the tests start use one core each, so two workers finish in about 60% of
# the time one takes on 2 cores.
test: $(VENV)/.dev
	$(PY) -m pytest -q -x -n 2 --dist worksteal
