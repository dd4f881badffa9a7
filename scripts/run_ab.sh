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
REPO=$NEW
source "$NEW/scripts/ab_lib.sh"
OLD=$OUT/baseline-src
mkdir -p "$OUT"
[ -d "$OLD" ] || git -C "$NEW" worktree add --detach "$OLD" c3b8cc9
COMMON=("${AB_PROMPT_OVERRIDES[@]}" eval.before_training=false train.steps=$STEPS train.time_limit_minutes=null train.seed=0 data.seed=0)
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
from dflash_jax import assets
try:  # where regen_cache finds regenerate_records (patched below: only the cache key is wanted)
    from dflash_jax.decoding import regeneration as regenerate
except ImportError:  # before the decoding package
    from dflash_jax import regenerate
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
[ -f "$OUT/prompts.jsonl" ] || ab_write_prompts "$OUT/prompts.jsonl"
ab_evaluate "$OUT" a b c
ab_report "$OUT" "a=(a) c3b8cc9: blocks inside the document, decay" "b=(b) new anchors + decay" \
  "c=(c) new anchors + D-PACE" --pair b-a --pair c-a --pair c-b
