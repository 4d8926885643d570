#!/usr/bin/env bash
# GPU checks on ONE H100/H200-class GPU, in under 8 minutes:
#   1. nvidia-smi and the software versions;
#   2. benchmarks/bench.py --device cuda --preset gpu (flt_diag's small preset: d=384, L=6,
#      3 heads, seq 512, batch 64; bf16 autocast and compiled blocks, as the Trainer runs them):
#      bf16 MFU of the step (lt, flt, the unrolled reference), diagnostics overhead (flt),
#      compiled vs eager (flt), activation memory against K;
#   3. a short diagnostic sweep of the small preset (all five variants at K = 3 and 6, 200 steps
#      each) and its verdicts (`flt-diag summary`), `flt-diag plot all` and `flt-diag report` on it,
#      and the FLOP rate the sweep achieved per K against the measured bf16 matmul peak
#      (`bench.py --flops --sweep`).
# Everything goes to $OUT if set, else ./gpu-results (log: gpu_check.log). Every stage has its own
# time limit, so a slow stage cannot take the others with it; the exit status is that of the
# first failed stage (0 if all passed).
#
#   OUT=/tmp/gpu-results bash benchmarks/gpu_check.sh        # PYTHON=... picks the interpreter
set -uo pipefail

OUT="${OUT:-./gpu-results}"  # relative to where the script is started
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)" || { echo "error: cannot create $OUT"; exit 2; }
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
# The token cache stays out of $OUT (the stdlib corpus is ~30 MB of tokens).
export FLT_DIAG_CACHE="${FLT_DIAG_CACHE:-${TMPDIR:-/tmp}/flt-diag-cache}"
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu_check.log") 2>&1

START=$(date +%s)
STATUS=0
stage() {  # stage NAME LIMIT_S CMD...: time-limited, output also in $OUT/NAME.txt
    local name=$1 limit=$2; shift 2
    local t0=$(date +%s)
    echo "=== $name (limit ${limit}s) $(date -u +%H:%M:%S): $*"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
    local rc=${PIPESTATUS[0]}
    local dt=$(( $(date +%s) - t0 ))
    echo "=== $name: rc=$rc in ${dt}s"
    echo "$name rc=$rc seconds=$dt" >> "$OUT/timings.txt"
    if [ "$rc" -ne 0 ] && [ "$STATUS" -eq 0 ]; then STATUS=$rc; fi
    return 0
}

echo "gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(pwd), results in $OUT"
: > "$OUT/timings.txt"

# 1. the machine
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed (see nvidia-smi.txt)"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv \
    >> "$OUT/nvidia-smi.txt" 2>&1 || true
cat "$OUT/nvidia-smi.txt"

if ! "$PY" -c "import flt_diag" 2>/dev/null; then
    echo "flt_diag is not importable: pip install -e ."
    "$PY" -m pip install -q -e . || "$PY" -m pip install -q --no-build-isolation --no-deps -e . \
        || echo "pip install failed; falling back to PYTHONPATH"
    "$PY" -c "import flt_diag" 2>/dev/null || export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" - > "$OUT/env.txt" 2>&1 <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
    print("memory GiB", round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
import flt_diag, flt_diag.cli.commands
print("flt_diag", flt_diag.__file__)
EOF
cat "$OUT/env.txt"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: CUDA is not available to $PY; nothing to check"
    exit 2
fi

# Stage limits: 150 + 220 + 10 + 25 + 15 + 30 = 450 s, plus ~15 s of setup: under 8 minutes.

# 2. benchmarks (most of the time is torch.compile of the blocks on first use; the timing itself
#    takes well under a minute). Table: bench-gpu.txt, everything: bench-gpu.json.
stage bench-gpu 150 "$PY" benchmarks/bench.py --device cuda --preset gpu --variants lt flt \
    --diag-variants flt --eager-variants flt --no-fwd-bwd --out "$OUT/bench-gpu.json"

# 3. a short diagnostic sweep of the small preset: verdicts, figures, report, achieved FLOP rate
stage sweep 220 "$PY" -m flt_diag.cli.commands run-ablation --preset small --device cuda --loops 3 6 \
    --variants lt lt-ii lt-ai fla flt --steps 200 --out "$OUT/sweep" --quiet
stage summary 10 "$PY" -m flt_diag.cli.commands summary "$OUT/sweep"
stage plot 25 "$PY" -m flt_diag.cli.commands plot all "$OUT/sweep"
stage report 15 "$PY" -m flt_diag.cli.commands report "$OUT/sweep"
stage sweep-flops 30 "$PY" benchmarks/bench.py --flops --sweep "$OUT/sweep" --device cuda --preset gpu \
    --out "$OUT/sweep-flops.json"

nvidia-smi --query-gpu=name,memory.used,temperature.gpu,clocks.sm --format=csv >> "$OUT/nvidia-smi.txt" 2>&1 || true
echo "total $(( $(date +%s) - START ))s, status $STATUS" | tee -a "$OUT/timings.txt"
exit $STATUS
