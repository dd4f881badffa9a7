#!/usr/bin/env bash
# Held-out tau at equal training wall-clock with and without the offline feature cache (issue 15,
# item 4). Run on an otherwise idle machine; everything runs one after the other.
#   bash scripts/run_cache_ab.sh OUT_DIR [WEIGHTING]
# Builds the demo's feature cache once (timed), trains the demo twice for its 11-minute budget
# (online, then from the cache; same seed and data), exports both drafters and evaluates them with
# `python -m dflash_jax.eval` on the same 32 held-out prompts x 128 new tokens as scripts/run_ab.sh.
# Finished stages are skipped when the script is run again.
set -euo pipefail
REPO=$(realpath "$(dirname "$0")/..")
OUT=$(realpath -m "$1"); W=${2:-decay}
PY=${PY:-$REPO/.venv/bin/python}
cd "$REPO"
mkdir -p "$OUT"
COMMON=(data.heldout_count=128 eval.num_prompts=0 eval.before_training=false train.seed=0 data.seed=0
        train.loss_weighting="$W")
if [ ! -f "$OUT/features/manifest.json" ]; then
  /usr/bin/time -v "$PY" -m dflash_jax.features --config demo "${COMMON[@]}" --out "$OUT/features" \
    > "$OUT/features.log" 2>&1 || { echo "feature cache failed: see $OUT/features.log" >&2; exit 1; }
fi
for name in online cached; do
  [ -f "$OUT/$name-zlab/config.json" ] && continue
  extra=(); [ "$name" = cached ] && extra=(data.features="$OUT/features")
  /usr/bin/time -v "$PY" -m dflash_jax.train --config demo --overwrite output_dir="$OUT/$name" \
    "${COMMON[@]}" "${extra[@]}" > "$OUT/$name.log" 2>&1 || { echo "training $name failed" >&2; exit 1; }
  "$PY" -m convert.drafter_to_hf --checkpoint "$OUT/$name" --out "$OUT/$name-zlab" --dtype float32 \
    >> "$OUT/$name.log" 2>&1
done
"$PY" - "$OUT/prompts.jsonl" data.heldout_count=128 eval.num_prompts=32 eval.max_new_tokens=128 <<'PYEOF'
import json, sys
from transformers import AutoTokenizer
from convert.smollm2 import smollm2_dir
from dflash_jax.training.evaluation import heldout_prompt_ids
from dflash_jax.training.run_config import load_run_config
cfg = load_run_config("demo", sys.argv[2:])
ids = heldout_prompt_ids(cfg, AutoTokenizer.from_pretrained(smollm2_dir()))
with open(sys.argv[1], "w") as f:
    f.writelines(json.dumps({"id": f"h{i}", "input_ids": p}) + "\n" for i, p in enumerate(ids))
PYEOF
TARGET=$("$PY" -c 'from convert.smollm2 import smollm2_dir; print(smollm2_dir())')
for name in online cached; do
  [ -f "$OUT/$name-eval.json" ] && continue
  "$PY" -m dflash_jax.eval --target "$TARGET" --drafter "$OUT/$name-zlab" --prompts "$OUT/prompts.jsonl" \
    --max-new-tokens 128 --batch-size 32 --no-baseline --no-warmup --json "$OUT/$name-eval.json" \
    > "$OUT/$name-eval.log" 2>&1
done
"$PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
import numpy as np
out = Path(sys.argv[1])
per = {}
print("| run | steps in 11 min | s/step (median) | held-out tau, per-prompt mean ± s.e. | tau pooled |")
print("|---|---|---|---|---|")
for name in ("online", "cached"):
    rep = json.loads((out / f"{name}-eval.json").read_text())
    per[name] = {r["id"]: np.mean(r["acceptance_lengths"]) for r in rep["prompts"] if r["acceptance_lengths"]}
    taus = np.array(list(per[name].values()))
    rows = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    st = [r["step_time_s"] for r in rows if r.get("split") == "train" and "step_time_s" in r]
    print(f"| {name} | {rows[-1]['step']} | {np.median(st):.2f} | {taus.mean():.3f} ± "
          f"{taus.std(ddof=1) / np.sqrt(len(taus)):.3f} | {rep['summary']['tau_pooled']:.3f} |")
d = np.array([per["cached"][i] - per["online"][i] for i in sorted(set(per["cached"]) & set(per["online"]))])
print(f"paired cached - online over {len(d)} prompts: {d.mean():+.4f} +- {d.std(ddof=1) / np.sqrt(len(d)):.4f} (s.e.)")
PYEOF
