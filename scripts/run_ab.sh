#!/usr/bin/env bash
# Held-out tau A/B of the training recipe (issue 10, item 7). Run on an otherwise idle machine:
# the three trainings run one after the other, never at once.
#   bash scripts/run_ab.sh REPO_AT_NEW_RECIPE OUT_DIR [STEPS]
# (a) today's recipe at commit c3b8cc9 (a detached worktree of the same repository), (b) new anchors
# + decay, (c) new anchors + D-PACE; same seed, same data (the demo's regenerated set), same
# STEPS (default 70: what the demo reaches in its 11 minutes on an idle 2-core CPU), LR schedule
# over STEPS for all three. Each drafter is exported to z-lab's format by its own converter and
# evaluated by the same `python -m dflash_jax.eval` (new recipe's repository) on the same 32
# held-out prompts x 128 new tokens; per-prompt tau gives the spread.
set -euo pipefail
NEW=$(realpath "$1"); OUT=$(realpath -m "$2"); STEPS=${3:-70}
PY=${PY:-$NEW/.venv/bin/python}
OLD=$OUT/baseline-src
mkdir -p "$OUT"
[ -d "$OLD" ] || git -C "$NEW" worktree add --detach "$OLD" c3b8cc9
COMMON=(data.heldout_count=128 eval.num_prompts=32 eval.max_new_tokens=128 eval.before_training=false
        train.steps=$STEPS train.time_limit_minutes=null train.seed=0 data.seed=0)
# Training runs measure no tau themselves (eval.num_prompts=0): the one evaluator below does.
TRAIN=("${COMMON[@]}" eval.num_prompts=0)
REGEN_ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/dflash_jax/regenerated"

