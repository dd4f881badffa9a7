"""The documentation's own checks: links resolve, the first screen holds the two commands.

Fast and without jax: reads the tracked Markdown files only.
"""

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent

TRAIN_CMD = "bash scripts/setup.sh && .venv/bin/python -m dflash_jax.train"
TEST_CMD = "bash scripts/setup.sh && .venv/bin/python -m pytest -q"

# [text](target) and [text](target "title"); images too.
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# reference-style definitions: [name]: target
REF_DEF = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")


def _markdown_files():
    try:
        out = subprocess.run(
            ["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        files = [ROOT / line for line in out.splitlines() if line.strip()]
    except (OSError, subprocess.CalledProcessError):
        files = sorted(p for p in ROOT.rglob("*.md") if ".venv" not in p.parts and ".git" not in p.parts)
    return [f for f in files if f.is_file()]


def _links(text):
    """Yield (line number, link target) for every inline or reference link outside code fences."""
    fence = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
            continue
        if fence:
            continue
        for match in LINK.finditer(line):
            yield number, match.group(1)
        ref = REF_DEF.match(line)
        if ref:
            yield number, ref.group(1)


def _is_external(target):
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target)) or target.startswith("#")


def test_there_are_markdown_files():
    names = {f.relative_to(ROOT).as_posix() for f in _markdown_files()}
    assert "README.md" in names, names


def test_relative_links_resolve_inside_the_repository():
    problems = []
    root = ROOT.resolve()
    for path in _markdown_files():
        rel = path.relative_to(ROOT).as_posix()
        for number, target in _links(path.read_text(encoding="utf-8")):
            if _is_external(target):
                continue
            local = target.split("#", 1)[0].split("?", 1)[0]
            if not local:
                continue
            resolved = (root / local.lstrip("/")) if local.startswith("/") else (path.parent / local)
            resolved = resolved.resolve()
            if resolved != root and root not in resolved.parents:
                problems.append(f"{rel}:{number}: link {target!r} leaves the repository")
            elif not resolved.exists():
                problems.append(f"{rel}:{number}: link {target!r} does not resolve ({resolved})")
    assert not problems, "\n".join(problems)


def test_no_markdown_file_points_outside_at_shared():
    problems = []
    for path in _markdown_files():
        rel = path.relative_to(ROOT).as_posix()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if "../shared" in line:
                problems.append(f"{rel}:{number}: mentions '../shared': {line.strip()[:120]}")
    assert not problems, "\n".join(problems)


def test_readme_first_screen():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:25]
    head = "\n".join(lines)
    missing = []
    for cmd in (TRAIN_CMD, TEST_CMD):
        if not any(line.strip() == cmd for line in lines):
            missing.append(f"README.md:1-25: the command line {cmd!r} (alone on its line)")
    for word in ("DFlash", "speculative decoding"):
        if word not in head:
            missing.append(f"README.md:1-25: the words {word!r}")
    assert not missing, "missing from the first 25 lines:\n" + "\n".join(missing)


def test_benchmarks_stays_short():
    path = ROOT / "BENCHMARKS.md"
    count = len(path.read_text(encoding="utf-8").splitlines())
    assert count < 400, (
        f"BENCHMARKS.md: {count} lines (must be fewer than 400: move history to docs/experiments.md)"
    )
