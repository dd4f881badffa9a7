"""AOT memory plans and the mesh experiment: abstract parameters only, no weight allocated."""

from __future__ import annotations

import csv

import jax
import pytest

from dflash_jax.config_io import ConfigError
from dflash_jax.sharding import MeshConfig
from dflash_jax.tools import plan
from dflash_jax.tools.mesh_experiment import main as mesh_experiment_main
from dflash_jax.training.run_config import load_run_config

TINY_ARCH = (
    "target.architecture={model_type: qwen3, vocab_size: 1024, hidden_size: 128, intermediate_size: 256,"
    " num_hidden_layers: 2, num_attention_heads: 8, num_key_value_heads: 4, head_dim: 32}"
)
TINY_OVERRIDES = [
    TINY_ARCH,
    "drafter.num_layers=1",
    "drafter.mask_token_id=1000",
    "drafter.target_layer_ids=null",
    "train.loss_chunk=64",
]


def qwen3_8b_param_count() -> tuple[int, int]:
    """(target, drafter) parameter counts of Qwen3-8B and its 5-layer DFlash drafter, by hand."""
    V, D, L, N, K, H, F = 151936, 4096, 36, 32, 8, 128, 12288
    attn = D * N * H + 2 * D * K * H + N * H * D + 2 * H  # q, k, v, o, q_norm, k_norm
    layer = attn + 3 * D * F + 2 * D  # + gate, up, down, two norms
    target = 2 * V * D + L * layer + D  # embed, untied lm_head, layers, final norm
    drafter = 5 * D * D + 5 * layer + 2 * D  # fc over 5 taps, 5 layers, hidden_norm + norm
    return target, drafter


@pytest.mark.parametrize("layout", ["fsdp=8", "tensor=8", "data=2,fsdp=4"])
def test_per_device_parameter_bytes_match_analytic_count(layout):
    """Real Qwen3-8B shapes (abstract: nothing allocated): bytes per device = params x bytes / shards."""
    spec = plan.spec_for_run(load_run_config("qwen3-8b"))
    mesh_cfg = plan.parse_layout(layout)
    sizes = plan.check_layout(mesh_cfg, spec, 8)
    from dflash_jax.sharding import make_mesh

    mesh = make_mesh(MeshConfig(*sizes))
    shards = sizes[1] * sizes[2]  # parameters shard over fsdp and tensor, replicate over data
    _, t_state = plan.abstract_target(spec, mesh)
    _, d_state = plan.abstract_drafter_and_optimizer(spec, mesh)
    n_target, n_drafter = qwen3_8b_param_count()
    got_target = plan.per_device_bytes(t_state)
    got_drafter = plan.per_device_bytes(d_state[0])
    assert got_target == pytest.approx(n_target * 2 / shards, rel=0.05)  # bfloat16
    assert got_drafter == pytest.approx(n_drafter * 4 / shards, rel=0.05)  # fp32 master weights
    # AdamW: mu and nu, fp32, sharded like the parameters.
    assert plan.per_device_bytes(d_state) - got_drafter == pytest.approx(2 * n_drafter * 4 / shards, rel=0.05)


@pytest.mark.parametrize(
    "layout,devices,words",
    [
        ("tensor=3", 8, ["tensor=3", "num_heads"]),
        ("tensor=16", 16, ["tensor=16", "num_kv_heads"]),
        ("fsdp=3", 8, ["fsdp=3", "hidden_size"]),
        ("data=16", 8, ["16 devices", "only 8"]),
        ("data=2,tensor=8", 8, ["16 devices", "only 8"]),
    ],
)
def test_impossible_layouts_name_the_dimension_and_axis(layout, devices, words):
    spec = plan.spec_for_run(load_run_config("qwen3-8b"))
    with pytest.raises(plan.LayoutError) as e:
        plan.check_layout(plan.parse_layout(layout), spec, devices)
    for w in words:
        assert w in str(e.value)


def test_layout_syntax_and_training_config_accept_it():
    assert MeshConfig.from_string("data=2,tensor=4") == MeshConfig(data=2, fsdp=1, tensor=4)
    assert MeshConfig.from_string("fsdp=8") == MeshConfig(data=1, fsdp=8, tensor=1)
    with pytest.raises(ValueError, match="dta"):
        MeshConfig.from_string("dta=2")
    cfg = load_run_config("tiny", ["mesh=data=2,tensor=4"])
    assert cfg.mesh == MeshConfig(data=2, fsdp=1, tensor=4)
    with pytest.raises(ConfigError, match="mesh"):
        load_run_config("tiny", ["mesh=data=two"])


