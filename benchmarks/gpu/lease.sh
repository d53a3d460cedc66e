#!/usr/bin/env bash
# The GPU checklist (benchmarks/gpu/CHECKLIST.md) as one command for a short lease of a CUDA machine, from the
# repository root. Every part has its own time limit and writes its log under $OUT (default ./gpu-out) as it goes,
# so that a lease cut short keeps what was measured. Wheels missing on that machine (dp-accounting) may be carried
# in .whl/.
#
#     bash benchmarks/gpu/lease.sh                                  # every part
#     PARTS="kernels step" STEP_ARGS="--shapes 2048x8" bash benchmarks/gpu/lease.sh   # some parts
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=src:.
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=src:.:/tmp/site
fi
part() {  # part NAME SECONDS COMMAND...: run one part under a time limit, its output in $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    local begin=$SECONDS
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - begin))s"
}
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
} >"$OUT/versions.log" 2>&1
cat "$OUT/versions.log"
STEP_ARGS=${STEP_ARGS:-}
for name in ${PARTS:-determinism kernels syncs step autocast tests_kernels tests_cuda_only}; do
    case $name in
    kernels) part kernels 150 env TRITON_PRINT_AUTOTUNING=1 python3 benchmarks/gpu/kernels.py --quick ;;
    syncs) part syncs 60 python3 benchmarks/gpu/syncs.py ;;
    determinism) part determinism 60 python3 benchmarks/gpu/determinism.py ;;
    autocast) part autocast 90 python3 benchmarks/gpu/autocast.py ;;
    step) part step "${STEP_LIMIT:-200}" python3 benchmarks/gpu/step.py --out "$OUT/step.jsonl" $STEP_ARGS ;;
    tests_kernels) part tests_kernels 120 python3 -m pytest -q -p no:cacheprovider -p benchmarks.gpu.on_cuda -n 8 \
        tests/kernels --timeout 100 -rf ;;
    host) part host 60 python3 benchmarks/host_overhead.py --device cuda ;;
    workloads) part workloads 180 python3 benchmarks/hf_models.py --workloads --no-write --device cuda ;;
    first_memory) part first_memory 120 python3 benchmarks/long_context.py --seqs 1024 --batches 4 --max-seq-b4 1024 \
        --no-time --no-docs --out "$OUT/first_memory.csv" --modes non-private flashdp-bk flashdp-ghost ;;
    suite) part suite 300 python3 -m pytest -q -p no:cacheprovider -p benchmarks.gpu.on_cuda -n 16 tests \
        --ignore=tests/distributed --ignore=tests/integrations/test_transformers_ddp.py --ignore=tests/test_docs.py \
        --ignore=tests/test_code_shape.py --ignore=tests/test_packaging.py --ignore=tests/test_examples.py \
        --ignore=tests/test_default_device.py --timeout 120 -rf ;;
    tests_cuda_only) part tests_cuda_only 90 python3 -m pytest -q -p no:cacheprovider -n 4 -k on_cuda \
        tests/rules/test_recurrent.py tests/rules/test_conv.py --timeout 80 -rf ;;
    esac
done
cat "$OUT"/determinism.log 2>/dev/null
grep -hs "^| \|passed\|failed\|^FAILED" "$OUT"/kernels.log "$OUT"/syncs.log "$OUT"/autocast.log "$OUT"/host.log \
    "$OUT"/workloads.log "$OUT"/tests_*.log | tail -60
cat "$OUT"/first_memory.csv 2>/dev/null
grep -hs '"mode"' "$OUT"/step.log | cut -c1-400
