"""Every tiny target family in one table, and the helpers its tests share: how transformers builds
each family (the parity reference), where its feature taps sit, the checkpoint layouts it is
tested in, its HF reference forward with the per-layer outputs and router choices, our forward,
and the comparisons between them. A new target family is a new row of FAMILIES."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from hf_fixtures import make_hf_model
from hybrid_fixtures import make_hybrid_model, text_model
from moe_fixtures import make_gpt_oss, make_qwen3_5_moe, make_qwen3_moe, save_fused

PROMPT_LEN = 520  # past the 512-token tiles and the tiny configs' rope / sliding-window lengths


@dataclass(frozen=True)
class Family:
    """A tiny target family: ``build(seed, vl)`` gives a randomised transformers model (``vl``:
    its vision-language checkpoint); ``layer_ids`` are the taps tested, out of order and with the
    last layer among them; ``layouts`` the checkpoint layouts its parity is checked in: "fused"
    is transformers 5's in-memory expert layout written as is, "vl" the vision-language one (its
    own weights, seed 1), any other name what ``save_pretrained`` writes."""

    model_type: str  # ours, which may differ from transformers' (qwen3_5 for qwen3_5_text)
    build: Callable
    layer_ids: tuple[int, ...]
    layouts: tuple[str, ...] = ("hf",)


FAMILIES = {
    "qwen3": Family("qwen3", lambda seed, vl: make_hf_model("qwen3", seed), (3, 0, 2)),
    "qwen3_tied": Family("qwen3", lambda seed, vl: make_hf_model("qwen3_tied", seed), (3, 0, 2)),
    "llama3": Family("llama", lambda seed, vl: make_hf_model("llama3", seed), (3, 0, 2)),
    "qwen2": Family("qwen2", lambda seed, vl: make_hf_model("qwen2", seed), (3, 0, 2)),
    # 3: the last layer (MoE), 0: MoE, 1: the dense-MLP layer (mlp_only_layers)
    "qwen3_moe": Family(
        "qwen3_moe", lambda seed, vl: make_qwen3_moe(seed), (3, 0, 1), ("per_expert", "fused")
    ),
    # 3: last (full), 0: sliding, 1: full; every layer a MoE layer
    "gpt_oss": Family("gpt_oss", lambda seed, vl: make_gpt_oss(seed), (3, 0, 1)),
    # 0 and 3 are linear-attention layers, 5 the last (full attention)
    "qwen3_5": Family(
        "qwen3_5", lambda seed, vl: make_hybrid_model("vl" if vl else "text", seed), (5, 0, 3), ("text", "vl")
    ),
    # 5: last (full attention), 0: linear attention, 2: full; all MoE
    "qwen3_5_moe": Family(
        "qwen3_5_moe",
        lambda seed, vl: make_qwen3_5_moe("vl" if vl else "text", seed),
        (5, 0, 2),
        ("text", "vl", "fused"),
    ),
}

# (family, layout) for every checkpoint a family is checked in, and its test id.
CASES = [(name, layout) for name, family in FAMILIES.items() for layout in family.layouts]
CASE_IDS = [name if FAMILIES[name].layouts == ("hf",) else f"{name}-{layout}" for name, layout in CASES]

_CHECKPOINTS: dict = {}


def checkpoint(tmp_path_factory, name: str, layout: str | None = None) -> tuple[Path, object]:
    """The family's tiny checkpoint in ``layout`` (default: its first), written once a session
    -> (directory, the transformers model it holds)."""
    family = FAMILIES[name]
    layout = layout or family.layouts[0]
    if (name, layout) not in _CHECKPOINTS:
        model = family.build(1 if layout == "vl" else 0, layout == "vl")
        directory = tmp_path_factory.mktemp(f"{name}_{layout}")
        if layout == "fused":
            save_fused(model, directory)
        else:
            model.save_pretrained(directory, safe_serialization=True)
        _CHECKPOINTS[name, layout] = (directory, model)
    return _CHECKPOINTS[name, layout]


def layout_configs(tmp_path_factory, name: str) -> list:
    """Our ``TargetConfig`` of the family's checkpoint in each of its layouts."""
    from dflash_jax.target.config import TargetConfig

    layouts = FAMILIES[name].layouts
    return [TargetConfig.from_pretrained(checkpoint(tmp_path_factory, name, x)[0]) for x in layouts]


def hf_reference(model, ids):
    """transformers' forward -> (its output with hidden_states, raw) where raw[i] is the raw
    (pre-norm) output of decoder layer i and raw[f"router{i}"] the top-k expert ids of layer i's
    router (MoE layers only)."""
    import torch

    raw = {}
    layers = text_model(model).layers
    hooks = [
        layer.register_forward_hook(
            lambda mod, args, out, i=i: raw.__setitem__(
                i, (out[0] if isinstance(out, tuple) else out).numpy()
            )
        )
        for i, layer in enumerate(layers)
    ]
    for i, layer in enumerate(layers):  # routers return (logits, weights, expert ids)
        router = getattr(layer.mlp, "gate", None) or getattr(layer.mlp, "router", None)
        if router is not None and hasattr(router, "top_k"):
            hooks.append(router.register_forward_hook(
                lambda mod, args, out, i=i: raw.__setitem__(f"router{i}", out[2].numpy())
            ))  # fmt: skip
    with torch.no_grad():
        out = model(torch.tensor(ids), output_hidden_states=True)
    for h in hooks:
        h.remove()
    return out, raw


