#!/bin/bash
# On a GPU machine, from the repository root: make this tree importable as `kiln` under that
# machine's own torch (no install), then run what the arguments say, e.g.
#   bash bench/gpu_run.sh tests                  # the GPU-marked tests (tests/test_cuda_*.py)
#   bash bench/gpu_run.sh check DIR OUT [ROW@VARIANT ...]  # bench/gpu.py check DIR --out OUT --variants ...
#   bash bench/gpu_run.sh real DIR GGUF OUT      # bench/gpu.py real DIR --gguf GGUF --out OUT
#   bash bench/gpu_run.sh profile DIR OUT ROW[@VARIANT]...  # bench/gpu.py profile DIR ROW --out OUT, a process a row
#   bash bench/gpu_run.sh session DIR OUT        # tests, then check with Kiln's Triton decode kernels beside the defaults
#   bash bench/gpu_run.sh kernels OUT [--budget S]  # bench/gpu_kernels.py: Kiln's Triton decode kernels per shape, ~150 s
# Wheels a machine lacks (gguf, for `real`) are installed from .whl/ when it is there.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
package=$(mktemp -d) && mkdir -p "$package/kiln"
for f in "$PWD"/kiln/*; do ln -s "$f" "$package/kiln/"; done
for d in frontend ir passes backends runtime; do ln -s "$PWD/$d" "$package/kiln/$d"; done
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$package:/tmp/site:$PWD/tests:$PWD/bench"
action=$1; shift
case "$action" in
    tests) python3 -P -m pytest -q -p no:cacheprovider tests/test_cuda_decode_attention.py tests/test_cuda_gemv.py tests/test_cuda_inductor.py "$@" ;;
    check) dir=$1; out=$2; shift 2; python3 bench/gpu.py check "$dir" --out "$out" --variants "$@" ;;
    real) python3 bench/gpu.py real "$1" --gguf "$2" --out "$3" ;;
    profile) dir=$1; out=$2; shift 2; rm -f "$dir"/ready.*  # rows compile side by side, then time one at a time
        python3 bench/gpu.py fill "$dir" "$@"
        for row in "$@"; do
            KILN_GPU_JOBS=$# python3 bench/gpu.py profile "$dir" "$row" --out "$out" > "$out.${row//@/_}.log" 2>&1 &
        done
        wait; tail -n 45 "$out".*.log ;;
    session) dir=$1; out=$2  # one device call: the kernels' GPU tests, then speed with and without them
        timeout 240 bash "$0" tests -q -ra > "$out/tests.log" 2>&1; tail -n 25 "$out/tests.log"
        KILN_GPU_GREEDY=0 KILN_GPU_JOB_SECONDS=330 bash "$0" check "$dir" "$out/check.md" \
            smollm2-f16@kiln smollm2-f16@fused llama1b-bf16@kiln llama1b-int8@kiln llama1b-int4@kiln ;;
    kernels) out=$1; shift; mkdir -p "$out"; python3 bench/gpu_kernels.py --out "$out/kernels.md" "$@" ;;
    *) echo "unknown action $action" >&2; exit 2 ;;
esac
