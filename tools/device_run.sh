#!/usr/bin/env bash
# The one command used on the GPU machine (see docs/executor.md):
#   bash tools/device_run.sh [all|tests|bench|churn|ref|methods|ranks|disk]
# Run from the repository root. Logs and results go under $OUT (default /tmp/kvflow-out).
# msgspec and structlog are not in the GPU image: carry `.whl` (cp312 / pure wheels: msgspec,
# structlog, anyio, sniffio, pytest-asyncio for the async engine tests; glassllm for the
# token-exact reference-engine test; xxhash for the disk tier; cryptography, cffi, pycparser, redis and
# hiredis for the documents' tier examples) and they are installed. `churn` needs the patterns that
# `tools/bench_churn.py extract` wrote, at $CHURN (default .data/churn.npz).
set -uo pipefail
OUT=${OUT:-/tmp/kvflow-out}
mkdir -p "$OUT"
MODE=${1:-all}
export PYTHONUNBUFFERED=1
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}

if ! $PY -c "import msgspec, structlog, anyio, xxhash" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
  else
    echo "msgspec/structlog/anyio/xxhash missing and no .whl folder carried" >&2; exit 1
  fi
fi

probe() {
  { nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv || true
    df -h /dev/shm || true
    $PY - <<'PY'
import sys, torch, msgspec, numpy
import kvflow
print("kvflow", kvflow.__version__)
print("python", sys.version.split()[0], "torch", torch.__version__, "msgspec", msgspec.__version__, "numpy", numpy.__version__)
print("cuda", torch.cuda.is_available(), torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
print("Stream.__enter__", hasattr(torch.Stream, "__enter__"), "accelerator", torch.accelerator.current_accelerator())
try:
    import cuda.bindings; print("cuda-bindings", cuda.bindings.__version__)
except Exception as e: print("cuda-bindings: no", e)
PY
  } 2>&1 | tee "$OUT/probe.txt"
}

tests() {
  # (tests/test_docs.py runs the documents' examples, on CUDA where there is one)
  $PY -m pytest -q -p no:cacheprovider tests/executors tests/engine tests/core/test_apply.py \
    tests/integrations/test_ref_engine.py tests/test_docs.py -rs 2>&1 | tee "$OUT/tests.log"
}

bench() {
  $PY tools/bench_transfer.py --quick 2>&1 | tee "$OUT/bench_quick.log"
  $PY tools/bench_transfer.py --out "$OUT/bench_transfer_results.md" 2>&1 | tee "$OUT/bench.log"
}

churn() {
  $PY tools/bench_churn.py run "${CHURN:-.data/churn.npz}" --modes "${MODES:-kernel,uva,host,runs}" \
    --out "$OUT/bench_churn_results.md" 2>&1 | tee "$OUT/churn.log"
}

ref() {
  $PY tools/bench_ref_engine.py --out "$OUT/ref_engine_results.txt" 2>&1 | tee "$OUT/ref.log"
}

methods() {
  $PY tools/bench_copy_methods.py --out "$OUT/copy_methods_results.md" 2>&1 | tee "$OUT/methods.log"
}

disk() {
  # the disk tier on the machine's local disk: its tests, then a 16k-token prefix disk -> GPU
  $PY -m pytest -q -p no:cacheprovider tests/tiers/test_disk_file.py tests/tiers/test_disk_engine.py \
    tests/core/test_disk_tier.py -rs 2>&1 | tee "$OUT/disk_tests.log"
  rm -rf "${DISK_DIR:-/tmp/kvflow-disk}"
  $PY tools/bench_disk_gpu.py --dir "${DISK_DIR:-/tmp/kvflow-disk}" --out "$OUT/disk_gpu_results.txt" 2>&1 | tee "$OUT/disk_gpu.log"
}

rc=0
case "$MODE" in
  all) probe; tests || rc=$?; bench || rc=$?; churn || rc=$?; ref || rc=$? ;;
  tests) probe; tests || rc=$? ;;
  bench) bench || rc=$? ;;
  churn) churn || rc=$? ;;
  ref) ref || rc=$? ;;
  methods) methods || rc=$? ;;
  disk) probe; disk || rc=$? ;;
  ranks) probe; $PY -m pytest -q -p no:cacheprovider tests/executors/test_ranks.py -rs 2>&1 | tee "$OUT/ranks.log" || rc=$? ;;
  *) echo "usage: $0 [all|tests|bench|churn|ref|methods|ranks|disk]" >&2; exit 2 ;;
esac
exit $rc
