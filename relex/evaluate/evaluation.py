"""Evaluate checkpoints on a task's held-out problems: generate, score with the task's verifier, summarise.

    from relex.evaluate import evaluate, format_table

    task = {"source": "reasoning_gym", "name": "chain_sum"}  # a TaskSpec, its mapping, or a loaded Task
    result = evaluate(["runs/base", "runs/extrapolated"], task, n=200, samples=8, temperature=0.7, out_dir="runs/eval")
    print(format_table(result))

Every checkpoint is decoded greedily (accuracy = pass@1 with a bootstrap interval, compared with the first
checkpoint on the same problems); with `samples` K > 1 it is also sampled K times per problem at `temperature`
(unbiased pass@k and maj@K). A completion counts as correct when its verifier score is at least 1.
"""

from __future__ import annotations

import functools
import logging
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, ContextManager, Sequence

import numpy as np

from relex.errors import RelexError
from relex.evaluate import metrics
from relex.evaluate.checkpoints import checkpoint_inputs, is_logits_spec, model_folder, parse_checkpoint, parse_logits_spec
from relex.evaluate.generate import Completion, Generator, check_backend, load_generator
from relex.evaluate.logits import check_logits_spec, open_logits_generator
from relex.evaluate.report import check_out_dir, write_outputs
from relex.settings import setting
from relex.tasks import as_task_spec, load_task
from relex.util import is_int, is_positive_int
from relex.verifiers import count_failures, extract_final_answer, get_verifier

LOG = logging.getLogger(__name__)

EVAL_SPLIT = "eval"  # relex.tasks.EVAL
CORRECT = 1.0  # a score at or above this is a correct completion (verifiers may give partial credit below it)

GeneratorFactory = Callable[[str], ContextManager[Generator]]


@dataclass(frozen=True)
class EvalSettings:
    """How completions are generated and summarised; checked when made (`validate`)."""

    n: int | None = setting(None, "held-out problems to evaluate (default: the whole eval split)")
    samples: int = setting(1, "K sampled completions per problem for pass@k and maj@K (K > 1 needs a temperature)")
    temperature: float = setting(0.0, "sampling temperature of the K samples")
    seed: int = setting(0, "sampling and bootstrap seed")
    backend: str = setting("transformers", "generation backend: transformers, or vllm where it is installed")
    batch_size: int = setting(32, "sequences generated together")
    max_new_tokens: int = setting(512, "completion length limit")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.n is not None and (not is_int(self.n) or self.n < 1):
            raise RelexError(f"--n {self.n}: evaluate at least one problem")
        if not is_int(self.samples) or self.samples < 1:
            raise RelexError(f"--samples {self.samples}: need at least 1")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise RelexError(f"--temperature {self.temperature}: must be >= 0")
        if self.samples > 1 and self.temperature == 0:
            raise RelexError(
                f"--samples {self.samples} needs --temperature T > 0 (e.g. 0.7): "
                f"greedy decoding would give {self.samples} identical completions"
            )
        if not is_positive_int(self.batch_size) or not is_positive_int(self.max_new_tokens):
            raise RelexError(f"--batch-size {self.batch_size}, --max-new-tokens {self.max_new_tokens}: must be >= 1")
        check_backend(self.backend)

    @property
    def sampling(self) -> bool:
        return self.temperature > 0


@dataclass
class CheckpointResult:
    checkpoint: str
    n: int
    accuracy: float  # greedy pass@1
    ci_low: float
    ci_high: float
    mean_tokens: float  # greedy completions
    truncated: float  # fraction of greedy completions that hit max_new_tokens without stopping
    verifier_failures: dict[str, int]
    unscored: int  # completions the verifier returned None for (counted as wrong)
    n_completions: int
    seconds: float  # generation time, without loading the model
    completions_per_s: float
    pass_at_k: dict[int, float] = field(default_factory=dict)  # from the K samples
    maj_at_k: float | None = None
    mean_tokens_sampled: float | None = None
    diff_vs_first: dict[str, float] | None = None  # {"diff", "ci_low", "ci_high"} of greedy accuracy
    records: list[dict] = field(default_factory=list, repr=False)  # one per completion, for completions.jsonl

    def greedy_correct(self) -> list[float]:
        """Greedy correctness (1.0 or 0.0) per problem, in problem order: what paired comparisons resample."""
        return [float(r["correct"]) for r in self.records if r["mode"] == "greedy"]

    def summary(self) -> dict:
        summary = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "records"}
        summary["pass_at_k"] = {str(k): v for k, v in self.pass_at_k.items()}
        return summary


@dataclass
class EvalResult:
    task: dict
    settings: EvalSettings
    checkpoints: list[CheckpointResult]
    out_dir: Path | None = None

    def summary(self) -> dict:
        return {
            "task": self.task,
            "settings": asdict(self.settings),
            "correct_threshold": CORRECT,
            "checkpoints": [result.summary() for result in self.checkpoints],
        }


