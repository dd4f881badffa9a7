"""The wheel's contents: every package of the tree is listed in pyproject.toml (the list is explicit
because the run configs are mapped from the repo's configs/ into dflash_jax/configs), and the shipped
configs are found by name both from the source tree and from a built wheel."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _packages_in_tree() -> set[str]:
    found = set()
    for top in ("dflash_jax", "convert", "pallas_kernels"):
        for init in (ROOT / top).rglob("__init__.py"):
            found.add(".".join(init.parent.relative_to(ROOT).parts))
    return found


def test_every_package_is_listed_for_the_wheel():
    listed = set(PYPROJECT["packages"])
    assert _packages_in_tree() | {"dflash_jax.configs"} == listed
    assert PYPROJECT["package-dir"] == {"dflash_jax.configs": "configs"}


def test_the_shipped_configs_are_found_in_the_source_tree():
    from dflash_jax.training.run_config import load_run_config, shipped_configs

    on_disk = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
    assert shipped_configs() == on_disk
    assert {"demo", "tiny"} <= set(on_disk)
    assert load_run_config("tiny").target.path == "tiny"


@pytest.mark.slow
def test_the_wheel_ships_the_configs_inside_the_package(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"dflash_jax/configs/{p.name}" for p in (ROOT / "configs").glob("*.yaml")}
    assert expected <= names
    assert not any(n.startswith("configs/") for n in names)
