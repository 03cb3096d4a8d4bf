#!/usr/bin/env bash
# Issue 37's GPU runs, in two calls of under 10 minutes each (the device machine's limit per command); run from the
# project root on one H100 80GB or H200 with $OUT set to a folder for the outputs (default: bench/results/run).
#   bash bench/device_runs_issue37.sh A   # GPU tests of the capture fixes and the memory plan; e2e default 1280×704
#                                         # (40 steps); forward profile by op category (~7 min)
#   bash bench/device_runs_issue37.sh B   # e2e default 768×512; e2e compiled (4 stage-1 steps, scaled); e2e fp8
#                                         # (10 stage-1 steps); the diffusion decoder under --auto-free 30 at
#                                         # 1280×704 and 1920×1088 (~10 min)
# Wheels the machine lacks (diffusers, comfy-kitchen) may lie in .whl/ (installed to /tmp/site) and an unpacked
# comfy-kitchen in .kitchen/; both are optional.
set -u
OUT=${OUT:-bench/results/run}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:$PWD/.kitchen:${PYTHONPATH:-} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, diffusers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'diffusers', diffusers.__version__)"
  python3 -c "import comfy_kitchen; print('comfy_kitchen imports')"; } > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
e2e() {  # name, timeout, bench_e2e arguments
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 bench/bench_e2e.py --blocks 48 "$@" --out "$OUT/e2e_$name.txt" > "$OUT/e2e_${name}_log.txt" 2>&1
  echo "== e2e $name: exit $?"; tail -25 "$OUT/e2e_${name}_log.txt"
}
case "${1:-A}" in
A)
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda_graphs.py tests/test_job_memory.py \
    > "$OUT/gpu_tests.txt" 2>&1
  echo "== gpu tests: exit $?"; tail -30 "$OUT/gpu_tests.txt"
  e2e default_1280 170 --modes default
  timeout 75 python3 bench/profile_forward.py --blocks 8 --size 1280x704 --no-reference --attention --top 12 \
    > "$OUT/profile_forward_1280x704.txt" 2>&1
  echo "== profile: exit $?"; tail -40 "$OUT/profile_forward_1280x704.txt" ;;
B)
  e2e default_768 100 --modes default --width 768 --height 512
  TORCH_LOGS=recompiles e2e compiled_1280 150 --modes compiled --stage1-steps 4
  e2e fp8_1280 150 --modes fp8 --stage1-steps 10
  timeout 150 python3 bench/bench_diffusion_decode.py --auto-free 30 --sizes 1280x704x121,1920x1088x121 \
    > "$OUT/diffusion_decode_autofree30.txt" 2>&1
  echo "== diffusion decode: exit $?"; tail -20 "$OUT/diffusion_decode_autofree30.txt" ;;
*) echo "usage: $0 A|B" >&2; exit 2 ;;
esac