def run_target(target, ids, layer_ids, mesh=None, **kw):
    """Our jitted forward over token ids, on ``mesh`` where given."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    fn = nnx.jit(lambda m, x: m(x, layer_ids=layer_ids, **kw))
    if mesh is None:
        return fn(target, jnp.asarray(ids, jnp.int32))
    with jax.set_mesh(mesh):
        return fn(target, jnp.asarray(ids, jnp.int32))


def assert_matches_reference(out, ref, raw, layer_ids, rows=slice(None), atol=1e-4):
    """Logits and final hidden (after the final norm: what lm_head sees) as transformers', and the
    features as the raw outputs of the tapped layers, over the token positions ``rows``."""
    H = ref.hidden_states[-1].shape[-1]
    np.testing.assert_allclose(np.asarray(out.logits[:, rows]), ref.logits.numpy(), atol=atol, rtol=0)
    np.testing.assert_allclose(
        np.asarray(out.hidden[:, rows]), ref.hidden_states[-1].numpy(), atol=atol, rtol=0
    )
    features = np.asarray(out.features[:, rows])
    assert features.shape[-1] == len(layer_ids) * H
    for j, layer in enumerate(layer_ids):
        np.testing.assert_allclose(
            features[..., j * H : (j + 1) * H], raw[layer], atol=atol, rtol=0, err_msg=f"layer {layer}"
        )


def assert_same_outputs(out, reference, atol, rtol=0.0, names=("logits", "hidden", "features")):
    for name in names:
        np.testing.assert_allclose(
            np.asarray(getattr(out, name)),
            np.asarray(getattr(reference, name)),
            atol=atol,
            rtol=rtol,
            err_msg=name,
        )


def packed_row(docs, first_segment: int = 1):
    """Documents (1-D id arrays) packed in one row -> (ids, positions, segment_ids), each [1, T]:
    segments numbered from ``first_segment``, positions restarting at every document."""
    ids = np.concatenate(docs)[None]
    seg = np.concatenate([np.full(len(d), first_segment + i) for i, d in enumerate(docs)]).astype(np.int32)
    pos = np.concatenate([np.arange(len(d)) for d in docs]).astype(np.int32)
    return ids, pos[None], seg[None]


def run_packed(target, docs, layer_ids, first_segment: int = 1):
    """Our forward over ``docs`` packed in one row -> (output, the slice of each document)."""
    import jax.numpy as jnp
    from flax import nnx

    ids, pos, seg = packed_row(docs, first_segment)
    fn = nnx.jit(lambda m, x, p, s: m(x, p, layer_ids=layer_ids, segment_ids=s))
    out = fn(target, jnp.asarray(ids, jnp.int32), jnp.asarray(pos), jnp.asarray(seg))
    ends = np.cumsum([len(d) for d in docs])
    return out, [slice(end - len(d), end) for d, end in zip(docs, ends, strict=True)]


def biased_towards(hf, prompts, token: int, alpha: float):
    """Point the lm_head row of ``token`` along the model's mean final hidden state over
    ``prompts`` (in place), so speculative acceptance varies between one token and the whole
    block -> that mean hidden state."""
    import torch

    with torch.no_grad():
        hs = torch.cat(
            [hf(torch.tensor(p)[None], output_hidden_states=True).hidden_states[-1][0] for p in prompts]
        )
        mean_h = hs.mean(0)
        w = hf.lm_head.weight
        w[token] = alpha * mean_h / mean_h.norm() * w.norm(dim=1).mean()
    return mean_h


def favouring_mask_token(hf, token: int) -> int:
    """The embedding row whose normed vector most favours ``token`` through lm_head."""
    import torch

    with torch.no_grad():
        e = hf.model.embed_tokens.weight
        logits = (e / e.pow(2).mean(1, keepdim=True).sqrt()) @ hf.lm_head.weight.T
        others = logits.clone()
        others[:, token] = -1e9
        return int((logits[:, token] - others.max(1).values).argmax())


def ragged_prompts(lengths, seed: int, vocab: int = 512) -> list[list[int]]:
    from hf_fixtures import prompt_ids

    rows = prompt_ids(max(lengths), vocab, seed=seed, batch=len(lengths))
    return [rows[i, :n].tolist() for i, n in enumerate(lengths)]


def rewrite_safetensors(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` with ``edit(tensors)`` applied to its weights."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def assert_same_tensors(got: dict, want: dict):
    assert set(got) == set(want)
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)


def run_mesh_experiment(config: str, layouts, overrides, out: Path, capsys) -> tuple[str, dict]:
    """``mesh_experiment`` on run config ``config`` (with ``overrides``) over ``layouts`` on 8
    simulated devices, 128-token rows of 8 -> (what it printed, its layouts.csv rows by layout)."""
    import csv

    from dflash_jax.tools.mesh_experiment import main as mesh_experiment_main

    rc = mesh_experiment_main(
        [
            "--config", config, "--devices", "8", "--seq-len", "128", "--batch", "8", "--anchors", "8",
            "--layouts", *layouts, "--out", str(out), *overrides,
        ]
    )  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    with open(out / "layouts.csv") as f:
        return text, {r["layout"]: r for r in csv.DictReader(f)}
