"""Would `rollback: true` have changed the accelerated runs made without it? Read from their jumps.jsonl alone.

    .venv/bin/python analysis/rollback_offers.py            # every results/*-jumps.jsonl recorded without rollback

A rollback candidate is the weights the segment started from, and the loop scores it on the same validation
problems as every other weights of the run, greedy. Those weights were scored once already, at the decision that
started the segment (its `validation_accuracy_after`), so each decision's rollback score can be read back from the
log. The rollback candidate would have been picked where it ranks first (above every jump candidate; a tie goes to
the farther target, so a rollback loses ties) and gains at least min_gain over the current weights. Whether its
interval and the confirmation problems would then have let it through cannot be read back (the log keeps no
per-problem results): such a decision is printed as "offered", and everything before it in the run is unchanged.

min_gain is the run's own where its summary recorded it, else today's default (0.01). The two runs of section 5
without a summary (accelerate-jumps-keep, -reset) were made before that default, at min_gain 0: their rows say
where a rollback with today's min_gain would have been offered (with 0, one more: keep's step-12 tie).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from relex.accelerate.config import AccelerateConfig
from relex.accelerate.decision import ROLLBACK

RESULTS = Path(__file__).resolve().parent / "results"


def offers(decisions: list[dict], min_gain: float) -> list[dict]:
    """One row per decision: the current and rollback validation scores, and whether the rollback ranks first."""
    rows, start_score = [], None
    for d in decisions:
        current = d["validation_accuracy_before"]
        best = max((c["accuracy"] for c in d["candidates"]), default=None)
        row = {"step": d["step"], "current": current, "rollback": start_score, "best_jump": best,
               "jumped": d["jumped"], "warning": d["signals"]["raised"], "offered": False}
        if start_score is not None:
            row["offered"] = (best is None or start_score > best) and start_score - current >= min_gain
        rows.append(row)
        start_score = d["validation_accuracy_after"]
    return rows


def min_gain_of(jumps_file: Path) -> float:
    summary = jumps_file.with_name(jumps_file.name.replace("jumps", "summary").replace(".jsonl", ".json"))
    if summary.is_file():
        return json.loads(summary.read_text())["config"]["min_gain"]
    return AccelerateConfig().min_gain  # not recorded: today's default (see above)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    print("| run | step | current | rollback | best jump | taken then | rollback offered |")
    print("|---|---|---|---|---|---|---|")
    for path in sorted(args.results.glob("*jumps*.jsonl")):
        decisions = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if any(c["method"] == ROLLBACK for d in decisions for c in d["candidates"]):
            continue  # made with rollback on: nothing to imagine
        run = path.stem.replace("-jumps", "").replace("jumps-", "")
        for row in offers(decisions, min_gain_of(path)):
            if row["rollback"] is None:
                continue
            best = "–" if row["best_jump"] is None else f"{row['best_jump']:.3f}"
            then = "jump" if row["jumped"] else ("kept (warning)" if row["warning"] else "kept")
            print(f"| {run} | {row['step']} | {row['current']:.3f} | {row['rollback']:.3f} | {best} | {then} | "
                  f"{'**yes**' if row['offered'] else 'no'} |")


if __name__ == "__main__":
    main()
