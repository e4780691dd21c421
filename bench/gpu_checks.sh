#!/usr/bin/env bash
# The GPU checks in one run, for a lent CUDA machine that has torch, triton and transformers but no
# package index: the CUDA tests of the engine, then bench_llm_gpu.py (eager vs captured decode graphs).
# Packages the machine lacks (msgspec, structlog) travel as wheels in .whl/ (see the device notes);
# results land in $OUT (default bench/results). CI has no GPU and never runs this.
set -u -o pipefail
OUT=${OUT:-bench/results}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
# --confcutdir: the gateway-wide conftest (litestar apps, servers) is not needed here. test_triton_kernel.py
# (the kernel under TRITON_INTERPRET) is left to CI: the interpreter of the image's triton 3.6 fails on the
# kernel's scalar loop bound, which triton 3.9 and the compiled kernel (test_gpu.py) take.
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider --confcutdir=tests/backends/torch_llm \
  -o addopts= --junitxml="$OUT/gpu_tests.xml" \
  tests/backends/torch_llm/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
echo "tests exit $?"
timeout "${BENCH_TIMEOUT:-240}" python3 -m bench.bench_llm_gpu --rounds "${ROUNDS:-3}" --out "$OUT/llm_gpu.json" >"$OUT/llm_gpu.log" 2>&1
echo "bench exit $?"; grep -v '^ ' "$OUT/llm_gpu.log" | grep -v '^[{}\[]' | tail -40
python3 - "$OUT/llm_gpu.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as exc:  # noqa: BLE001
    sys.exit(f"no result: {exc}")
print(r["setup"])
print("copy GB/s", round(r["copy_bandwidth_bytes_per_s"] / 1e9))
for e in r["summary"]:
    cells = [f"{m}: {e[m]['decode_tokens_per_s']:.0f} tok/s {e[m]['step_time_s']*1e3:.2f} ms bw {e[m]['bandwidth_utilisation']:.2f} replayed {e[m]['steps_replayed']}" for m in ("eager", "graphs") if m in e]
    print(e["batch"], " | ".join(cells), "ratio", round(e.get("graphs_over_eager_tokens_per_s", 0), 3))
PY
