#!/usr/bin/env bash
# The device checks in one go, on a machine with one CUDA GPU: tests/device, then the benchmarks' --device cuda
# rows (one device, so --nproc 1; no DeepSpeed rows where the image lacks it). Logs go to $OUT (default
# ./device-out), each step under its own time limit, so a hang costs one step, not the rest. Wheels in .whl/
# (pydantic and its needs, where the image lacks them; liger_kernel for the fused operators' Liger rows) are
# installed to /tmp/site first. About 4 minutes on an H100 (docs/testing.md). BENCH picks the benchmarks
# (default all: fused fused_large zero_bf16 zero_fp32 one_rank compile). Run from the repository root:
#   bash tests/device/run_on_device.sh          BENCH="fused zero_bf16" bash tests/device/run_on_device.sh
set -u
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ZEROPLUS_ACCELERATOR=${ZEROPLUS_ACCELERATOR:-cuda} DS_ACCELERATOR=${DS_ACCELERATOR:-cuda}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
step() {  # step NAME SECONDS COMMAND...: run under a limit, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T), limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0)) s"
  tail -n "${TAIL:-25}" "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, pydantic; print('torch', torch.__version__, torch.cuda.get_device_name(), 'pydantic', pydantic.VERSION)"
step device_tests "${TESTS_LIMIT:-300}" python3 -m pytest -q -rA tests/device
BENCH=" ${BENCH:-fused fused_large zero_bf16 zero_fp32 one_rank compile} "
cd bench
[[ $BENCH == *" fused "* ]] && step bench_fused_ops "${FUSED_LIMIT:-150}" python3 bench_fused_ops.py --device cuda
# a Llama-8B-like shape, eager kernels only (inductor's compile of each operator at this size takes longer)
[[ $BENCH == *" fused_large "* ]] && step bench_fused_ops_large "${FUSED_LIMIT:-150}" python3 bench_fused_ops.py \
  --device cuda --tokens 16384 --hidden 4096 --ffn 11008 --heads 32 --vocab 128256 --repeats 5 --no-compile
for dtype in bf16 fp32; do  # the engines' single-device memory (glibc's settings do not touch the device allocator)
  [[ $BENCH == *" zero_$dtype "* ]] || continue
  step "bench_zero_$dtype" "${ZERO_LIMIT:-150}" python3 bench_zero.py --device cuda --nproc 1 --memory-only --ledger \
    --frameworks zeroplus,fsdp2 --stages 2,3 --dtype "$dtype" --steps 10 --seq 512
done
# issue 41 item 2 on a GPU: each stage at one rank against the plain module with fused AdamW (and DDP)
[[ $BENCH == *" one_rank "* ]] && step bench_one_rank "${ONE_RANK_LIMIT:-150}" python3 bench_zero.py --device cuda --nproc 1 \
  --memory-only --frameworks plain,ddp,zeroplus --stages 0,1,2,3 --dtype fp32 --steps 12 --seq 512
[[ $BENCH == *" compile "* ]] && step bench_compile "${COMPILE_LIMIT:-100}" python3 bench_compile.py --device cuda --frameworks zeroplus,fsdp2 \
  --stages 3 --steps 8 --time-only --nproc 1
true  # the steps' own codes are in the log; a benchmark left out is not a failure