seed_regen() {  # repo: put the demo's regenerated files under the key that repo's code computes
  local repo=$1 src
  src=$(ls -td "$REGEN_ROOT"/*/ 2>/dev/null | while read -r d; do [ -f "$d/train.jsonl" ] && echo "$d" && break; done)
  [ -n "$src" ] || return 0  # nothing regenerated yet: the first training run does it
  (cd "$repo" && PYTHONPATH=$repo "$PY" - "$src" "${TRAIN[@]}" <<'PYEOF'
import shutil, sys
from pathlib import Path
from dflash_jax import assets, regenerate
try:
    from dflash_jax.training.regen_cache import regenerated_data
    from convert.smollm2 import smollm2_dir
except ImportError:  # the baseline commit: both lived elsewhere
    from dflash_jax.train import regenerated_data
    smollm2_dir = assets.smollm2_dir
from dflash_jax.training.run_config import load_run_config
class KeyOnly(Exception):
    pass
def stop(*a, **k):
    raise KeyOnly
regenerate.regenerate_records = stop
root = assets.cache_root() / "regenerated"
cfg = load_run_config("demo", [a for a in sys.argv[2:] if a.split("=")[0].split(".")[0] in ("data", "eval", "regen")])
try:
    from transformers import AutoTokenizer
    regenerated_data(cfg, None, AutoTokenizer.from_pretrained(smollm2_dir()), smollm2_dir())
except KeyOnly:
    (new_dir,) = [p for p in root.iterdir() if not (p / "train.jsonl").exists()]
    for f in ("train.jsonl", "heldout.jsonl"):
        shutil.copy(Path(sys.argv[1]) / f, new_dir / f)
    print("seeded regen cache", new_dir, "from", sys.argv[1])
else:
    print("regen cache already present")
PYEOF
  )
}

train() {  # name repo extra-overrides...
  local name=$1 repo=$2; shift 2
  [ -f "$OUT/$name-zlab/config.json" ] && return 0  # done by an earlier run of this script
  local resume=()  # a training stopped part-way (checkpoints kept) continues exactly where it was
  [ -d "$OUT/$name/checkpoints" ] && resume=(--resume)
  seed_regen "$repo" >> "$OUT/$name.log" 2>&1
  (cd "$repo" && PYTHONPATH=$repo /usr/bin/time -v "$PY" -m dflash_jax.train --config demo "${resume[@]}" \
      output_dir="$OUT/$name" "${TRAIN[@]}" "$@") >> "$OUT/$name.log" 2>&1 \
    || { echo "training $name failed: see $OUT/$name.log" >&2; exit 1; }
  (cd "$repo" && PYTHONPATH=$repo "$PY" -m convert.drafter_to_hf --checkpoint "$OUT/$name" \
      --out "$OUT/$name-zlab" --dtype float32) >> "$OUT/$name.log" 2>&1 \
    || { echo "export of $name failed: see $OUT/$name.log" >&2; exit 1; }
}
# The same regenerated data for all three (greedy regeneration by the same target is
# deterministic; the cache keys differ between the commits, so each run's key is seeded with the
# files the first run wrote). (b) first: new code regenerates.
train b "$NEW" train.loss_weighting=decay
train a "$OLD"
train c "$NEW" train.loss_weighting=dpace
cd "$NEW"
PYTHONPATH=$NEW "$PY" - "$OUT/prompts.jsonl" "${COMMON[@]}" <<'PYEOF'
import json, sys
from transformers import AutoTokenizer
from convert.smollm2 import smollm2_dir
from dflash_jax.training.evaluation import heldout_prompt_ids
from dflash_jax.training.run_config import load_run_config
cfg = load_run_config("demo", [a for a in sys.argv[2:] if a.split("=")[0].split(".")[0] in ("data", "eval")])
ids = heldout_prompt_ids(cfg, AutoTokenizer.from_pretrained(smollm2_dir()))
assert len(ids) == cfg.eval.num_prompts, len(ids)
with open(sys.argv[1], "w") as f:
    f.writelines(json.dumps({"id": f"h{i}", "input_ids": p}) + "\n" for i, p in enumerate(ids))
PYEOF
for name in a b c; do
  [ -f "$OUT/$name-eval.json" ] && continue  # evaluated by an earlier run of this script
  PYTHONPATH=$NEW "$PY" -m dflash_jax.eval --target "$(PYTHONPATH=$NEW "$PY" -c 'from convert.smollm2 import smollm2_dir; print(smollm2_dir())')" \
      --drafter "$OUT/$name-zlab" --prompts "$OUT/prompts.jsonl" --max-new-tokens 128 --batch-size 32 \
      --no-baseline --no-warmup --json "$OUT/$name-eval.json" > "$OUT/$name-eval.log" 2>&1
done
PYTHONPATH=$NEW "$PY" - "$OUT" <<'PYEOF'
import json, sys, re
from pathlib import Path
import numpy as np
out = Path(sys.argv[1])
print("| recipe | steps | s/step | held-out tau (per-prompt mean) | std / sqrt(n) | tau pooled |")
print("|---|---|---|---|---|---|")
for name, label in (("a", "(a) c3b8cc9: blocks inside the document, decay"), ("b", "(b) new anchors + decay"), ("c", "(c) new anchors + D-PACE")):
    rep = json.loads((out / f"{name}-eval.json").read_text())
    taus = np.array([np.mean(r["acceptance_lengths"]) for r in rep["prompts"] if r["acceptance_lengths"]])
    rows = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    st = [r["step_time_s"] for r in rows if r.get("split") == "train" and "step_time_s" in r]
    print(f"| {label} | {rows[-1]['step']} | {np.median(st):.2f} | {taus.mean():.3f} | {taus.std(ddof=1) / np.sqrt(len(taus)):.3f} | {rep['summary']['tau_pooled']:.3f} |")
# Paired over the same prompts: the prompt-to-prompt spread cancels.
per = {}
for name in "abc":
    rep = json.loads((out / f"{name}-eval.json").read_text())
    per[name] = {r["id"]: np.mean(r["acceptance_lengths"]) for r in rep["prompts"] if r["acceptance_lengths"]}
for x, y in (("b", "a"), ("c", "a"), ("c", "b")):
    ids = sorted(set(per[x]) & set(per[y]))
    d = np.array([per[x][i] - per[y][i] for i in ids])
    print(f"paired ({x}) - ({y}) over {len(ids)} prompts: {d.mean():+.4f} +- {d.std(ddof=1) / np.sqrt(len(d)):.4f} (s.e.)")
PYEOF
