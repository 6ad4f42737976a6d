# Two entry points for a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU wheel of torch lies on these machines' disk; install it before transformers so that
# nothing pulls a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: run test venv lint bench clean chromium

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed-run: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[dev,census]'
	touch $@

run: $(VENV)/.installed-run
	$(BIN)/ndplan models
	$(BIN)/ndplan estimate --model llama-3.1-70b --hardware h100-sxm --devices 64 --tp 8 --pp 4 --sp \
		--zero 1 --gbs 256 --seq 4096 --recompute selective

lint: $(VENV)/.installed-test
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

# The report test opens the HTML in headless Chromium (Debian's package).
chromium:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

test: $(VENV)/.installed-test lint chromium
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) build dist src/*.egg-info
