"""`relex sweep STORE --targets S1,S2,... --task NAME`: choose the extrapolation horizon on a validation split.

The paper reports gains at 5–20× the observed prefix, but how far to go depends on the run. A sweep fits once,
writes one checkpoint per target, evaluates each (with the base and the last observed step for reference) on
*validation* problems, and recommends the best target with its interval, saying when it is not significantly
better than the base or than simply stopping at the last observed step.

Validation problems never overlap the test problems that `relex eval` scores: they are the task's held-out split
drawn with `eval_seed + VALIDATION_SEED_OFFSET` (reasoning-gym item i comes from seed + i, so the two draws are
different problems, still disjoint from the train split), minus any question that also occurs in the test split.
A task whose held-out split does not depend on the seed (a file with its own split labels) has no such problems
and is refused, naming the task.

    OUT/fit/                   the fit (when the method needs one)
    OUT/checkpoints/step-S/    one Hugging Face folder per target
    OUT/validation/            relex eval's summary.json and completions.jsonl on the validation problems
    OUT/sweep.json             the recommendation, with every target's accuracy and the paired comparisons

OUT is written through relex.io.atomic: complete under a temporary name beside it, then renamed into place, so an
interrupted sweep leaves the old OUT intact; `--overwrite` refuses an OUT that is, contains or lies in the store.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from relex.errors import RelexError
from relex.evaluate import evaluate
from relex.evaluate.metrics import paired_bootstrap_diff
from relex.evaluate.report import write_outputs
from relex.extrapolate import ExtrapolateConfig, extrapolate_store, get_method
from relex.fit import FitConfig, fit_store
from relex.fit.fit import observed_steps
from relex.io.atomic import atomic_output, check_output, write_json_atomic
from relex.settings import setting
from relex.store import TrajectoryStore
from relex.tasks import EVAL, Task, load_task
from relex.tasks.spec import TaskSpec, as_task_spec
from relex.util import is_int

LOG = logging.getLogger(__name__)

VALIDATION_SEED_OFFSET = 500_000
VALIDATION_DRAW_FACTOR = 2  # draw this many times n candidates, so that dropping test questions leaves n


@dataclass
class SweepConfig:
    targets: list[int] = setting(help="target steps to compare, e.g. 100,200,400")
    task: TaskSpec = setting(help="the task: a TaskSpec, its mapping, or a name such as chain_sum", parse=as_task_spec)
    n: int = setting(64, "validation problems (disjoint from the test problems)")
    method: str = setting("relex", "extrapolation method")
    fit: FitConfig = setting(help="the fit's recipe and how it runs", factory=FitConfig)
    max_new_tokens: int = setting(512, "completion length limit")
    batch_size: int = setting(32, "sequences generated together")
    seed: int = setting(0, "bootstrap seed")
    overwrite: bool = setting(False, "replace an existing output folder")

    def __post_init__(self) -> None:
        self.task = as_task_spec(self.task)  # a bad task fails here, before the store is opened
        if not is_int(self.n) or self.n < 1:
            raise RelexError(f"--n {self.n}: validate on at least one problem")
        if not self.targets:
            raise RelexError("no target step: give --targets S1,S2,...")


@dataclass
class Comparison:
    reference: str  # the checkpoint compared against
    diff: float
    ci_low: float
    ci_high: float

    @property
    def significant(self) -> bool:
        return self.ci_low > 0


@dataclass
class SweepResult:
    out_dir: Path
    best_target: int
    best: dict  # checkpoint, accuracy, ci_low, ci_high, n
    versus_base: Comparison
    versus_last: Comparison
    last_step: int
    accuracies: dict[int, dict]  # target -> checkpoint, accuracy, ci_low, ci_high
    references: dict[str, dict]  # "base" / "last observed" -> the same

    def verdict(self) -> str:
        head = (f"recommended target: step {self.best_target}, validation accuracy {self.best['accuracy']:.3f} "
                f"[{self.best['ci_low']:.3f}, {self.best['ci_high']:.3f}] on {self.best['n']} problems")
        weak = [name for name, c in (("the base", self.versus_base), (f"the last observed step {self.last_step}", self.versus_last)) if not c.significant]
        if not weak:
            return head + f"; significantly better than the base and than the last observed step {self.last_step}"
        return head + f"; NOT significantly better than {' or '.join(weak)} (95% paired interval includes 0): evaluate more problems (--n) before relying on it"

    def to_dict(self) -> dict:
        return {
            "best_target": self.best_target,
            "best": self.best,
            "versus_base": dataclasses.asdict(self.versus_base) | {"significant": self.versus_base.significant},
            "versus_last_observed": dataclasses.asdict(self.versus_last) | {"significant": self.versus_last.significant},
            "last_observed_step": self.last_step,
            "targets": {str(t): a for t, a in self.accuracies.items()},
            "references": self.references,
            "verdict": self.verdict(),
        }


# ---- validation problems ------------------------------------------------------------------------------------------
def validation_task(task, n: int):
    """A Task whose held-out split is `n` validation problems: another draw of the eval split, minus test questions."""
    spec = as_task_spec(task)
    test_questions = {row["question"] for row in load_task(spec).rows(EVAL)}
    shifted = dataclasses.replace(spec, eval_seed=spec.eval_seed + VALIDATION_SEED_OFFSET, eval_size=VALIDATION_DRAW_FACTOR * n)
    drawn = load_task(shifted)
    rows = [row for row in drawn.rows(EVAL) if row["question"] not in test_questions][:n]
    if len(rows) < n:
        raise RelexError(
            f"task {drawn.name}: only {len(rows)} validation problems differ from the test problems (wanted {n}); "
            "its held-out split does not change with eval_seed, or the problem space is small: lower --n"
        )
    return Task(f"{drawn.name} (validation)", drawn.verifier, {EVAL: rows})


# ---- the sweep ----------------------------------------------------------------------------------------------------
def _accuracy(result) -> dict:
    return {"checkpoint": result.checkpoint, "accuracy": result.accuracy, "ci_low": result.ci_low, "ci_high": result.ci_high, "n": result.n}


def compare(result, reference, seed: int) -> Comparison:
    """Paired bootstrap of `result` minus `reference` on the same validation problems."""
    diff, low, high = paired_bootstrap_diff(result.greedy_correct(), reference.greedy_correct(), seed=seed)
    return Comparison(reference.checkpoint, diff, low, high)


def write_checkpoints(store, out_dir: Path, config: SweepConfig) -> list:
    """The fit (when the method needs one) and one checkpoint per target; returns the extrapolation reports."""

    fit = None
    if get_method(config.method).needs_fit:
        fit = fit_store(store, config.fit)
        fit.save(out_dir / "fit", overwrite=True)
    extrapolate = ExtrapolateConfig(targets=config.targets, method=config.method, fit=config.fit, overwrite=True)
    return extrapolate_store(store, out_dir / "checkpoints", extrapolate, fit)


def sweep(store_dir: str | Path, out_dir: str | Path, config: SweepConfig, generator_factory=None) -> SweepResult:
    """Extrapolate to every target, evaluate each on validation problems, and recommend one."""

    out_dir = Path(out_dir)
    store = TrajectoryStore.open(store_dir)
    inputs = [store.path, store.base_dir]  # --overwrite never replaces the store or its base
    check_output(out_dir, overwrite=config.overwrite, inputs=inputs)
    task = validation_task(config.task, config.n)  # before the extrapolation, so a bad task fails in seconds
    # everything is written under a temporary name beside OUT; an interrupted sweep leaves the old OUT intact
    with atomic_output(out_dir, overwrite=config.overwrite, inputs=inputs) as tmp:
        reports = write_checkpoints(store, tmp, config)
        last_step = observed_steps(store, config.fit.observe_until)[-1]
        checkpoints = [str(store.base_dir), f"{store.path}@{last_step}", *(str(r.path) for r in reports)]
        evaluation = evaluate(
            checkpoints, task, n=config.n, seed=config.seed,
            max_new_tokens=config.max_new_tokens, batch_size=config.batch_size, generator_factory=generator_factory,
        )
        for checkpoint, report in zip(evaluation.checkpoints[2:], reports):  # named where they will be, not in tmp
            checkpoint.checkpoint = str(out_dir / Path(report.path).relative_to(tmp))
        evaluation.out_dir = out_dir / "validation"
        write_outputs(evaluation, tmp / "validation", False)
        base, last, *targets = evaluation.checkpoints
        best_index = max(range(len(targets)), key=lambda i: (targets[i].accuracy, -config.targets[i]))
        best = targets[best_index]
        result = SweepResult(
            out_dir, config.targets[best_index], _accuracy(best), compare(best, base, config.seed), compare(best, last, config.seed),
            last_step, {t: _accuracy(r) for t, r in zip(config.targets, targets)}, {"base": _accuracy(base), "last observed": _accuracy(last)},
        )
        write_json_atomic(tmp / "sweep.json", result.to_dict())
    LOG.info(result.verdict())
    return result
