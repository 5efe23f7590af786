#!/usr/bin/env bash
# The decode work's checks on a CUDA machine, stage by stage, each under its own limit, in about
# 8 minutes on one H100/H200 (issue 49). Run from the repository root, grpo-core installed:
#
#     bash benchmarks/gpu_check.sh [OUT_DIR]      # OUT_DIR defaults to $OUT, else benchmarks/.cache/gpu-check
#
# 1. pytest -m cuda: every CUDA path against its eager reference (~2-3 min, compiles included);
# 2. benchmarks/decode.py at the Qwen3-0.6B shape, B=64: ms per decode step of transformers' forward,
#    the bf16 fused decoder, the eager whole step and the compiled one, graphed and not, kernels per
#    step, and the sampler alone (draw against the one-pass sampler) (~1-2 min);
# 3. benchmarks/gpu.py, grpo-core at 0.6B on the short and unforced workloads with --profile: ms per
#    decode step as a run sees it and a kernel table per phase (decode and training step) (~3-4 min).
# Each stage's output goes to OUT_DIR/<stage>.txt; a stage that fails or runs out of time does not
# stop the next.
set -u
out="${1:-${OUT:-benchmarks/.cache/gpu-check}}"
mkdir -p "$out"
export TORCH_LOGS="${TORCH_LOGS:-recompiles}"
stage() {
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit} s): $*"
    local began=$SECONDS
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - began)) s" | tee -a "$out/$name.txt"
    tail -n 40 "$out/$name.txt"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/device.txt" 2>&1
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" >>"$out/device.txt" 2>&1
cat "$out/device.txt"
stage pytest-cuda 200 python -m pytest -m cuda -n 0 -q -rs -p no:cacheprovider tests/engine/test_decode_cuda.py
stage decode-bench 120 python benchmarks/decode.py --device cuda --shape 0.6b --kernels --steps 64
stage gpu-bench 240 python benchmarks/gpu.py --contenders grpo-core --shape 0.6b --workload short,unforced --profile --steps 2 \
    --timeout 150 --budget 230 --out "$out/gpu.json"
