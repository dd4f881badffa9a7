"""The train-to-serve gate (dflash_jax.tools.serve_check) against the real clients: z-lab's
``dflash`` package and speculators 0.9.0, both installed by scripts/setup.sh.

The target is the biased tiny Qwen3 of tests/test_eval_speculative.py (its lm_head favours one
token, so acceptance varies between one token and the whole block); the drafter is a random
two-layer one saved as a run checkpoint (full attention: the speculators leg leaves sliding
windows out). The gate must
pass on its exports and fail, naming the prompt and both taus, once the export's two layers are
swapped. The overfit gate (slow) trains a drafter on one sample until it reproduces it and
requires an accepted length close to the block size through both exports and clients.
"""

from __future__ import annotations

import json
import re

import optax
import pytest
from flax import nnx
from hf_fixtures import make_hf_model, prompt_ids
from target_families import biased_towards, favouring_mask_token, rewrite_safetensors

from dflash_jax.checkpoint import Checkpointer
from dflash_jax.drafter.api import init_drafter
from dflash_jax.drafter.config import DrafterConfig

torch = pytest.importorskip("torch")
pytest.importorskip("dflash.model", reason="z-lab's dflash is installed by scripts/setup.sh")
pytest.importorskip("speculators", reason="speculators 0.9.0 is installed by scripts/setup.sh")

from dflash_jax.tools import serve_check  # noqa: E402 - needs the clients above

C, ALPHA, MAX_NEW, BLOCK = 7, 2.0, 24, 4
PROMPT_LENS = (24, 9, 17, 30)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import dflash_jax

    hf = make_hf_model("qwen3")
    rows = prompt_ids(max(PROMPT_LENS), 512, seed=3, batch=len(PROMPT_LENS))
    prompts = [rows[i, :n].tolist() for i, n in enumerate(PROMPT_LENS)]
    biased_towards(hf, prompts, C, ALPHA)
    target_dir = tmp_path_factory.mktemp("biased_target")
    hf.save_pretrained(target_dir)
    target = dflash_jax.load_target(target_dir)
    cfg = DrafterConfig.for_target(
        target.config,
        num_layers=2,
        target_layer_ids=(0, 1, 2),
        mask_token_id=favouring_mask_token(hf, C),
        block_size=BLOCK,
    )
    drafter = init_drafter(cfg, target, 7)
    run = tmp_path_factory.mktemp("run")
    ckpt = Checkpointer(run / "checkpoints")
    saved = {"drafter_config": cfg.to_dict(), "target": {"path": str(target_dir)}}
    ckpt.save(
        1, drafter, nnx.Optimizer(drafter, optax.adamw(1e-3), wrt=nnx.Param), {"epoch": 0}, saved, force=True
    )
    ckpt.close()
    return dict(hf=hf, target=target, dir=target_dir, drafter=drafter, run=run, prompts=prompts)


def _check(setup, exports, **kw):
    return serve_check.check_exports(
        setup["target"],
        setup["drafter"],
        setup["dir"],
        exports,
        setup["prompts"],
        ids=[f"p{i}" for i in range(len(setup["prompts"]))],
        max_new_tokens=MAX_NEW,
        hf_target=setup["hf"],
        **kw,
    )


def test_gate_passes_on_the_export_and_fails_on_swapped_layers(setup, tmp_path):
    exports = serve_check.export_both(setup["run"], tmp_path / "exports", verifier=str(setup["dir"]))
    report = _check(setup, exports)
    assert report["clients"] == {"zlab": "ok", "speculators": "ok"}
    assert not report["failures"], report["failures"]
    taus = [r["ours"] for r in report["prompts"]]
    assert 1.0 < max(taus) and min(taus) < BLOCK, taus  # acceptance varies: the check can see a change
    for r in report["prompts"]:  # in float32 both clients accept exactly what ours does
        assert r["zlab"] == r["speculators"] == r["ours"], r

    commands = serve_check.serve_commands(exports, str(setup["dir"]), report["block_size"])
    spec = json.loads(re.search(r"--speculative-config '(.*)'", commands["vllm (zlab)"]).group(1))
    assert spec == {"method": "dflash", "model": str(exports["zlab"].resolve()), "num_speculative_tokens": 3}
    assert commands["vllm (zlab)"].startswith(f"vllm serve {setup['dir']} ")
    assert f"--speculative-num-draft-tokens {BLOCK}" in commands["sglang (zlab)"]
    assert commands["vllm (speculators, config only)"] == f"vllm serve {exports['speculators'].resolve()}"

    def swap_layers(tensors):
        for key in [k for k in tensors if k.startswith("layers.0.")]:
            other = "layers.1." + key.removeprefix("layers.0.")
            tensors[key], tensors[other] = tensors[other], tensors[key]

    broken = {
        fmt: rewrite_safetensors(path, tmp_path / f"broken-{fmt}", swap_layers)
        for fmt, path in exports.items()
    }
    bad = _check(setup, broken)
    assert bad["failures"]
    for client in ("zlab", "speculators"):
        msgs = [m for m in bad["failures"] if f": {client} tau " in m]
        assert msgs, (client, bad["failures"])
        m = re.match(r"prompt '(p\d)': \w+ tau (\S+) vs ours (\S+) \(tolerance 0.05", msgs[0])
        assert m, msgs[0]
        row = next(r for r in bad["prompts"] if r["id"] == m.group(1))
        assert float(m.group(2)) == pytest.approx(row[client], abs=1e-3)
        assert float(m.group(3)) == pytest.approx(row["ours"], abs=1e-3)
        assert abs(row[client] - row["ours"]) > 0.05


