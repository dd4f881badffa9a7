"""Build the offline feature cache: ``python -m dflash_jax.features --config CONFIG [key=value ...] --out DIR``.

Runs the frozen target once (jit, on the run's mesh) over one epoch of the run's packed training
rows and stores per row the drafter's tapped features, the labels (``train.loss: ce``: the target's
argmax per position; ``kl``: the final normed hidden state) and the row arrays. A run with
``data.features: DIR`` then trains without running the target. The format, and the check that a
cache matches its run, live in ``dflash_jax/training/feature_cache.py``.

The config is resolved exactly as ``python -m dflash_jax.train`` resolves it (target, tokenizer,
regenerated data, drafter taps): build the cache with the config (and overrides) you train with.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

from dflash_jax.cli import cli
from dflash_jax.config_io import ConfigError
from dflash_jax.training.run_config import RunConfig, load_run_config

log = logging.getLogger("dflash_jax.features")


def build(
    cfg: RunConfig,
    out: str | Path,
    *,
    dtype: str | None = None,
    rows_per_shard: int = 256,
    overwrite: bool = False,
    quiet: bool = False,
) -> dict:
    """Write the cache of ``cfg``'s training rows to ``out``; returns its manifest.

    ``dtype``: the stored dtype of features (and hidden states); None keeps the dtype the target
    computes them in (exact). ``rows_per_shard`` is rounded up to whole batches."""
    import jax
    import numpy as np
    from flax import nnx
    from tqdm import tqdm
    from transformers import AutoTokenizer

    import dflash_jax
    from dflash_jax.data.pipeline import to_global_batch
    from dflash_jax.data.shards import ShardedBatchIterator, resolve_num_shards
    from dflash_jax.dtypes import to_dtype
    from dflash_jax.sharding import BATCH_AXES, logical_sharding, make_mesh
    from dflash_jax.training import feature_cache, setup
    from dflash_jax.training.loss import target_argmax
    from dflash_jax.training.regen_cache import data_configs, regenerated_data
    from dflash_jax.training.step import target_pass

    t0 = time.perf_counter()
    if jax.process_count() > 1:
        raise ConfigError(
            "python -m dflash_jax.features runs on one process (its mesh may span that host's devices)"
        )
    if Path(out).expanduser().exists() and not overwrite:  # before anything is loaded
        raise feature_cache.FeatureCacheError(
            f"{out} already exists: pass --overwrite to replace it, or choose another --out"
        )
    if cfg.data.features:
        log.info("data.features=%s is ignored while building a cache", cfg.data.features)
    setup.check_data_sources(cfg)
    # Built online, whatever data.features says: the shards' layout applies.
    online = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, features=None))
    setup.check_layout(online, jax.device_count(), 1)
    mesh = make_mesh(cfg.mesh)
    # The same target the trainer resolves (a tiny one is made under output_dir, as by train).
    target_dir, tok_dir = setup.resolve_target(cfg, Path(cfg.output_dir).expanduser().resolve())
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    target = dflash_jax.load_target(target_dir, dtype=cfg.target.dtype, mesh=mesh)
    data_cfg = cfg.data
    if cfg.regen.enabled:
        data_cfg, _ = data_configs(cfg, *regenerated_data(cfg, target, tokenizer, target_dir))
    warm = cfg.drafter.init_from
    source = setup.load_warm_start(warm, target) if warm else None
    dcfg = setup.build_drafter_config(
        cfg, target, tokenizer, source=None if source is None else source.config, source_path=warm
    )
    del source
    taps = tuple(dcfg.target_layer_ids)
    identity = feature_cache.run_identity(cfg, data_cfg, target_dir, tokenizer, taps)
    writer = feature_cache.CacheWriter(
        out,
        rows_per_shard=-(-rows_per_shard // data_cfg.batch_size) * data_cfg.batch_size,
        overwrite=overwrite,
    )
    one_epoch = dataclasses.replace(data_cfg, num_epochs=1, features=None)
    rows = ShardedBatchIterator(one_epoch, tokenizer, num_shards=resolve_num_shards(cfg.data.shards, 1))
    kind, loss_chunk = cfg.train.loss, cfg.train.loss_chunk
    label_dtype = to_dtype(cfg.train.compute_dtype)

    @nnx.jit
    def target_outputs(target, batch):
        features, hidden = target_pass(target, batch, taps)
        if kind == "ce":  # the same argmax the step takes online (training/step.py block_loss)
            labels = target_argmax(
                hidden, target.lm_head_weight(), chunk=loss_chunk, compute_dtype=label_dtype
            )
            return {"features": features, "labels": labels}
        return {"features": features, "hidden": hidden}

    sharding = logical_sharding(mesh, BATCH_AXES)
    stored = None if dtype is None else to_dtype(dtype)
    computed: dict[str, str] = {}
    bar = tqdm(desc=f"features -> {writer.out.name}", unit="row", disable=quiet)
    try:
        with jax.set_mesh(mesh):
            for batch in rows:
                outputs = jax.device_get(target_outputs(target, to_global_batch(batch, sharding)))
                record = {k: np.asarray(batch[k], np.int32) for k in feature_cache.ROW_ARRAYS}
                for name, value in outputs.items():
                    value = np.asarray(value)
                    computed[name] = feature_cache.dtype_name(value.dtype)
                    if stored is not None and name != "labels":
                        value = value.astype(stored)
                    record[name] = value
                writer.add(record)
                bar.update(len(batch["input_ids"]))
        manifest = writer.finish(
            {
                "identity": identity,
                "batch_size": data_cfg.batch_size,
                "seq_len": data_cfg.max_length,
                "computed_dtypes": computed,
                "target_dir": str(target_dir),
                "config": cfg.to_dict(),
                "build_seconds": round(time.perf_counter() - t0, 3),
            }
        )
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
        rows.close()
    result = json.loads((manifest / feature_cache.MANIFEST).read_text())
    total = sum(e["bytes"] for s in result["shards"] for e in s["files"].values())
    log.info(
        "wrote %s: %d rows in %d shards, %.1f MB (%.2f MB per row) in %.1f s",
        *(manifest, result["rows"], len(result["shards"]), total / 1e6, total / 1e6 / result["rows"]),
        result["build_seconds"],
    )
    return result


@cli
def main(argv: list[str] | None = None) -> int:
    from dflash_jax import distributed
    from dflash_jax.dtypes import DTYPE_NAMES
    from dflash_jax.training.run_config import shipped_configs

    p = argparse.ArgumentParser(prog="python -m dflash_jax.features", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config",
        default="demo",
        help=f"a YAML path or a shipped config: {', '.join(shipped_configs())} (default: demo)",
    )
    p.add_argument(
        "--out",
        required=True,
        help="the cache directory to write (written to a temporary sibling, then renamed)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default=None,
        help="stored dtype of the features (default: the dtype the target computes them in, exact)",
    )
    p.add_argument(
        "--rows-per-shard", type=int, default=256, help="rows per shard file (rounded up to whole batches)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing cache at --out")
    p.add_argument("--quiet", action="store_true")
    p.add_argument(
        "overrides", nargs="*", help="key=value overrides of the run config, e.g. data.max_records=100"
    )
    args = p.parse_intermixed_args(argv)  # key=value overrides may come before or after flags
    if args.rows_per_shard < 1:
        p.error("--rows-per-shard must be >= 1")
    distributed.configure_logging()
    cfg = load_run_config(args.config, args.overrides)
    manifest = build(
        cfg,
        args.out,
        dtype=args.dtype,
        rows_per_shard=args.rows_per_shard,
        overwrite=args.overwrite,
        quiet=args.quiet,
    )
    print(f"wrote {manifest['rows']} rows to {Path(args.out).expanduser().resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