def test_mesh_experiment_reduced_config_three_layouts(tmp_path, capsys):
    """The CLI end to end on a reduced Qwen3 config: table, CSV, PNG, an impossible layout row,
    a flagged layout, and compiled per-device numbers that agree with the abstract ones."""
    out = tmp_path / "mx"
    rc = mesh_experiment_main(
        [
            "--config", "qwen3-8b", "--devices", "8", "--seq-len", "128", "--batch", "8", "--anchors", "8",
            "--layouts", "data=8", "fsdp=8", "data=2,tensor=4", "tensor=8",
            "--device-memory", "8MB", "--out", str(out), *TINY_OVERRIDES,
        ]
    )  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0
    assert "tensor=8 does not divide num_kv_heads (target)=4" in text
    rows = {r["layout"]: r for r in csv.DictReader(open(out / "layouts.csv"))}
    assert set(rows) == {"data=8", "fsdp=8", "data=2,tensor=4", "tensor=8"}
    assert (out / "layouts.png").stat().st_size > 1000
    full, sharded = rows["data=8"], rows["fsdp=8"]
    # fsdp=8 holds 1/8 of the target's weights per device; data=8 replicates them.
    assert int(full["target_param_bytes"]) == pytest.approx(8 * int(sharded["target_param_bytes"]), rel=0.05)
    for name in ("data=8", "fsdp=8", "data=2,tensor=4"):
        r = rows[name]
        held = sum(int(r[k]) for k in ("target_param_bytes", "drafter_param_bytes", "optimizer_bytes"))
        # The compiled step's arguments are exactly those states plus the batch and the key.
        assert held <= int(r["train_argument_bytes"]) <= held + 4 * 8 * 128 * 4 + 64
        assert int(r["train_temp_bytes"]) > 0 and float(r["flops"]) > 0
    # Data parallel all-reduces gradients; fsdp gathers weights.
    assert "all-reduce" in rows["data=8"]["collectives"]
    assert "all-gather" in rows["fsdp=8"]["collectives"]
    # 8 MB per device: replicated data=8 does not fit, fsdp=8 does, and is named.
    assert rows["data=8"]["fits"] == "False" and rows["fsdp=8"]["fits"] == "True"
    assert "best layout that fits:" in text and "| data=8 |" in text


MX_ARGS = ["--config", "qwen3-8b", "--devices", "8", "--seq-len", "128", "--batch", "8", "--anchors", "8"]


def test_mesh_experiment_records_a_failed_layout_and_goes_on(tmp_path, capsys, monkeypatch):
    """One layout's compile runs out of device memory: its row says so, the others are planned,
    and the table and CSV are written."""
    real = plan.compile_layout

    def compile_layout(spec, layout, devices=None, **kw):
        if layout == MeshConfig.from_string("fsdp=8"):
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.20GiB.\nBufferAssignment: ..."
            )
        return real(spec, layout, devices, **kw)

    monkeypatch.setattr(plan, "compile_layout", compile_layout)
    out = tmp_path / "mx"
    rc = mesh_experiment_main([*MX_ARGS, "--layouts", "data=8", "fsdp=8", "data=2,tensor=4", "--out", str(out),
                               *TINY_OVERRIDES])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0
    rows = {r["layout"]: r for r in csv.DictReader(open(out / "layouts.csv"))}
    assert list(rows) == ["data=8", "fsdp=8", "data=2,tensor=4"]
    failed = rows["fsdp=8"]
    assert failed["status"] == "out of memory" and failed["flops"] == ""
    assert failed["error"].startswith("JaxRuntimeError: RESOURCE_EXHAUSTED") and "\n" not in failed["error"]
    for name in ("data=8", "data=2,tensor=4"):
        assert rows[name]["status"] == "planned" and float(rows[name]["flops"]) > 0
    assert "| fsdp=8 | out of memory: JaxRuntimeError: RESOURCE_EXHAUSTED" in text
    assert "best layout that fits:" in text and (out / "layouts.png").exists()