@dataclass(frozen=True)
class Verdict:
    completion: Completion
    answer: str | None  # the extracted final answer, for majority voting
    score: float | None  # None: the verifier had no verdict

    @property
    def correct(self) -> bool:
        return self.score is not None and self.score >= CORRECT


def evaluate(
    checkpoints: Sequence[str],
    task,
    *,
    n: int | None = None,
    samples: int = 1,
    temperature: float = 0.0,
    seed: int = 0,
    out_dir: str | Path | None = None,
    backend: str = "transformers",
    batch_size: int = 32,
    max_new_tokens: int = 512,
    overwrite: bool = False,
    generator_factory: GeneratorFactory | None = None,
) -> EvalResult:
    """Evaluate each checkpoint on the same `n` held-out problems of `task`; writes `out_dir` when given.

    Args:
        checkpoints: what `relex eval` takes: a folder, an alias, a hub id, `STORE@STEP`, or `logits(A,B,ALPHA)`.
        task: a loaded `relex.tasks.Task`, or a `TaskSpec` (or mapping of its fields), loaded once the settings
            are checked and then recorded in the summary.
        n: how many held-out problems (default: the whole split); `samples` and `temperature`: completions per
            problem and how they are drawn (1 and 0.0: greedy pass@1).
        out_dir: where to write the summary and the per-problem results (nothing is written without it).
        generator_factory: `generator_factory(checkpoint)` is a context manager yielding a `Generator`; by
            default the checkpoint is parsed, checked, loaded with `backend` and freed afterwards.

    Returns:
        An `EvalResult`: per checkpoint its accuracy with a 95% bootstrap interval and its per-problem scores.

    Example:
        from relex.evaluate import evaluate
        result = evaluate(["runs/demo/extrapolated/step-60", "runs/demo/trajectory@30"],
                          {"source": "reasoning_gym", "name": "chain_sum"}, n=100, out_dir="runs/demo/eval")
    """

    settings = EvalSettings(n, samples, temperature, seed, backend, batch_size, max_new_tokens)  # checked here
    if not checkpoints:
        raise RelexError("no checkpoint to evaluate")
    if out_dir is not None:
        inputs = checkpoint_inputs(checkpoints)  # --overwrite never replaces a checkpoint it evaluates
        check_out_dir(Path(out_dir), overwrite, inputs)
    task, description = loaded_task(task)
    rows = task.rows(EVAL_SPLIT, n)  # refuses a task without a held-out split, or n larger than it
    if generator_factory is None:
        generator_factory = checkpoint_generators(checkpoints, settings)
    results = [_evaluate_checkpoint(c, generator_factory, task, rows, settings) for c in checkpoints]
    _compare_with_first(results, settings.seed)
    result = EvalResult(task=description, settings=settings, checkpoints=results)
    if out_dir is not None:
        result.out_dir = write_outputs(result, Path(out_dir), overwrite, inputs)
    return result


def loaded_task(task) -> tuple[object, dict]:
    """The task, loaded from its spec when given one, and what the summary records about it."""
    spec = None
    if not hasattr(task, "rows"):
        spec = as_task_spec(task)
        task = load_task(spec)
    return task, {"name": task.name, "verifier": task.verifier, "spec": None if spec is None else asdict(spec)}


def checkpoint_generators(checkpoints: Sequence[str], settings: EvalSettings) -> GeneratorFactory:
    """Checks every checkpoint now (before hours of generation), then opens them one at a time."""
    refs = {}
    for text in checkpoints:
        if is_logits_spec(text):  # logits(A,B,ALPHA): decode-time extrapolation of two checkpoints
            spec = parse_logits_spec(text)
            refs[text] = (spec, check_logits_spec(spec, settings.backend))
        else:
            refs[text] = parse_checkpoint(text)
    return functools.partial(_open_generator, refs=refs, settings=settings)


@contextmanager
def _open_generator(checkpoint: str, *, refs: dict, settings: EvalSettings):

    if isinstance(refs[checkpoint], tuple):
        spec, pair = refs[checkpoint]
        with open_logits_generator(pair, spec, settings) as generator:
            yield generator
        return
    with model_folder(refs[checkpoint]) as folder:
        generator = load_generator(
            settings.backend, folder, batch_size=settings.batch_size, max_new_tokens=settings.max_new_tokens
        )
        try:
            yield generator
        finally:
            generator.close()


def _evaluate_checkpoint(
    checkpoint: str, factory: GeneratorFactory, task, rows: list[dict], settings: EvalSettings
) -> CheckpointResult:
    prompts = [row["prompt"] for row in rows]
    with factory(checkpoint) as generator:
        start = time.perf_counter()
        greedy = generator.generate(prompts, samples=1, temperature=0.0, seed=settings.seed)
        sampled = None
        if settings.sampling:
            sampled = generator.generate(
                prompts, samples=settings.samples, temperature=settings.temperature, seed=settings.seed
            )
        seconds = time.perf_counter() - start
    _check_shapes(checkpoint, greedy, len(rows), 1)
    if sampled is not None:
        _check_shapes(checkpoint, sampled, len(rows), settings.samples)
    return _summarise(checkpoint, task, rows, greedy, sampled, seconds, settings)


