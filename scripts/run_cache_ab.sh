#!/usr/bin/env bash
# Held-out tau at equal training wall-clock with and without the offline feature cache (issue 15,
# item 4). Run on an otherwise idle machine; everything runs one after the other.
#   [SEED=N] bash scripts/run_cache_ab.sh OUT_DIR [WEIGHTING]
# Builds the demo's feature cache once (timed), trains the demo twice for its 11-minute budget
# (online, then from the cache; same seed and data), exports both drafters and evaluates them with
# `python -m dflash_jax.eval` on the same 32 held-out prompts x 128 new tokens as scripts/run_ab.sh.
# Finished stages are skipped when the script is run again. SEED (default 0) is train.seed: the
# drafter's init and anchors. The cache does not depend on it, so another seed's OUT/features can be
# copied in to skip the build.
set -euo pipefail
REPO=$(realpath "$(dirname "$0")/..")
OUT=$(realpath -m "$1"); W=${2:-decay}
PY=${PY:-$REPO/.venv/bin/python}
cd "$REPO"
source "$REPO/scripts/ab_lib.sh"
mkdir -p "$OUT"
# The A/B's held-out split (ab_lib.sh); the trainings measure no tau themselves (eval.num_prompts=0).
COMMON=("${AB_PROMPT_OVERRIDES[@]}" eval.num_prompts=0 eval.before_training=false train.seed="${SEED:-0}"
        data.seed=0 train.loss_weighting="$W")
if [ ! -f "$OUT/features/manifest.json" ]; then
  /usr/bin/time -v "$PY" -m dflash_jax.features --config demo "${COMMON[@]}" --out "$OUT/features" \
    > "$OUT/features.log" 2>&1 || { echo "feature cache failed: see $OUT/features.log" >&2; exit 1; }
fi
for name in online cached; do
  [ -f "$OUT/$name-zlab/config.json" ] && continue
  extra=(); [ "$name" = cached ] && extra=(data.features="$OUT/features")
  /usr/bin/time -v "$PY" -m dflash_jax.train --config demo --overwrite output_dir="$OUT/$name" \
    "${COMMON[@]}" "${extra[@]}" > "$OUT/$name.log" 2>&1 || { echo "training $name failed: see $OUT/$name.log" >&2; exit 1; }
  "$PY" -m convert.drafter_to_hf --checkpoint "$OUT/$name" --out "$OUT/$name-zlab" --dtype float32 \
    >> "$OUT/$name.log" 2>&1 || { echo "export of $name failed: see $OUT/$name.log" >&2; exit 1; }
done
[ -f "$OUT/prompts.jsonl" ] || ab_write_prompts "$OUT/prompts.jsonl"
ab_evaluate "$OUT" online cached
ab_report "$OUT" "online=online (target every step)" "cached=cached (data.features)" --pair cached-online
