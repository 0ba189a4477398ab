"""`relex demo`: the whole method end to end on the embedded SmolLM2-135M-Instruct, with no other input.

    from relex.demo import QUICK, run_demo
    summary = run_demo(QUICK, "runs/demo-quick")

Stages, each a library call, all written into one run folder (the layout `relex report` reads):

    1. train        a short GRPO warmup on 2-term arithmetic (configs/smollm2-arithmetic.yaml), recording the
                    deltas θ_s − θ₀                                        -> RUN/config.yaml, log.jsonl, trajectory/
    2. fit          rank-1 fit on the first ~20% of the recorded steps     -> RUN/fit/
    3. extrapolate  relex and the two-point baseline at 1× and 2× the run length
                                                                           -> RUN/extrapolated/, RUN/two-point/
    4. backtest     predict the later recorded steps from the prefix       -> RUN/backtest.json
    5. evaluate     base, the real final RLVR checkpoint (trajectory@LAST) and the extrapolated ones on held-out
                    problems                                               -> RUN/eval/
    6. report       figures and Markdown                                   -> RUN/figures/, RUN/report.md

`RUN/demo.json` records the plan and the seconds each stage took. Aimed budgets on 2 otherwise idle CPU cores:
the default plan (40 steps of 8 prompts × 8 rollouts, recorded every 2; 64 test problems per checkpoint) about
30 minutes; `--quick` (8 steps of 2 prompts × 4 rollouts, recorded every 2; 16 problems, 32-token completions),
the smallest run that exercises every stage, about 5. Training dominates: on a 2-core machine shared with other
jobs a `--quick` run took 19.6 minutes, 14 of them training. The test problems are the first `eval_n` of the
task's held-out split; `relex eval RUN/extrapolated/step-S ... --n 200` on the same folders gives tighter intervals.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from relex.errors import RelexError

LOG = logging.getLogger(__name__)

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "smollm2-arithmetic.yaml"
MIN_OBSERVED = 3  # recorded steps the fit sees at least: two define a line, a third tests it
MARKER = "demo.json"


@dataclass(frozen=True)
class DemoPlan:
    max_steps: int
    record_every: int
    eval_n: int  # held-out problems per checkpoint
    max_new_tokens: int  # evaluation completions
    observe_fraction: float = 0.2  # the fit sees the recorded steps in the first fraction of the run
    horizons: tuple[float, ...] = (1.0, 2.0)  # targets, as multiples of the run length
    batch_size: int = 32
    grpo: dict = field(default_factory=dict)  # on top of the config file's `grpo`


DEFAULT = DemoPlan(max_steps=30, record_every=2, eval_n=100, max_new_tokens=32, batch_size=64)
QUICK = DemoPlan(
    max_steps=8, record_every=2, eval_n=16, max_new_tokens=32, batch_size=16,
    grpo={"num_generations": 4, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "max_completion_length": 32},
)


# ---- stages -------------------------------------------------------------------------------------------------------
def prepare_out(out: Path, overwrite: bool) -> None:
    """Refuse a non-empty folder, unless --overwrite and it is a relex run (never delete anything else)."""
    if not out.exists() or not any(out.iterdir()):
        return
    if not overwrite:
        raise RelexError(f"{out}: exists and is not empty; choose another --out or pass --overwrite to replace it")
    if not ((out / MARKER).is_file() or (out / "config.yaml").is_file()):
        raise RelexError(f"{out}: --overwrite replaces only a relex run folder (with {MARKER} or config.yaml); this is not one")
    shutil.rmtree(out)


def train(plan: DemoPlan, run_dir: Path, config_file: Path) -> Path:
    from relex.evaluate.config import read_yaml_mapping
    from relex.train import load_config, run_training

    data = read_yaml_mapping(config_file)
    data["grpo"] = {**(data.get("grpo") or {}), **plan.grpo}
    config = load_config(base=data, out=run_dir, max_steps=plan.max_steps, record_every=plan.record_every)
    return run_training(config, show_progress=True)


def observed_prefix(steps: list[int], fraction: float) -> int:
    """The last recorded step the fit sees: the first `fraction` of the recorded steps, at least MIN_OBSERVED."""
    count = max(MIN_OBSERVED, math.ceil(fraction * len(steps)))
    if count >= len(steps):
        raise RelexError(f"{len(steps)} recorded steps {steps}: too few to fit on {count} and hold out the rest; train longer")
    return steps[count - 1]


def horizon_targets(last_step: int, horizons: tuple[float, ...]) -> list[int]:
    return sorted({max(1, round(h * last_step)) for h in horizons})


def extrapolate(store, fit, run_dir: Path, targets: list[int]) -> dict[str, list]:
    """relex from the fit, and the two-point baseline (base → last observed step), at every target."""
    from relex.extrapolate import ExtrapolateConfig, extrapolate_store

    relex = extrapolate_store(store, run_dir / "extrapolated", ExtrapolateConfig(targets, "relex", fit=fit.config), fit)
    two_point = extrapolate_store(store, run_dir / "two-point", ExtrapolateConfig(targets, "two-point", fit=fit.config))
    return {"relex": relex, "two-point": two_point}


def backtest(store, observe_until: int, run_dir: Path) -> None:
    from relex.backtest import DEFAULT_METHODS, backtest_store
    from relex.fit import FitConfig

    backtest_store(store, observe_until, list(DEFAULT_METHODS), FitConfig()).save(run_dir / "backtest.json")


def evaluate_checkpoints(plan: DemoPlan, run_dir: Path, checkpoints: list[str], task: dict):
    from relex.evaluate import evaluate

    return evaluate(
        checkpoints, task, n=plan.eval_n, max_new_tokens=plan.max_new_tokens, batch_size=plan.batch_size,
        out_dir=run_dir / "eval", overwrite=True,
    )


class StageClock:
    """Seconds per stage, logged as each one ends and written to RUN/demo.json."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str):
        LOG.info("demo: %s ...", name)
        started = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - started
        LOG.info("demo: %s done in %.1f s", name, self.seconds[name])


