# Shared by scripts/run_ab.sh and scripts/run_cache_ab.sh: the held-out prompts every A/B drafter is
# evaluated on, the one evaluation command, and the report. Source it with PY (the python to use)
# and REPO (the repository whose code evaluates) set. A/Bs choose, so they measure the demo's
# validation set (data.validation_count conversations, never trained on, apart from the test set the
# final figure is reported on); a drafter trained by code older than the validation set held only the
# test conversations out and may have trained on these.
AB_PROMPT_OVERRIDES=(eval.validation_prompts=32 eval.max_new_tokens=128)

ab_write_prompts() {  # FILE: the demo's first 32 validation prompts as token ids, one JSON line each
  PYTHONPATH=$REPO "$PY" - "$1" "${AB_PROMPT_OVERRIDES[@]}" <<'PYEOF'
import json, sys
from transformers import AutoTokenizer
from convert.smollm2 import smollm2_dir
from dflash_jax.training.evaluation import heldout_prompt_ids
from dflash_jax.training.run_config import load_run_config
cfg = load_run_config("demo", sys.argv[2:])
ids = heldout_prompt_ids(cfg, AutoTokenizer.from_pretrained(smollm2_dir()), "validation")
want = cfg.eval.validation_prompts
assert len(ids) == want, f"{len(ids)} validation prompts, want {want}"
with open(sys.argv[1], "w") as f:
    f.writelines(json.dumps({"id": f"h{i}", "input_ids": p}) + "\n" for i, p in enumerate(ids))
PYEOF
}

ab_evaluate() {  # OUT NAME...: OUT/NAME-zlab on OUT/prompts.jsonl -> OUT/NAME-eval.json (done ones skipped)
  local out=$1 name; shift
  for name in "$@"; do
    [ -f "$out/$name-eval.json" ] && continue
    # The demo's target (SmolLM2) in float32, as every A/B drafter has been evaluated.
    PYTHONPATH=$REPO "$PY" -m dflash_jax.eval --config demo target.dtype=float32 train.compute_dtype=float32 \
      eval.drafter="$out/$name-zlab" eval.prompts="$out/prompts.jsonl" eval.max_new_tokens=128 \
      eval.batch_size=32 eval.baseline=false eval.warmup=false \
      --json "$out/$name-eval.json" > "$out/$name-eval.log" 2>&1 \
      || { echo "evaluation of $name failed: see $out/$name-eval.log" >&2; return 1; }
  done
}

ab_report() {  # OUT NAME=LABEL... [--pair X-Y ...]
  PYTHONPATH=$REPO "$PY" "$REPO/scripts/ab_report.py" "$@"
}
