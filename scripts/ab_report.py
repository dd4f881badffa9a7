"""Table of an A/B's runs (steps, s/step, held-out tau with its spread) and paired differences.

  python scripts/ab_report.py OUT NAME=LABEL ... [--pair X-Y ...]

OUT/NAME/metrics.jsonl is the run's training log, OUT/NAME-eval.json its `dflash_jax.eval` report.
Paired over the same prompts, the prompt-to-prompt spread cancels.
"""

import argparse
import json
from pathlib import Path

import numpy as np


def per_prompt_tau(report: dict) -> dict[str, float]:
    return {
        r["id"]: float(np.mean(r["acceptance_lengths"])) for r in report["prompts"] if r["acceptance_lengths"]
    }


def mean_and_se(x: np.ndarray) -> tuple[float, float]:
    return float(x.mean()), float(x.std(ddof=1) / np.sqrt(len(x)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("runs", nargs="+", metavar="NAME=LABEL")
    ap.add_argument("--pair", action="append", default=[], metavar="X-Y", help="print X minus Y, paired")
    args = ap.parse_args(argv)
    per = {}
    print("| run | steps | s/step (median) | held-out tau, per-prompt mean ± s.e. | tau pooled |")
    print("|---|---|---|---|---|")
    for spec in args.runs:
        name, _, label = spec.partition("=")
        report = json.loads((args.out / f"{name}-eval.json").read_text())
        per[name] = per_prompt_tau(report)
        rows = [json.loads(x) for x in (args.out / name / "metrics.jsonl").read_text().splitlines()]
        times = [r["step_time_s"] for r in rows if r.get("split") == "train" and "step_time_s" in r]
        mean, se = mean_and_se(np.array(list(per[name].values())))
        print(
            f"| {label or name} | {rows[-1]['step']} | {np.median(times):.2f} | {mean:.3f} ± {se:.3f} "
            f"| {report['summary']['tau_pooled']:.3f} |"
        )
    for pair in args.pair:
        x, _, y = pair.partition("-")
        ids = sorted(set(per[x]) & set(per[y]))
        mean, se = mean_and_se(np.array([per[x][i] - per[y][i] for i in ids]))
        print(f"paired ({x}) - ({y}) over {len(ids)} prompts: {mean:+.4f} ± {se:.4f} (s.e.)")


if __name__ == "__main__":
    main()