# ---- the demo -----------------------------------------------------------------------------------------------------
@dataclass
class DemoResult:
    run_dir: Path
    report: Path
    observe_until: int
    last_step: int
    targets: list[int]
    evaluation: object  # relex.evaluate.EvalResult
    seconds: dict[str, float]


def run_demo(plan: DemoPlan, out: str | Path, *, config_file: str | Path = DEMO_CONFIG, overwrite: bool = False) -> DemoResult:
    """Every stage of the module docstring, in order, into `out`; returns where things are and the evaluation."""
    from relex.fit import FitConfig, fit_store
    from relex.report import write_report
    from relex.store import TrajectoryStore
    from relex.train.config import load_config

    run_dir, config_file = Path(out), Path(config_file)
    task = asdict(load_config(config_file).task)  # checks the config before anything is written
    prepare_out(run_dir, overwrite)
    clock = StageClock()
    with clock.stage("train"):
        train(plan, run_dir, config_file)
    store = TrajectoryStore.open(run_dir / "trajectory")
    observe_until, last = observed_prefix(store.steps, plan.observe_fraction), store.steps[-1]
    targets = horizon_targets(last, plan.horizons)
    with clock.stage("fit"):
        fit = fit_store(store, FitConfig(observe_until=observe_until))
        fit.save(run_dir / "fit")
    with clock.stage("extrapolate"):
        written = extrapolate(store, fit, run_dir, targets)
    with clock.stage("backtest"):
        backtest(store, observe_until, run_dir)
    checkpoints = [str(store.base_dir.resolve()), f"{store.path.resolve()}@{last}"]
    checkpoints += [str(r.path.resolve()) for reports in written.values() for r in reports]
    with clock.stage("evaluate"):
        evaluation = evaluate_checkpoints(plan, run_dir, checkpoints, task)
    with clock.stage("report"):
        report = write_report(run_dir)
    marker = {"plan": asdict(plan), "observe_until": observe_until, "last_step": last, "targets": targets, "seconds": clock.seconds}
    (run_dir / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    return DemoResult(run_dir, report, observe_until, last, targets, evaluation, clock.seconds)
