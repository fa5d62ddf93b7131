#!/usr/bin/env bash
# One GPU check for the Triton kernels, sized for a single device call (under ~6 minutes):
#   1. environment facts (GPU, torch, triton),
#   2. tests/kernels/test_triton_kernels.py compiled on the GPU (no interpreter when CUDA is present),
#   3. benchmarks/kernels_bench.py --quick (decode bandwidth and speed vs torch).
# Installs nothing: it uses the first Python (PYTHON, .venv/bin/python, python3, python) that
# imports torch with CUDA and triton. Logs and the bench JSON go to $OUT (or artifacts/gpu_check).
# Exit status: 0 when tests and bench pass, else the first failing step's status.
#   usage: scripts/gpu_check.sh            (from anywhere; it cd's to the repository root)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-$PWD/artifacts/gpu_check}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
: >"$LOG"
log() { echo "$@" | tee -a "$LOG"; }

PY=""
for cand in "${PYTHON:-}" .venv/bin/python python3 python; do
    [ -n "$cand" ] || continue
    command -v "$cand" >/dev/null 2>&1 || [ -x "$cand" ] || continue
    if "$cand" -c "import torch, triton; assert torch.cuda.is_available()" >/dev/null 2>&1; then
        PY="$cand"
        break
    fi
done
if [ -z "$PY" ]; then
    log "gpu_check: no Python with CUDA torch and triton found" \
        "(tried \$PYTHON, .venv/bin/python, python3, python)"
    nvidia-smi 2>&1 | tee -a "$LOG"
    exit 3
fi

log "== environment ($(date -u +%FT%TZ))"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | tee -a "$LOG"
"$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import sys, torch, triton
p = torch.cuda.get_device_properties(0)
print(f"python {sys.version.split()[0]}  torch {torch.__version__} (cuda {torch.version.cuda})", end="  ")
print(f"triton {triton.__version__}")
print(f"device {p.name}  sm_{p.major}{p.minor}  {p.multi_processor_count} SMs  {p.total_memory / 2**30:.0f} GiB")
EOF
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET

status=0
log "== tests/kernels/test_triton_kernels.py (compiled)"
if "$PY" -c "import pytest" >/dev/null 2>&1; then
    # addopts cleared: the device Python may lack the plugins pyproject's options name.
    timeout 240 "$PY" -m pytest tests/kernels/test_triton_kernels.py -q -rs -o addopts="" -p no:cacheprovider \
        --junitxml="$OUT_DIR/test_kernels.xml" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    log "pytest exit status: $rc"
    [ "$rc" -eq 0 ] || status=$rc
else
    log "pytest is not installed for $PY: tests skipped (the bench below still checks kernel vs torch)"
    status=4
fi

log "== benchmarks/kernels_bench.py --quick"
timeout 240 "$PY" benchmarks/kernels_bench.py --quick --json-out "$OUT_DIR/kernels_bench.json" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
log "bench exit status: $rc"
[ "$status" -ne 0 ] || status=$rc
log "== done, status $status; output in $OUT_DIR"
exit "$status"