def _check_shapes(checkpoint: str, completions: list[list[Completion]], n_rows: int, samples: int) -> None:
    shape = [len(c) for c in completions]
    if len(completions) != n_rows or any(k != samples for k in shape):
        raise RuntimeError(f"{checkpoint}: the generator returned {shape} completions for {n_rows}×{samples}")


def score(task, rows: list[dict], completions: list[list[Completion]]) -> list[list[Verdict]]:
    """Verdicts of the task's verifier on every completion, called once on the flattened list (TRL's signature)."""
    verify = get_verifier(task.verifier)
    flat = [(row, c) for row, group in zip(rows, completions) for c in group]
    columns = {key: [row[key] for row, _ in flat] for key in rows[0] if key != "prompt"}
    scores = verify([c.text for _, c in flat], **columns)
    if len(scores) != len(flat):
        raise RuntimeError(f"verifier {task.verifier} returned {len(scores)} scores for {len(flat)} completions")
    verdicts = iter(Verdict(c, extract_final_answer(c.text), s) for (_, c), s in zip(flat, scores))
    return [[next(verdicts) for _ in group] for group in completions]


def majority_correct(verdicts: list[Verdict]) -> bool:
    """maj@K of one problem: the most voted final answer, judged by the verifier's verdict on the first
    completion that gave it (the same text the verifier already checked)."""
    winner = metrics.majority_vote([v.answer for v in verdicts])
    return winner is not None and next(v for v in verdicts if v.answer == winner).correct


def _summarise(checkpoint, task, rows, greedy, sampled, seconds, settings: EvalSettings) -> CheckpointResult:
    with count_failures() as counted:
        greedy_verdicts = [group[0] for group in score(task, rows, greedy)]
        sampled_verdicts = score(task, rows, sampled) if sampled is not None else None
    failures = dict(counted)
    correct = np.array([v.correct for v in greedy_verdicts], dtype=float)
    low, high = metrics.bootstrap_ci(correct, seed=settings.seed)
    tokens = np.array([v.completion.n_tokens for v in greedy_verdicts])
    every = greedy_verdicts + [v for group in sampled_verdicts or [] for v in group]
    result = CheckpointResult(
        checkpoint=checkpoint,
        n=len(rows),
        accuracy=float(correct.mean()),
        ci_low=low,
        ci_high=high,
        mean_tokens=float(tokens.mean()),
        truncated=float((tokens >= settings.max_new_tokens).mean()),
        verifier_failures=failures,
        unscored=sum(v.score is None for v in every),
        n_completions=len(every),
        seconds=seconds,
        completions_per_s=len(every) / seconds if seconds > 0 else float("inf"),
        records=_records(checkpoint, rows, [[v] for v in greedy_verdicts], "greedy")
        + (_records(checkpoint, rows, sampled_verdicts, "sampled") if sampled_verdicts else []),
    )
    if sampled_verdicts is not None:
        _add_sampled_metrics(result, sampled_verdicts, settings.samples)
    LOG.info("%s: accuracy %.3f [%.3f, %.3f] on %d problems", checkpoint, result.accuracy, low, high, len(rows))
    return result


def _add_sampled_metrics(result: CheckpointResult, verdicts: list[list[Verdict]], samples: int) -> None:
    counts = [sum(v.correct for v in group) for group in verdicts]
    result.pass_at_k = {k: metrics.mean_pass_at_k(counts, samples, k) for k in metrics.pass_at_k_values(samples)}
    result.maj_at_k = float(np.mean([majority_correct(group) for group in verdicts]))
    result.mean_tokens_sampled = float(np.mean([v.completion.n_tokens for group in verdicts for v in group]))


def _records(checkpoint: str, rows: list[dict], verdicts: list[list[Verdict]], mode: str) -> list[dict]:
    return [
        {
            "checkpoint": checkpoint,
            "problem_id": row["id"],
            "mode": mode,
            "sample": index,
            "prompt": row["prompt"],
            "completion": v.completion.text,
            "answer": v.answer,
            "gold": row["answer"],
            "score": v.score,
            "correct": v.correct,
            "n_tokens": v.completion.n_tokens,
        }
        for row, group in zip(rows, verdicts)
        for index, v in enumerate(group)
    ]


def _compare_with_first(results: list[CheckpointResult], seed: int) -> None:
    """Paired bootstrap of each checkpoint's greedy accuracy minus the first one's, on the same problems."""
    first = results[0].greedy_correct()
    for result in results[1:]:
        diff, low, high = metrics.paired_bootstrap_diff(result.greedy_correct(), first, seed=seed)
        result.diff_vs_first = {"diff": diff, "ci_low": low, "ci_high": high}
