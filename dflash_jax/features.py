"""Build the offline feature cache: ``python -m dflash_jax.features --config CONFIG [key=value ...] --out DIR``.

Runs the frozen target once (jit, on the run's mesh) over one epoch of the run's packed training
rows and stores per row the drafter's tapped features, the labels (the target's argmax per
position; with ``train.loss: kl`` also the final normed hidden state) and the row arrays. A run with
``data.features: DIR`` then trains without running the target. The format, and the check that a
cache matches its run, live in ``dflash_jax/training/feature_cache.py``.

The config is resolved exactly as ``python -m dflash_jax.train`` resolves it (target, tokenizer,
regenerated data, drafter taps): build the cache with the config (and overrides) you train with.
Before it writes, the build checks that the disk of ``--out`` holds the cache (rows x the bytes a
row stores; ``train --plan`` prints the same estimate) and refuses, naming both sizes, if not.
"""

from __future__ import annotations

import argparse
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

    from dflash_jax.sharding import make_mesh
    from dflash_jax.training import feature_cache
    from dflash_jax.training.assembly import assemble, load_parts

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
    # The same parts the trainer resolves (a tiny target is made under output_dir, as by train);
    # built online, whatever data.features says: the shards' layout applies.
    parts = assemble(cfg, building_features=True)
    mesh = make_mesh(cfg.mesh)
    parts = load_parts(cfg, parts, mesh=mesh)
    manifest = feature_cache.write_cache(
        cfg,
        parts.data,
        parts.target,
        parts.tokenizer,
        parts.target_dir,
        tuple(parts.drafter_config.target_layer_ids),
        out,
        mesh=mesh,
        dtype=dtype,
        rows_per_shard=rows_per_shard,
        overwrite=overwrite,
        quiet=quiet,
        started=t0,
    )
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
