#!/usr/bin/env bash
# The device checks in one go, on a machine with one CUDA GPU: tests/device, then the benchmarks' --device cuda
# rows (one device, so --nproc 1; no DeepSpeed rows where the image lacks it). Logs go to $OUT (default
# ./device-out), each step under its own time limit, so a hang costs one step, not the rest. Wheels in .whl/
# (pydantic and its needs, where the image lacks them; liger_kernel for the fused operators' Liger rows) are
# installed to /tmp/site first. BENCH picks the steps (default: tests one_gpu fused; also fused_large compile one_rank profile);
# the default run took about 9 minutes on one H200 (2026-12-04: the tests 58 s, each one-GPU row 21-27 s, mostly its
# fresh torchrun launch, 16 rows; its steps' limits add up to 11). one_gpu: the one-GPU table (plain module and
# DDP, under torch.autocast in bf16; FSDP2 stages 2-3; zeroplus stages 0-3; GPT 111M x 512; fp32 and bf16; step time
# and peak), its rows written to $OUT/one_gpu_<dtype>.json as each finishes (a step stopped at its limit keeps them)
# and as docs/benchmark.md's table to $OUT/one_gpu.md (bench/device_table.py). With two
# GPUs, tests/device also runs the native-transport parity at every stage on NCCL. Run from the repository root:
#   bash tests/device/run_on_device.sh          BENCH="one_gpu" bash tests/device/run_on_device.sh   (the table alone)
set -u
OUT=${OUT:-device-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # (the benchmarks run from bench/)
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
BENCH=" ${BENCH:-tests one_gpu fused} "
[[ $BENCH == *" tests "* ]] && step device_tests "${TESTS_LIMIT:-150}" python3 -m pytest -q -rA tests/device
for dtype in fp32 bf16; do  # plain, DDP, FSDP2 and zeroplus on one device (the device allocator's peak)
  [[ $BENCH == *" one_gpu "* ]] || continue
  step "one_gpu_$dtype" "${ONE_GPU_LIMIT:-240}" python3 bench/bench_zero.py --device cuda --nproc 1 --memory-only \
    --ledger --json-file "$OUT/one_gpu_$dtype.json" --frameworks plain,ddp,fsdp2,zeroplus --stages 0,1,2,3 \
    --dtype "$dtype" --steps 12 --seq 512
done
if ls "$OUT"/one_gpu_*.json >/dev/null 2>&1; then
  python3 bench/device_table.py "$OUT"/one_gpu_*.json | tee "$OUT/one_gpu.md"
fi
cd bench
[[ $BENCH == *" fused "* ]] && step bench_fused_ops "${FUSED_LIMIT:-90}" python3 bench_fused_ops.py --device cuda
# a Llama-8B-like shape, eager kernels only (inductor's compile of each operator at this size takes longer)
[[ $BENCH == *" fused_large "* ]] && step bench_fused_ops_large "${FUSED_LIMIT:-150}" python3 bench_fused_ops.py \
  --device cuda --tokens 16384 --hidden 4096 --ffn 11008 --heads 32 --vocab 128256 --repeats 5 --no-compile
[[ $BENCH == *" compile "* ]] && step bench_compile "${COMPILE_LIMIT:-100}" python3 bench_compile.py --device cuda --frameworks zeroplus,fsdp2 \
  --stages 3 --steps 8 --time-only --nproc 1
# the one-rank step's host work: each technique left out in turn against the plain module, then the operators' host
# and device time under torch.profiler (docs/benchmark.md, "One GPU")
[[ $BENCH == *" one_rank "* ]] && step bench_one_rank "${ONE_RANK_LIMIT:-150}" python3 bench_one_rank.py --device cuda \
  --n-embd 0 --seq 512 --stage 1
[[ $BENCH == *" profile "* ]] && step bench_step_profile "${PROFILE_LIMIT:-60}" python3 bench_step_profile.py --device cuda
true  # the steps' own codes are in the log; a benchmark left out is not a failure
