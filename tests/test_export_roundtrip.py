"""Drafter export (convert.drafter_to_hf) and import (convert.hf_to_drafter), and load_drafter.

References: z-lab's ``dflash.model.DFlashDraftModel`` writes the "published" HF directory of the
import tests and loads our exports; checkpoints are written by the trainer's own ``Checkpointer``.
"""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from hf_fixtures import save_hf_model, zlab_drafter_config

from convert import drafter_reader, drafter_to_hf, hf_to_drafter
from convert.zlab_drafter import WEIGHTS_FILE, flatten, param_shapes, unflatten
from dflash_jax.checkpoint import Checkpointer, CheckpointError, read_checkpoint, resolve_checkpoint
from dflash_jax.drafter.api import get_params, init_drafter, set_params
from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.loading import load_drafter

torch = pytest.importorskip("torch")
dm = pytest.importorskip("dflash.model")
safetensors_numpy = pytest.importorskip("safetensors.numpy")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_hf_model("qwen3", tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="module")
def target(target_dir):
    import dflash_jax

    return dflash_jax.load_target(target_dir)


def _config(target, **kw):
    base = dict(num_layers=2, mask_token_id=500, block_size=8, target_layer_ids=(0, 2))
    base.update(kw)
    return DrafterConfig.for_target(target.config, **base)


def _random_drafter(config, target, seed=0):
    """A drafter whose every parameter (norms included) is distinct and non-trivial."""
    drafter = init_drafter(config, target, seed)
    rng = np.random.default_rng(seed)
    params = {
        k: np.asarray(v) + 0.1 * rng.normal(size=v.shape).astype(np.float32)
        for k, v in flatten(get_params(drafter)).items()
    }
    return set_params(drafter, unflatten(params))


def _save_run(run_dir, drafter, target, step=7, target_path="tiny"):
    """A checkpoint exactly as dflash_jax.train writes it (params + optimizer state + config)."""
    optimizer = nnx.Optimizer(drafter, optax.adamw(1e-3), wrt=nnx.Param)
    ckpt = Checkpointer(run_dir / "checkpoints")
    config = {"drafter_config": drafter.config.to_dict(), "target": {"path": target_path}}
    ckpt.save(step, drafter, optimizer, {"epoch": 0}, config, force=True)
    ckpt.close()
    return run_dir


def _np_params(drafter):
    return {k: np.asarray(v) for k, v in flatten(jax.device_get(get_params(drafter))).items()}


def _assert_same_params(a: dict, b: dict):
    a, b = flatten(a) if any(isinstance(v, dict) for v in a.values()) else a, flatten(b)
    assert sorted(a) == sorted(b)
    for k in a:
        assert np.array_equal(np.asarray(a[k]), np.asarray(b[k])), k


