#!/usr/bin/env bash
# GPU evidence in one script: the GPU test suite (kernels at real sizes, a tiny model on the GPU backend against
# the cpu backend, graph replay against eager), the cross-compile table for this GPU's arch (what the CPU-only CI
# checks, here next to the real runs), and the kernel benchmark (decode graphs on/off per attention provider).
# Writes everything under OUT (default bench/results/gpu-<date>) and prints a summary table. On a machine without
# a GPU it says so and stops.
#
#   bash bench/gpu_check.sh [OUT]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-bench/results/gpu-$(date +%Y%m%d-%H%M)}}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no GPU visible to torch ($("$PY" -c 'import torch; print(torch.__version__)')): nothing to check here" | tee "$OUT/summary.txt"
    exit 0
fi
"$PY" -m resin.cli backends | tee "$OUT/backends.txt"
nvidia-smi -L 2>/dev/null | tee "$OUT/gpu.txt" || rocm-smi --showproductname 2>/dev/null | tee "$OUT/gpu.txt"

# the GPU suite (marked requires_*) and the interpreted-free kernel tests, compiled for this GPU
"$PY" -m pytest -q -rs tests/gpu tests/test_triton_kernels.py tests/test_triton_mla.py tests/test_triton_model.py tests/test_recurrent_ops.py \
    --junitxml="$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.txt"
tests_rc=${PIPESTATUS[0]}

# registers, spills, shared memory and occupancy of every kernel specialisation, compiled for this arch
ARCH=$("$PY" -c "from resin import hal; print(hal.select_backend('auto', install=False).platform.arch)")
case "$ARCH" in
    gfx942|gfx950|sm_90|sm_100)
        env -u TRITON_INTERPRET "$PY" -m resin.ci kernels --targets "$ARCH" --json "$OUT/kernels-compiled.json" \
            2>&1 | tee "$OUT/kernels-compiled.txt"
        compile_rc=${PIPESTATUS[0]} ;;
    *) echo "$ARCH is not a target of the cross-compile gate (gfx942, gfx950, sm_90, sm_100)" \
           | tee "$OUT/kernels-compiled.txt"; compile_rc=0 ;;
esac

"$PY" bench/gpu_kernels.py --out "$OUT/gpu-kernels.json" 2>&1 | tee "$OUT/gpu-kernels.txt"
bench_rc=${PIPESTATUS[0]}

# tensor parallelism over NCCL/RCCL where there is more than one GPU: TP=2 against TP=1, the server, a dead rank
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -gt 1 ]; then
    "$PY" -m pytest -q -rs -m distributed tests/test_tensor_parallel.py --junitxml="$OUT/tp-tests.xml" 2>&1 \
        | tee "$OUT/tp-tests.txt"
    tp_rc=${PIPESTATUS[0]}
else
    echo "one GPU: tensor parallelism (TP=2) needs two" | tee "$OUT/tp-tests.txt"; tp_rc=0
fi

{ echo "gpu tests: exit $tests_rc ($(tail -1 "$OUT/gpu-tests.txt"))"; echo "cross-compile ($ARCH): exit $compile_rc";
  echo "kernel bench: exit $bench_rc"; echo "tensor parallel ($GPUS GPUs): exit $tp_rc"; } | tee "$OUT/summary.txt"
exit $(( tests_rc != 0 || compile_rc != 0 || bench_rc != 0 || tp_rc != 0 ))