# slow: ~80 s on 2 cores; a failed layout that does not stop the table is checked in the suite
@pytest.mark.slow
def test_mesh_experiment_measures_only_layouts_that_fit(tmp_path, capsys, monkeypatch):
    """With --measure, a layout over the memory is not run, a run that raises is recorded with
    its plan's numbers, and the one measured is named the best."""
    measured = []

    def measure_layout(c, steps):
        measured.append(c.plan.layout)
        if c.plan.layout == "fsdp=4,tensor=2":
            raise RuntimeError("INTERNAL: the run broke")
        c.plan.step_seconds, c.plan.tokens_per_second = 0.5, 2048.0
        return c.plan

    monkeypatch.setattr(plan, "measure_layout", measure_layout)
    out = tmp_path / "mx"
    rc = mesh_experiment_main([*MX_ARGS, "--layouts", "data=8", "fsdp=8", "fsdp=4,tensor=2", "--measure", "1",
                               "--device-memory", "9MB", "--out", str(out), *TINY_OVERRIDES])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0
    rows = {r["layout"]: r for r in csv.DictReader(open(out / "layouts.csv"))}
    assert sorted(measured) == sorted(k for k, r in rows.items() if r["fits"] == "True")
    assert rows["data=8"]["fits"] == "False" and rows["data=8"]["status"] == "does not fit"
    # 9 MB holds a step with the target's weights sharded (about 7 MB), not replicated (about 11 MB).
    assert "data=8" not in measured and "fsdp=4,tensor=2" in measured
    broke = rows["fsdp=4,tensor=2"]
    assert broke["status"] == "run failed" and "the run broke" in broke["error"]
    assert float(broke["flops"]) > 0 and broke["step_seconds"] == ""
    assert rows["fsdp=8"]["status"] == "measured" and float(rows["fsdp=8"]["step_seconds"]) == 0.5
    assert "best layout that fits: fsdp=8" in text and "measured 0.500 s/step" in text


