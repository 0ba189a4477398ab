"""`relex demo`: relex accelerate next to plain GRPO on the embedded SmolLM2-135M-Instruct, with no other input.

    from relex.demo import QUICK, run_demo
    summary = run_demo(QUICK, "runs/demo-quick")

Stages, each a library call, all written into one run folder (the layout `relex report` reads):

    1. plain        GRPO on 2-term arithmetic (configs/smollm2-arithmetic.yaml) through the accelerate loop with
                    jumps off: the same segments and validation scores, never a jump      -> RUN/plain/
    2. accelerated  the same recipe, seed and GRPO budget, jumping where the validation guard allows it
                    (candidates at α × the segment, fitted line and anchored)             -> RUN/accelerated/
    3. evaluate     the plain run's final weights, the accelerated run's and the base on held-out problems
                                                                                          -> RUN/eval/
    4. report       the jumps figure, the decisions and the evaluation                    -> RUN/figures/, RUN/report.md

`RUN/demo.json` records the plan and the seconds each stage took. Aimed budgets on 2 otherwise idle CPU cores:
the default plan (16 GRPO steps per run of 4 prompts × 8 rollouts, a decision every 4; 64 validation and 100 test
problems) about 25 minutes; `--quick` (4 steps per run of 2 prompts × 4 rollouts, a decision every 2; 20 validation
and 16 test problems, 24-token completions) about 5. One-shot extrapolation far past the observed steps (5× and
10× the run) is not shown here: at this scale it fails (analysis/README.md), which is why the loop jumps in short,
checked steps.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from relex.errors import RelexError

LOG = logging.getLogger(__name__)

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "smollm2-arithmetic.yaml"
MARKER = "demo.json"
PLAIN, ACCELERATED = "plain", "accelerated"


@dataclass(frozen=True)
class DemoPlan:
    max_steps: int  # GRPO steps of each run
    segment_steps: int  # a jump decision after every this many
    validation_size: int  # validation problems per decision
    eval_n: int  # held-out problems per checkpoint
    max_new_tokens: int  # evaluation completions
    margin: float = 0.05
    batch_size: int = 32
    grpo: dict = field(default_factory=dict)  # on top of the config file's `grpo`


DEFAULT = DemoPlan(max_steps=16, segment_steps=4, validation_size=64, eval_n=100, max_new_tokens=32, batch_size=64)
QUICK = DemoPlan(
    max_steps=4, segment_steps=2, validation_size=20, eval_n=16, max_new_tokens=24, batch_size=20,
    grpo={"num_generations": 4, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "max_completion_length": 24},
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


def run_config(plan: DemoPlan, config_file: Path, out: Path, *, jump: bool):
    """The config file's recipe with the plan's budget, and the loop's settings (jumps on or off)."""
    from relex.accelerate.run import accelerate_config
    from relex.evaluate.config import read_yaml_mapping
    from relex.train import load_config

    data = read_yaml_mapping(config_file)
    data["grpo"] = {**(data.get("grpo") or {}), **plan.grpo}
    config = load_config(base=data, out=out, max_steps=plan.max_steps)
    loop = accelerate_config(config, segment_steps=plan.segment_steps, validation_size=plan.validation_size,
                             margin=plan.margin, jump=jump, batch_size=plan.batch_size)
    return config, loop


def train(plan: DemoPlan, run_dir: Path, config_file: Path, *, jump: bool) -> Path:
    from relex.accelerate import run_accelerate

    config, loop = run_config(plan, config_file, run_dir, jump=jump)
    return run_accelerate(config, loop, show_progress=True)


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
    runs: dict[str, dict]  # plain / accelerated: their accelerate-summary.json
    evaluation: object  # relex.evaluate.EvalResult
    seconds: dict[str, float]


def run_demo(plan: DemoPlan, out: str | Path, *, config_file: str | Path = DEMO_CONFIG, overwrite: bool = False) -> DemoResult:
    """Every stage of the module docstring, in order, into `out`; returns where things are and the evaluation."""
    from relex.report import write_report
    from relex.store import TrajectoryStore

    run_dir, config_file = Path(out), Path(config_file)
    config, _ = run_config(plan, config_file, run_dir / PLAIN, jump=False)  # checks everything before writing
    task = asdict(config.task)
    prepare_out(run_dir, overwrite)
    run_dir.mkdir(parents=True, exist_ok=True)
    clock = StageClock()
    with clock.stage("plain GRPO"):
        train(plan, run_dir / PLAIN, config_file, jump=False)
    with clock.stage("accelerated"):
        train(plan, run_dir / ACCELERATED, config_file, jump=True)
    runs = {name: json.loads((run_dir / name / "accelerate-summary.json").read_text()) for name in (PLAIN, ACCELERATED)}
    base = TrajectoryStore.open(run_dir / PLAIN / "segments" / "000").base_dir
    checkpoints = [str((run_dir / PLAIN / "final").resolve()), str((run_dir / ACCELERATED / "final").resolve()), str(base.resolve())]
    with clock.stage("evaluate"):
        evaluation = evaluate_checkpoints(plan, run_dir, checkpoints, task)
    with clock.stage("report"):
        report = write_report(run_dir)
    marker = {"plan": asdict(plan), "runs": runs, "seconds": clock.seconds}
    (run_dir / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    return DemoResult(run_dir, report, runs, evaluation, clock.seconds)