def test_checkpoint_to_zlab_to_checkpoint_is_identical(target, tmp_path):
    drafter = _random_drafter(_config(target), target)
    run = _save_run(tmp_path / "run", drafter, target)
    ref = _np_params(drafter)

    hf = drafter_to_hf.export(run, tmp_path / "hf", dtype="float32")
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert "auto_map" not in cfg  # no dflash.py ships with it: AutoModel would fail on the key
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 4
    assert cfg["dflash_config"] == {"mask_token_id": 500, "target_layer_ids": [0, 2]}
    assert cfg["rope_parameters"]["rope_theta"] == target.config.rope.theta
    with open(hf / WEIGHTS_FILE, "rb") as f:  # {"format": "pt"} metadata, as torch expects
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["__metadata__"] == {"format": "pt"}
    tensors = safetensors_numpy.load_file(hf / WEIGHTS_FILE)
    assert tensors["fc.weight"].shape == (64, 2 * 64)  # [H, K*H]
    assert not any("embed" in k or "lm_head" in k for k in tensors)
    np.testing.assert_array_equal(tensors["fc.weight"], ref["fc"].T)

    # z-lab's own class loads it with no missing or unexpected weights, values unchanged.
    model, info = dm.DFlashDraftModel.from_pretrained(hf, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.target_layer_ids == [0, 2] and model.block_size == 8 and model.mask_token_id == 500
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    assert sorted(sd) == sorted(tensors)
    for k, v in tensors.items():
        np.testing.assert_array_equal(sd[k], v, err_msg=k)

    out = hf_to_drafter.import_hf(hf, tmp_path / "imported")
    config, params, _ = read_checkpoint(out)
    assert config == drafter.config
    _assert_same_params(ref, params)

    # load_drafter takes the run dir, its checkpoints dir, a step dir and the HF dir alike.
    for path in (run, run / "checkpoints", run / "checkpoints" / "7", hf, tmp_path / "imported"):
        _assert_same_params(ref, _np_params(load_drafter(path, target)))


def _zlab_published(directory, *, dtype=torch.bfloat16):
    """A drafter directory written by z-lab's DFlashDraftModel.save_pretrained (bf16, sliding layers)."""
    torch.manual_seed(0)
    cfg = zlab_drafter_config(
        mask_token_id=511,
        target_layer_ids=[0, 1, 2],
        num_target_layers=4,
        block_size=16,
        intermediate_size=112,
        num_hidden_layers=3,
        head_dim=32,
        use_sliding_window=True,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    model = dm.DFlashDraftModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    model.to(dtype).save_pretrained(directory)
    return directory


def test_zlab_import_export_is_byte_identical(target, tmp_path):
    src = _zlab_published(tmp_path / "published")
    out = hf_to_drafter.import_hf(src, tmp_path / "ckpt")
    back = drafter_to_hf.export(out.parent.parent, tmp_path / "back")  # --dtype auto: bf16 as imported
    a = safetensors_numpy.load_file(src / WEIGHTS_FILE)
    b = safetensors_numpy.load_file(back / WEIGHTS_FILE)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), k

    orig, new = (json.loads((d / "config.json").read_text()) for d in (src, back))
    assert DrafterConfig.from_hf_dict(orig) == DrafterConfig.from_hf_dict(new)
    for key in (
        "architectures",
        "model_type",
        "block_size",
        "num_target_layers",
        "dflash_config",
        "layer_types",
    ):
        assert new[key] == orig[key], key
    assert new["sliding_window"] == 16 and new["use_sliding_window"] is True
    # z-lab loads the re-export and sees the same drafter
    model = dm.DFlashDraftModel.from_pretrained(back)
    assert model.target_layer_ids == [0, 1, 2] and model.block_size == 16
    assert [layer.self_attn.sliding_window for layer in model.layers] == [16, None, 16]

    # The imported checkpoint is a drafter for the tiny target and warm-starts training.
    drafter = load_drafter(tmp_path / "ckpt", target)
    assert drafter.config.block_size == 16 and drafter.config.layer_types[1] == "full_attention"


def test_speculators_export_and_import(target, target_dir, tmp_path):
    drafter = _random_drafter(
        _config(target, layer_types=("sliding_attention", "full_attention"), sliding_window=32), target, 1
    )
    run = _save_run(tmp_path / "run", drafter, target, target_path=str(target_dir))
    zl = drafter_to_hf.export(run, tmp_path / "zlab", dtype="float32")
    rc = drafter_to_hf.main(
        [
            "--checkpoint",
            str(run),
            "--out",
            str(tmp_path / "spec"),
            "--format",
            "speculators",
            "--dtype",
            "float32",
        ]
    )
    assert rc == 0
    spec = tmp_path / "spec"
    cfg = json.loads((spec / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash"
    # no --verifier: the target the checkpoint was trained against
    verifier = cfg["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(target_dir.resolve()), "architectures": ["Qwen3ForCausalLM"]}
    assert cfg["aux_hidden_state_layer_ids"] == [1, 3]  # z-lab ids + 1 (vLLM maps back with -1)
    assert cfg["mask_token_id"] == 500 and cfg["block_size"] == 8 and cfg["draft_vocab_size"] == 512
    assert cfg["sliding_window_non_causal"] is False  # z-lab rule: sliding layers causal in-block
    assert cfg["speculators_config"]["proposal_methods"] == [
        {"proposal_type": "greedy", "speculative_tokens": 7}
    ]
    tl = cfg["transformer_layer_config"]
    assert tl["model_type"] == "qwen3" and tl["num_hidden_layers"] == 2 and tl["hidden_size"] == 64
    assert tl["layer_types"] == ["sliding_attention", "full_attention"] and tl["sliding_window"] == 32
    assert cfg["layer_types"] == tl["layer_types"] and cfg["sliding_window"] == 32
    # same tensors as the z-lab export
    a, b = (safetensors_numpy.load_file(d / WEIGHTS_FILE) for d in (zl, spec))
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)

    _assert_same_params(_np_params(drafter), _np_params(load_drafter(spec, target)))
    rc = hf_to_drafter.main(["--hf", str(spec), "--out", str(tmp_path / "imp")])
    assert rc == 0
    config, params, _ = read_checkpoint(tmp_path / "imp")
    assert config == drafter.config
    _assert_same_params(_np_params(drafter), params)
    # the import keeps the verifier, so exporting it again records the same one
    again = drafter_to_hf.export(tmp_path / "imp", tmp_path / "again", fmt="speculators")
    assert json.loads((again / "config.json").read_text())["speculators_config"]["verifier"] == verifier

    # Without num_target_layers (not part of the speculators schema) the depth comes from the
    # verifier's config.json, and with no verifier either the import asks for it.
    del cfg["transformer_layer_config"]["num_target_layers"]
    (spec / "config.json").write_text(json.dumps(cfg))
    assert drafter_reader.read_hf_drafter(spec)[0] == drafter.config
    cfg["speculators_config"]["verifier"]["name_or_path"] = None
    (spec / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="--num-target-layers"):
        drafter_reader.read_hf_drafter(spec)
    config, _, _ = drafter_reader.read_hf_drafter(spec, num_target_layers=4)
    assert config == drafter.config


def test_speculators_export_needs_a_verifier(target, target_dir, tmp_path, capsys):
    drafter = _random_drafter(_config(target), target)
    run = _save_run(tmp_path / "run", drafter, target)  # target "tiny", but its directory is gone
    args = ["--checkpoint", str(run), "--format", "speculators"]
    assert drafter_to_hf.main([*args, "--out", str(tmp_path / "a")]) == 2
    assert "--verifier" in capsys.readouterr().err and not (tmp_path / "a").exists()
    assert drafter_to_hf.main([*args, "--out", str(tmp_path / "b"), "--verifier", "Qwen/Qwen3-8B"]) == 0
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"] == {"name_or_path": "Qwen/Qwen3-8B", "architectures": []}
    # a tiny-target run keeps its target under the run directory: that is the verifier
    shutil.copytree(target_dir, run / "tiny_target")
    assert drafter_to_hf.main([*args, "--out", str(tmp_path / "c")]) == 0
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str((run / "tiny_target").resolve())


def test_converter_cli_is_quiet_by_default(target, tmp_path):
    """orbax/absl log every step at INFO; a converter prints its result and warnings only."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    run = _save_run(tmp_path / "run", _random_drafter(_config(target), target), target)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    cmd = [
        sys.executable,
        "-m",
        "convert.drafter_to_hf",
        "--checkpoint",
        str(run),
        "--out",
        str(tmp_path / "hf"),
    ]
    quiet = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.strip() == str(tmp_path / "hf")
    assert "INFO" not in quiet.stderr, quiet.stderr
    loud = subprocess.run(
        [*cmd[:-1], str(tmp_path / "hf2"), "-v"],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=300,
    )
    assert loud.returncode == 0 and "exported zlab drafter" in loud.stderr


def _write_zlab_dir(directory, config, *, seed=0):
    from convert.zlab_drafter import write_zlab_drafter

    rng = np.random.default_rng(seed)
    params = unflatten({k: rng.normal(size=v).astype(np.float32) for k, v in param_shapes(config).items()})
    return write_zlab_drafter(directory, config, params, dtype="float32")


def _edit_config(directory, fn):
    cfg = json.loads((directory / "config.json").read_text())
    fn(cfg)
    (directory / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c.pop("num_attention_heads"), "missing 'num_attention_heads'"),
        (
            lambda c: c["dflash_config"].update(target_layer_ids=[0, 9]),
            r"target_layer_ids=\[0, 9\].*4-layer target",
        ),
        (
            lambda c: c.update(num_target_layers=6),
            "target_num_layers=6 does not match the target's num_layers=4",
        ),
        (lambda c: c.update(vocab_size=1000), "vocab_size=1000 does not match"),
        (lambda c: c.update(hidden_size=32), "hidden_size"),
        (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
    ],
    ids=["missing-field", "layer-ids", "target-depth", "vocab", "hidden", "mask-token"],
)
def test_bad_drafter_configs_fail_clearly(target, tmp_path, edit, match):
    d = _write_zlab_dir(tmp_path / "d", _config(target))
    _edit_config(d, edit)
    with pytest.raises(ValueError, match=match):
        load_drafter(d, target)


def test_bad_tensors_fail_clearly(target, tmp_path):
    d = _write_zlab_dir(tmp_path / "d", _config(target))
    good = (d / WEIGHTS_FILE).read_bytes()
    (d / WEIGHTS_FILE).write_bytes(good[: len(good) // 2])  # truncated download
    with pytest.raises(ValueError, match=r"model.safetensors.*truncated"):
        load_drafter(d, target)
    (d / WEIGHTS_FILE).write_bytes(b"\xff" * 64)  # not a safetensors file at all
    with pytest.raises(ValueError, match=r"model.safetensors.*corrupt safetensors header"):
        load_drafter(d, target)

    # a tensor of the wrong shape, or one the drafter does not have, is named
    t = dict(safetensors_numpy.load_file(_write_zlab_dir(tmp_path / "e", _config(target)) / WEIGHTS_FILE))
    t["layers.0.mlp.up_proj.weight"] = t["layers.0.mlp.up_proj.weight"][:, :10]
    safetensors_numpy.save_file(t, tmp_path / "e" / WEIGHTS_FILE)
    with pytest.raises(ValueError, match=r"'layers\.0\.mlp\.up_proj\.weight' has shape \(112, 10\)"):
        load_drafter(tmp_path / "e", target)
    t = dict(safetensors_numpy.load_file(_write_zlab_dir(tmp_path / "f", _config(target)) / WEIGHTS_FILE))
    t["embed_tokens.weight"] = np.zeros((512, 64), np.float32)
    safetensors_numpy.save_file(t, tmp_path / "f" / WEIGHTS_FILE)
    with pytest.raises(ValueError, match=r"unexpected tensors: embed_tokens\.weight"):
        load_drafter(tmp_path / "f", target)


def test_checkpoint_errors_and_cli(target, tmp_path, capsys):
    drafter = _random_drafter(_config(target), target)
    run = _save_run(tmp_path / "run", drafter, target, step=3)
    with pytest.raises(CheckpointError, match=r"no step 5 .*available steps: \[3\]"):
        read_checkpoint(run, step=5)
    assert drafter_to_hf.main(["--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint steps"):
        resolve_checkpoint(empty)
    # importing twice into the same place refuses to overwrite
    hf = drafter_to_hf.export(run, tmp_path / "hf")
    hf_to_drafter.import_hf(hf, tmp_path / "imp")
    assert hf_to_drafter.main(["--hf", str(hf), "--out", str(tmp_path / "imp")]) == 2
    assert "already exists" in capsys.readouterr().err
    # default export dtype of a trained (fp32) checkpoint is bf16, what published drafters use
    assert str(safetensors_numpy.load_file(hf / WEIGHTS_FILE)["fc.weight"].dtype) == "bfloat16"
    shutil.rmtree(tmp_path / "imp")
