#!/bin/bash
# On a GPU machine, from the repository root: make this tree importable as `kiln` under that
# machine's own torch (no install), then run what the arguments say, e.g.
#   bash bench/gpu_run.sh tests                  # the GPU-marked tests (the test_cuda_ files, test_tinygrad_gpu.py)
#   bash bench/gpu_run.sh check DIR OUT [ROW@VARIANT ...]  # bench/gpu.py check DIR --out OUT --variants ...
#   bash bench/gpu_run.sh real DIR GGUF OUT      # bench/gpu.py real DIR --gguf GGUF --out OUT
#   bash bench/gpu_run.sh profile DIR OUT ROW[@VARIANT]...  # bench/gpu.py profile DIR ROW --out OUT, a process a row
#   bash bench/gpu_run.sh session DIR OUT        # tests, then check: every speed row (Inductor and tinygrad) against HF
#   bash bench/gpu_run.sh kernels OUT [--budget S]  # bench/gpu_kernels.py: Kiln's Triton decode kernels per shape, ~150 s
# Wheels a machine lacks (gguf for `real`, tinygrad) are installed from .whl/ when it is there;
# tinygrad's CUDA device compiles with the NVRTC that torch's CUDA wheels bring (NVRTC_PATH).
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
package=$(mktemp -d) && mkdir -p "$package/kiln"
for f in "$PWD"/kiln/*; do ln -s "$f" "$package/kiln/"; done
for d in frontend ir passes backends runtime; do ln -s "$PWD/$d" "$package/kiln/$d"; done
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$package:/tmp/site:$PWD/tests:$PWD/bench"
if [ -z "${NVRTC_PATH:-}" ]; then
    nvrtc=$(python3 -c "import glob, os, torch; print(next(iter(sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), '..', 'nvidia', '**', 'libnvrtc.so*'), recursive=True))), ''))" 2>/dev/null)
    if [ -n "$nvrtc" ]; then export NVRTC_PATH="$nvrtc" LD_LIBRARY_PATH="$(dirname "$nvrtc"):${LD_LIBRARY_PATH:-}"; fi
fi
action=$1; shift
case "$action" in
    tests) python3 -P -m pytest -q -p no:cacheprovider tests/test_cuda_decode_attention.py tests/test_cuda_gemv.py \
        tests/test_tinygrad_gpu.py tests/test_cuda_inductor.py "$@" ;;
    check) dir=$1; out=$2; shift 2; python3 bench/gpu.py check "$dir" --out "$out" --variants "$@" ;;
    real) python3 bench/gpu.py real "$1" --gguf "$2" --out "$3" ;;
    profile) dir=$1; out=$2; shift 2; rm -f "$dir"/ready.*  # rows compile side by side, then time one at a time
        python3 bench/gpu.py fill "$dir" "$@"
        for row in "$@"; do
            KILN_GPU_JOBS=$# python3 bench/gpu.py profile "$dir" "$row" --out "$out" > "$out.${row//@/_}.log" 2>&1 &
        done
        wait; tail -n 45 "$out".*.log ;;
    session) dir=$1; out=$2  # one device call: the GPU tests, then every speed row beside Hugging Face
        # the CPU lowering's family tests once (llama: capture on this torch), not for all eleven
        timeout 200 bash "$0" tests -q -ra -k "not gives_hugging_faces_greedy_tokens or llama" > "$out/tests.log" 2>&1
        tail -n 25 "$out/tests.log"
        # greedy against Hugging Face for the families not yet run on a GPU, then every speed row
        KILN_GPU_GREEDY=bloom,mpt,falcon,gemma2,mixtral,olmoe KILN_GPU_JOB_SECONDS=330 \
            bash "$0" check "$dir" "$out/check.md" ;;
    kernels) out=$1; shift; mkdir -p "$out"; python3 bench/gpu_kernels.py --out "$out/kernels.md" "$@" ;;
    *) echo "unknown action $action" >&2; exit 2 ;;
esac