@pytest.mark.slow
def test_overfit_gate_one_sample_is_reproduced_through_both_clients(tmp_path, capsys):
    """SpecForge's serving gate: a drafter trained on one sample until it reproduces it accepts
    nearly the whole block on that sample, in our evaluator and in both clients, through the
    command line. The sample is a random Qwen3 target's own greedy answer (28 distinct tokens
    of 40, not a repeated one); an untrained drafter accepts little of it."""
    import transformers
    from hf_fixtures import ends, normal, randomise, tiny_hf_config

    import dflash_jax
    from dflash_jax.decoding.evaluation import evaluate
    from dflash_jax.decoding.generate import generate
    from dflash_jax.training.run import run
    from dflash_jax.training.run_config import load_run_config

    torch.manual_seed(0)
    config = tiny_hf_config("qwen3")
    config.vocab_size = 49152  # the SmolLM2 tokenizer's, for the run's chat-template checks
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomise(hf, ((ends("norm.weight"), normal(1.0, 0.2)), (ends(".bias"), normal(0.0, 0.1))))
    target_dir = tmp_path / "target"
    hf.save_pretrained(target_dir)
    target = dflash_jax.load_target(target_dir)
    prompt = prompt_ids(12, 49152, seed=0)[0].tolist()
    answer = generate(target, [prompt], max_new_tokens=40)[0]
    assert len(set(answer)) > 20
    sample = json.dumps({"input_ids": prompt + answer, "loss_mask": [0] * len(prompt) + [1] * len(answer)})
    data = tmp_path / "one.jsonl"
    data.write_text((sample + "\n") * 8)  # one sample, a batch of 8 rows over 8 devices
    (tmp_path / "prompt.jsonl").write_text(json.dumps({"id": "sample", "input_ids": prompt}) + "\n")

    run_dir = tmp_path / "run"
    overrides = [
        f"output_dir={run_dir}",
        f"target.path={target_dir}",
        f"data.sources=[{data}]",
        "data.heldout_count=0",
        "data.max_length=64",
        "train.steps=200",
        "train.warmup_steps=5",
        "train.checkpoint_every=200",
        "eval.num_prompts=0",
    ]
    result = run(load_run_config("tiny", overrides), quiet=True)
    B = result["drafter"].config.block_size
    untrained = init_drafter(result["drafter"].config, target, 0)
    before = evaluate(target, untrained, [prompt], max_new_tokens=40, baseline=False, warmup=False)
    assert before["summary"]["tau"] < 2.0, before["summary"]

    report_file = tmp_path / "gate.json"
    rc = serve_check.main(
        ["--config", str(run_dir), f"eval.prompts={tmp_path / 'prompt.jsonl'}", "eval.max_new_tokens=40"]
        + ["--json", str(report_file)]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads(report_file.read_text())
    assert report["clients"] == {"zlab": "ok", "speculators": "ok"}
    (row,) = report["prompts"]
    # 40 tokens: the prefill's, nine full blocks of B, and a last step of 3: tau 3.9 at B = 4
    assert row["ours"] == row["zlab"] == row["speculators"] >= B - 0.5, row
    assert (
        f'"num_speculative_tokens": {B - 1}' in out and "vllm serve" in out and "sglang.launch_server" in out
    )
