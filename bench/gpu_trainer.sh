#!/usr/bin/env bash
# A few bf16 FSDP2 steps of gpt_1_3b on the GPU(s) of this machine: vanilla, RAA scheduled (PAR on
# 7 of 24 layers, rotation on all) and RAA on every layer; prints step time, tokens/s, peak memory
# and the overhead over vanilla. Needs a CUDA build of torch in $PY (the default .venv's is the CPU one:
# `make .venv/.installed TORCH='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'`).
#
#   bash bench/gpu_trainer.sh                      # all GPUs, 12 steps per variant, eager
#   STEPS=20 COMPILE=1 NPROC=8 bash bench/gpu_trainer.sh
#   EXTRA="--set parallel.device=cpu --set model.d_model=64 ..." NPROC=2 bash bench/gpu_trainer.sh   # CPU smoke test
#
# With QKWATCH_URL set (a running collector), the agent is attached to every run as in production.
# About 1 minute per variant on one H200 with COMPILE=0 (model build and init included).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
NPROC=${NPROC:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}
STEPS=${STEPS:-12}
MICRO=${MICRO:-2}
COMPILE=${COMPILE:-0}
OUT=${OUT:-bench/out/gpu_trainer}
[ "$NPROC" -ge 1 ] || { echo "no CUDA device visible to $PY" >&2; exit 1; }
rm -rf "$OUT" && mkdir -p "$OUT"

band=$("$PY" -c 'print("[" + ",".join("1e-4" if 9 <= i <= 15 else "0" for i in range(24)) + "]")')
common=(--recipe gpt_1_3b --set "train.steps=$STEPS" --set "train.global_batch_size=$((NPROC * MICRO))"
        --set "train.micro_batch_size=$MICRO" --set train.log_every=1 --set train.val_every=0 --set train.val_batches=1
        --set checkpoint.enabled=false --set checkpoint.export=false --set "parallel.compile=$COMPILE"
        --set optim.warmup_steps=2 ${EXTRA:-})

run() {  # name, extra --set flags...
  local name=$1; shift
  echo "== $name" >&2
  "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m qkwatch.trainer "${common[@]}" "$@" \
    --out "$OUT/$name" 2>&1 | grep -E "step [0-9]+/|Error|error" | tail -3 >&2
}
run vanilla --set raa.enabled=false
run scheduled --set raa.schedule=false --set "raa.fallback_lambdas=$band"
run every_layer --set raa.schedule=false

"$PY" - "$OUT" "$STEPS" <<'PY'
import json, statistics, sys
from pathlib import Path
out, steps = Path(sys.argv[1]), int(sys.argv[2])
rows = {}
for name in ("vanilla", "scheduled", "every_layer"):
    recs = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "tokens_per_s" in r and r["step"] >= 3]  # skip warm-up / compile steps
    tps = statistics.median(r["tokens_per_s"] for r in recs)
    rows[name] = (tps, max(r.get("max_memory_gib", 0) for r in recs), sum(x > 0 for x in recs[-1]["lambda"]))
base = rows["vanilla"][0]
print(f"gpt_1_3b bf16 FSDP2, {steps} steps per variant (median of steps >= 3)")
print(f"{'variant':<12}{'PAR layers':>11}{'tokens/s':>12}{'peak GiB':>10}{'overhead':>10}")
for name, (tps, mem, flagged) in rows.items():
    print(f"{name:<12}{flagged:>11}{tps:>12.0f}{mem:>10.1f}{(base / tps - 1) * 100:>9.1f}%")
PY
