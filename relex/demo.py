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
the default plan (16 GRPO steps per run of 4 prompts × 8 rollouts, a decision every 4; 64 validation, 64 confirmation
and 100 test problems) about 25 minutes; `--quick` (4 steps per run of 3 prompts × 4 rollouts at lr 1e-5, a decision
every 2; 20 validation, 20 confirmation and 16 test problems, 24-token completions) about 5. One-shot extrapolation far past the observed steps (5× and
10× the run) is not shown here: at this scale it fails (analysis/README.md), which is why the loop jumps in short,
checked steps.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from relex.accelerate import run_accelerate
from relex.accelerate.loop import read_jumps
from relex.accelerate.run import accelerate_config
from relex.errors import RelexError
from relex.evaluate import EvalResult, evaluate
from relex.io.atomic import atomic_output, write_json_atomic
from relex.present import DASH, Table, interval, jumps_table, step
from relex.report import write_report
from relex.settings import read_yaml_mapping
from relex.store import TrajectoryStore
from relex.train import load_config

LOG = logging.getLogger(__name__)

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "smollm2-arithmetic.yaml"
MARKER = "demo.json"
PLAIN, ACCELERATED = "plain", "accelerated"
RUN_NAMES = {PLAIN: "plain GRPO", ACCELERATED: "relex accelerate"}  # as the demo's tables name the runs


@dataclass(frozen=True)
class DemoPlan:
    max_steps: int  # GRPO steps of each run
    segment_steps: int  # a jump decision after every this many
    validation_size: int  # validation problems per decision
    eval_n: int  # held-out problems per checkpoint
    max_new_tokens: int  # evaluation completions
    margin: float = 0.05
    confirm_size: int = 64  # fresh problems that confirm a picked candidate
    batch_size: int = 32
    grpo: dict = field(default_factory=dict)  # on top of the config file's `grpo`


DEFAULT = DemoPlan(max_steps=16, segment_steps=4, validation_size=64, confirm_size=64, eval_n=100, max_new_tokens=32,
                   batch_size=64)
QUICK = DemoPlan(
    max_steps=4, segment_steps=2, validation_size=20, confirm_size=20, eval_n=16, max_new_tokens=24, batch_size=20,
    grpo={"num_generations": 4, "per_device_train_batch_size": 12, "gradient_accumulation_steps": 1, "max_completion_length": 24,
          "learning_rate": 1.0e-5},  # 3 prompts x 4 rollouts; at 2e-5 and 2 prompts, 4 steps took 0.31 down to 0.06
)


# ---- stages -------------------------------------------------------------------------------------------------------
def prepare_out(out: Path, overwrite: bool) -> None:
    """Refuse a non-empty folder, unless --overwrite and it is a relex run (never replace anything else).

    Nothing is deleted here: `run_demo` writes the new run beside `out` and replaces the old one only once the
    new one is complete (relex.io.atomic), so an interrupted demo leaves the old run intact.
    """
    if not out.exists() or not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise RelexError(f"{out}: exists and is not empty; choose another --out or pass --overwrite to replace it")
    if not ((out / MARKER).is_file() or (out / "config.yaml").is_file()):
        raise RelexError(f"{out}: --overwrite replaces only a relex run folder (with {MARKER} or config.yaml); this is not one")


def run_config(plan: DemoPlan, config_file: Path, out: Path, *, jump: bool):
    """The config file's recipe with the plan's budget, and the loop's settings (jumps on or off)."""
    data = read_yaml_mapping(config_file)
    data["grpo"] = {**(data.get("grpo") or {}), **plan.grpo}
    config = load_config(base=data, out=out, max_steps=plan.max_steps)
    loop = accelerate_config(config, segment_steps=plan.segment_steps, validation_size=plan.validation_size,
                             confirm_size=plan.confirm_size, margin=plan.margin, jump=jump, batch_size=plan.batch_size)
    return config, loop


def train(plan: DemoPlan, run_dir: Path, config_file: Path, *, jump: bool) -> Path:
    config, loop = run_config(plan, config_file, run_dir, jump=jump)
    return run_accelerate(config, loop, show_progress=True)


def evaluate_checkpoints(plan: DemoPlan, run_dir: Path, checkpoints: list[str], task: dict):
    return evaluate(
        checkpoints, task, n=plan.eval_n, max_new_tokens=plan.max_new_tokens, batch_size=plan.batch_size,
        out_dir=run_dir / "eval", overwrite=True,
    )