def test_preflight_tells_the_pool_setting_when_the_card_would_hold_the_step(capsys, monkeypatch):
    """GPU numbers injected into a CPU plan: over jax's pool but within the card -> exit 3 with the
    XLA_CLIENT_MEM_FRACTION that fits; within the pool -> the plan passes as before."""
    from dflash_jax.train import main as train_main

    for name in (plan.FRACTION_VARIABLE, plan.DEPRECATED_FRACTION_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    args = ["--config", "qwen3-8b", "--plan", *TINY_OVERRIDES, "mesh=data=2,tensor=4", "data.max_length=64",
            "data.batch_size=4", "train.max_anchors=4"]  # fmt: skip
    card = 8 * 2**30
    monkeypatch.setattr(plan, "physical_memory", lambda devices: card)
    monkeypatch.setattr(plan, "device_memory_limit", lambda devices: 2**20)  # 1 MiB: below the step
    assert train_main(args) == 3
    err = capsys.readouterr().err
    assert "jax's pool has 0.00 GiB" in err
    setting = next(w for w in err.replace("`", " ").split() if w.startswith("XLA_CLIENT_MEM_FRACTION="))
    fraction = float(setting.split("=")[1])
    assert 0 < fraction <= plan.MAX_POOL_FRACTION and fraction * card >= plan.POOL_HEADROOM_MIN

    monkeypatch.setattr(plan, "device_memory_limit", lambda devices: 4 * 2**30)
    assert train_main(args) == 0
    out = capsys.readouterr().out
    assert "jax's pool 4.00 GiB, 50% of the card's 8.00 GiB" in out


def test_train_plan_on_the_default_config(capsys):
    """``train --plan`` on the embedded default: the run's own parts (SmolLM2 from its config.json,
    the draft vocabulary, cached features) planned on abstract weights."""
    from dflash_jax.train import main as train_main

    assert train_main(["--plan", "mesh.num_devices=1"]) == 0  # the demo's batch of 4 rows on one CPU device
    out = capsys.readouterr().out
    assert "plan for layout data=1 on 1 devices" in out, out
    assert "(none: features from the cache)" in out  # demo trains from data.features: auto
    for what in ("target params", "drafter params", "optimizer", "step peak"):
        assert what in out


def test_train_plan_describes_a_tiny_target_from_its_section(capsys):
    from dflash_jax.train import main as train_main

    assert train_main(["--config", "tiny", "--plan"]) == 0
    assert "plan for layout data=8 on 8 devices" in capsys.readouterr().out


def test_conftest_gives_eight_devices():
    assert len(jax.devices()) >= 8


def test_train_plan_refuses_a_config_that_cannot_fit(capsys):
    """--plan compiles the run's own step on abstract weights: the target directory of this config
    does not exist, so any attempt to read a weight would fail with a different error."""
    from dflash_jax.train import main as train_main

    rc = train_main(["--config", "qwen3-8b", "--plan", "--device-memory", "1MB", *TINY_OVERRIDES,
                     "mesh=data=2,tensor=4", "data.max_length=64", "data.batch_size=4", "train.max_anchors=4"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 3
    assert "layout data=2,tensor=4 on 8 devices" in err
    for what in ("target params", "drafter params", "optimizer", "step peak", "GiB per device but"):
        assert what in err


@pytest.mark.slow
def test_train_run_refuses_before_loading_the_target(tmp_path, capsys):
    """The pre-flight plan reads only the target dir's config.json: it has no weights at all, so a
    run that loaded one would fail with another error."""
    import json

    from dflash_jax.train import main as train_main

    target = tmp_path / "target"
    target.mkdir()
    arch = {"model_type": "qwen3", "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32}  # fmt: skip
    (target / "config.json").write_text(json.dumps(arch))
    overrides = [o for o in TINY_OVERRIDES if not o.startswith("target.architecture")]
    # qwen3-8b.yaml's own architecture would disagree with this config.json (a ConfigError, exit 2)
    rc = train_main(["--config", "qwen3-8b", "--device-memory", "1MB", *overrides, "target.architecture=null",
                     f"target.path={target}",
                     f"target.tokenizer={target}", f"output_dir={tmp_path / 'run'}", "data.sources=[sharegpt]",
                     "data.max_length=64", "data.batch_size=4", "train.max_anchors=4"])  # fmt: skip
    assert rc == 3
    assert "does not fit, nothing loaded" in capsys.readouterr().err


def test_hlo_stats_multiply_loop_bodies_by_their_trip_count():
    """XLA's cost_analysis counts a scan body once; hlo_stats counts it as often as it runs."""
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from dflash_jax.tools import hlo_stats

    mesh = jax.make_mesh(
        (2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:8]
    )

    def f(x, w):
        def body(c, wi):
            return jnp.tanh(c @ wi), None

        return jax.lax.scan(body, x, w)[0].sum()

    x = jax.ShapeDtypeStruct(
        (128, 256), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("data", None))
    )
    w = jax.ShapeDtypeStruct(
        (10, 256, 256), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec(None, None, "tensor"))
    )
    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(f, argnums=1)).lower(x, w).compile()
    stats = hlo_stats.analyze(compiled.as_text())
    # forward + two backward matmuls per layer, 10 layers, split over 8 devices
    assert stats.matmul_flops == 3 * 2 * 128 * 256 * 256 * 10 / 8
    assert stats.unknown_trip_loops == 0
    count, nbytes = stats.collectives["all-gather"]
    assert count % 10 == 0 and nbytes > 0  # gathered inside the layer loop: once per layer


@pytest.mark.parametrize("loss", ["ce", "kl"])
def test_plan_of_a_feature_cache_run_has_no_target_forward(loss):
    """``data.features``: the planned step reads features and labels (and, under kl, hidden states)
    from the batch: the batch arguments grow by exactly those arrays and the target's layers run no
    matmul."""
    overrides = [*TINY_OVERRIDES, "data.max_length=64", "data.batch_size=8", "train.max_anchors=4",
                 f"train.loss={loss}", "target.dtype=float32"]  # fmt: skip
    online = plan.spec_for_run(load_run_config("qwen3-8b", overrides))
    cached = plan.spec_for_run(load_run_config("qwen3-8b", [*overrides, "data.features=/nowhere"]))
    assert cached.cached_features and not online.cached_features
    layout = plan.parse_layout("data=2,fsdp=4")
    p_online, p_cached = plan.plan_layout(online, layout), plan.plan_layout(cached, layout)
    assert p_online.target_temp_bytes > 0 and p_cached.target_temp_bytes == 0
    R, T, H, taps = 8, 64, 128, len(cached.drafter_config.target_layer_ids)
    per_row_token = taps * H * 4 + 4 + (H * 4 if loss == "kl" else 0)  # features, labels, kl: hidden (f32)
    extra = p_cached.train_argument_bytes - p_online.train_argument_bytes
    assert extra == R * T * per_row_token // 8  # rows over data x fsdp = 8 devices
    # The online step also runs the 2-layer target: its matmul FLOPs are strictly more.
    assert p_cached.flops < p_online.flops
    assert "none: features from the cache" in plan.describe(p_cached, None)
