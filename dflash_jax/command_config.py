"""The config of a command that works on a run (``eval``, ``regenerate``): the run's config plus
the command's own options, in one vocabulary of ``section.key=value`` overrides.

``--config`` names a shipped config (``demo``, ``tiny``, ...), a YAML file, or a run directory
(the ``config.json`` that ``python -m dflash_jax.train`` saved there). The command's options live
in one section of the run config, beside the run's own keys of that section: ``eval.num_prompts``
(the run's) and ``eval.batch_size`` (the evaluator's) are both ``eval.*``. A key that is neither
is an error naming it and listing the valid ones. Flags remain only for what is not
configuration: output paths and ``--overwrite``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from dflash_jax.config_io import ConfigError, apply_overrides, from_dict, load_yaml
from dflash_jax.training.run_config import RunConfig, shipped_config_dir, shipped_configs

# What ``python -m dflash_jax.train`` writes into a run directory besides the config's own keys.
_RESOLVED_KEYS = ("drafter_config", "target_dir")


@dataclass(frozen=True)
class CommandConfig:
    """``run``: the run config; ``options``: the command's section; ``run_dir``: the run directory
    the config came from (``--config DIR``), else the run config's ``output_dir``."""

    run: RunConfig
    options: Any
    run_dir: Path


def _config_data(name_or_path: str) -> tuple[dict, Path | None]:
    """(the config mapping, the run directory it was saved in, if any)."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        saved = p / "config.json"
        if not saved.is_file():
            raise ConfigError(
                f"--config {name_or_path}: a directory without config.json (a run directory of "
                "python -m dflash_jax.train has one), or give a YAML path or a shipped config name"
            )
        try:
            data = json.loads(saved.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{saved}: invalid JSON ({e})") from e
        data = {k: v for k, v in data.items() if k not in _RESOLVED_KEYS}
        # The directory given is the run's, wherever output_dir pointed when it was trained.
        return {**data, "output_dir": str(p)}, p
    if p.is_file():
        return load_yaml(p), None
    name = name_or_path.removesuffix(".yaml")
    if name not in shipped_configs():
        raise ConfigError(
            f"config {name_or_path!r} not found (a run directory, a YAML path, or one of: "
            f"{', '.join(shipped_configs())})"
        )
    with resources.as_file(shipped_config_dir() / f"{name}.yaml") as path:
        return load_yaml(path), None


def option_keys(options_cls) -> set[str]:
    return {f.name for f in dataclasses.fields(options_cls)}


def run_section_keys(section: str) -> set[str]:
    field = next(f for f in dataclasses.fields(RunConfig) if f.name == section)
    return {f.name for f in dataclasses.fields(field.default_factory)}


def load_command_config(
    name_or_path: str, overrides: list[str] | tuple[str, ...], section: str, options_cls
) -> CommandConfig:
    """The run config of ``name_or_path`` plus ``overrides``, with the keys of ``section`` that
    ``options_cls`` defines taken out as the command's options (validated by ``options_cls``)."""
    data, run_dir = _config_data(name_or_path)
    data = apply_overrides(data, list(overrides))
    mine, theirs = option_keys(options_cls), run_section_keys(section)
    assert not mine & theirs, f"{options_cls.__name__} redefines {section}.{sorted(mine & theirs)}"
    given = data.get(section) or {}
    if not isinstance(given, dict):
        raise ConfigError(f"{section}: expected a mapping, got {given!r}")
    unknown = sorted(set(given) - mine - theirs)
    if unknown:
        raise ConfigError(
            f"unknown keys {[f'{section}.{k}' for k in unknown]}; valid {section}.* keys: "
            f"{', '.join(sorted(mine | theirs))}"
        )
    options = from_dict(options_cls, {k: v for k, v in given.items() if k in mine}, section)
    data = {**data, section: {k: v for k, v in given.items() if k in theirs}}
    run = from_dict(RunConfig, data)
    return CommandConfig(run=run, options=options, run_dir=run_dir or Path(run.output_dir).expanduser())


def reject_old_flags(argv: list[str], renamed: dict[str, str], prog: str) -> None:
    """An old flag of ``prog`` is an error naming its new spelling (``renamed``: flag -> override)."""
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in renamed:
            raise ConfigError(
                f"{flag} is gone: {prog} takes --config NAME|YAML|RUN_DIR and key=value overrides; "
                f"write {renamed[flag]}"
            )


def parse_command(
    argv: list[str] | None,
    *,
    prog: str,
    description: str,
    renamed: dict[str, str],
    section: str,
    options_cls,
    add_flags,
    example: str,
):
    """The one command-line style of eval and regenerate: ``--config NAME|YAML|RUN_DIR``, the
    command's own flags (``add_flags(parser)``: what is not configuration) and ``key=value``
    overrides in any order; an old flag fails naming its new spelling. -> (argparse namespace,
    :class:`CommandConfig` with ``section``'s options as ``options_cls``)."""
    import argparse
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    reject_old_flags(argv, renamed, prog)
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", default="demo", help="a shipped config name, a YAML path or a run directory")
    add_flags(p)
    p.add_argument("overrides", nargs="*", help=f"key=value overrides, e.g. {example}")
    args = p.parse_intermixed_args(argv)  # key=value overrides may come before or after flags
    return args, load_command_config(args.config, args.overrides, section, options_cls)