RECORDS = ("*.json", "*.jsonl", "*.yaml", "*.md")  # the text files a run records its folders in


def rename_recorded_paths(tmp: Path, final: Path) -> None:
    """Where the run's records name its temporary folder `tmp` (configs, jump logs, fits, evaluation labels), name
    `final` instead, the folder it is about to become (the name of `tmp` is unique: PID and random digits)."""
    pairs = [(str(tmp.resolve()), str(final.resolve()))]
    if str(tmp) != pairs[0][0]:
        pairs.append((str(tmp), str(final)))
    for pattern in RECORDS:
        for path in tmp.rglob(pattern):
            if not path.is_file() or path.is_symlink():
                continue
            text = path.read_text()
            renamed = text
            for old, new in pairs:
                renamed = renamed.replace(old, new)
            if renamed != text:
                path.write_text(renamed)


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
    evaluation: EvalResult
    seconds: dict[str, float]

    def accuracy_table(self) -> Table:
        """Held-out accuracy of the plain run's final weights, the accelerated run's and the base."""
        rows = []
        for r in self.evaluation.checkpoints:
            summary = self.runs.get(Path(r.checkpoint).parent.name)  # RUN/plain/final -> plain; the base: None
            diff = r.diff_vs_first
            rows.append([
                RUN_NAMES.get(Path(r.checkpoint).parent.name, "base"), summary["grpo_steps"] if summary else 0,
                step(summary["virtual_steps"]) if summary else "0", interval(r.accuracy, r.ci_low, r.ci_high),
                DASH if diff is None else interval(diff["diff"], diff["ci_low"], diff["ci_high"], signed=True),
            ])
        title = f"held-out accuracy on {self.evaluation.checkpoints[0].n} problems (95% CI), same seed and GRPO budget"
        return Table(title, ["final weights", "GRPO steps", "as if step", "accuracy", "Δ vs plain"], rows)

    def tables(self) -> list[Table]:
        """What `relex demo` shows: the accuracy table, the accelerated run's decisions, the time and where it all is."""
        stages = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in self.seconds.items())
        decisions = jumps_table(read_jumps(self.run_dir / ACCELERATED), "jump decisions of the accelerated run")
        where = Table(f"time: {stages} (total {sum(self.seconds.values()) / 60:.1f} min)",
                      notes=[f"run folder {self.run_dir}: report {self.report}, figures {self.run_dir / 'figures'}"])
        return [self.accuracy_table(), decisions, where]


def run_demo(plan: DemoPlan, out: str | Path, *, config_file: str | Path = DEMO_CONFIG, overwrite: bool = False) -> DemoResult:
    """Every stage of the module docstring, in order, into `out`; returns where things are and the evaluation."""
    run_dir, config_file = Path(out), Path(config_file)
    config, _ = run_config(plan, config_file, run_dir / PLAIN, jump=False)  # checks everything before writing
    task = asdict(config.task)
    prepare_out(run_dir, overwrite)
    clock = StageClock()
    # the runs and their evaluation are written under a temporary name beside RUN and moved into place complete;
    # the old RUN (an --overwrite) stays intact until then. Stores record their folders relative to themselves.
    with atomic_output(run_dir, overwrite=overwrite, inputs=[config_file]) as tmp:
        with clock.stage("plain GRPO"):
            train(plan, tmp / PLAIN, config_file, jump=False)
        with clock.stage("accelerated"):
            train(plan, tmp / ACCELERATED, config_file, jump=True)
        runs = {name: json.loads((tmp / name / "accelerate-summary.json").read_text()) for name in (PLAIN, ACCELERATED)}
        base = TrajectoryStore.open(tmp / PLAIN / "segments" / "000").base_dir
        checkpoints = [str((tmp / PLAIN / "final").resolve()), str((tmp / ACCELERATED / "final").resolve()), str(base.resolve())]
        with clock.stage("evaluate"):
            evaluation = evaluate_checkpoints(plan, tmp, checkpoints, task)
        rename_recorded_paths(tmp, run_dir)
        marker = {"plan": asdict(plan), "runs": runs, "seconds": clock.seconds}
        write_json_atomic(tmp / MARKER, marker)
    with clock.stage("report"):  # from the run in place, so that it names RUN; `relex report RUN` remakes it
        report = write_report(run_dir)
    write_json_atomic(run_dir / MARKER, marker | {"seconds": clock.seconds}, lock=True)
    return DemoResult(run_dir, report, runs, evaluation, clock.seconds)
