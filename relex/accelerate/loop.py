"""`relex accelerate`: GRPO segments of m optimizer steps alternating with guarded jumps (train → jump → train).

    from relex.accelerate import run_accelerate
    from relex.train import load_config
    run_dir = run_accelerate(load_config("configs/tiny.yaml", out="runs/tiny-accel"))

One TRL `GRPOTrainer` runs the whole GRPO budget (`grpo.max_steps` optimizer steps); a `JumpController` callback
stops at the end of every segment (right after the step is logged, before a checkpoint is saved) and

1. fits the segment: its deltas θ_s − θ_start were recorded at every step into the segment's own trajectory store,
   at local steps 1..m (base = the segment's start weights), so every relex method applies unchanged;
2. checks the early warning (relex.accelerate.warning) and, unless it is raised, forms one candidate per method × α
   × λ in memory with the pass of `relex extrapolate` (target = start + α·m, relex-anchored continues from the real
   weights); with keep_candidates they are written as checkpoint folders instead;
3. scores the current weights and each candidate on the validation problems (greedy, paired, on the live model);
4. picks the best candidate when the guard allows it (relex.accelerate.decision) and, with `confirm_size` > 0,
   scores it and the current weights again on fresh validation problems, where it must pass the guard a second
   time (the pick itself overstates the gain of the best of several candidates on the problems that picked it);
5. jumps to it, applies the optimizer policy (relex.accelerate.optimizer), and starts the next segment there.

With `rollback: true` (the default) the weights the segment started from (its store's base folder: the last
decision's choice) are one more candidate, judged by the same guard even when the warning stops the jump
candidates, and confirmed only with an interval above zero (relex.accelerate.decision); taking it undoes the
segment's GRPO steps and resets the optimizer, whatever the policy. It is the way back when training after a jump
went wrong (analysis/README.md, sections 5d and 5e).

The run folder:

    RUN/config.yaml, RUN/log.jsonl   as `relex train` writes them (GRPO steps only)
    RUN/jumps.jsonl                  one line per decision: step, candidates and their scores, signals, choice, times
    RUN/segments/NNN/                one trajectory store per segment: base = the weights it started from, local
                                     steps 1..m; its manifest's created_by says where the segment starts and how
                                     its start weights came about (a jump, or plain training)
    RUN/jumps/NNN/fit/               the segment's fit
    RUN/jumps/NNN/candidates/        the candidate folders, only with keep_candidates (otherwise formed in memory)
    RUN/final/                       the final weights, a Hugging Face folder
    RUN/summary.json                 GRPO steps, jumps, and wall time split into GRPO, fit, candidates, validation

Resuming (`--resume`, with `record.resumable: true`): checkpoints are saved at segment ends, after the decision, so a
checkpoint holds the chosen weights and the optimizer state the policy left. The run continues from the last one:
decisions after it are dropped, the segment that starts there is recorded anew, and a segment cut short is continued.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from transformers import TrainerCallback

from relex.accelerate.config import AccelerateConfig
from relex.accelerate.decision import ROLLBACK, Candidate, Confirmation, Decision, confirm, decide
from relex.accelerate.optimizer import apply_policy
from relex.accelerate.validation import (
    LiveGenerator,
    load_into,
    scoring,
    snapshot,
    tensors_of,
)
from relex.accelerate.warning import Signals, check, fit_signals, reward_slope
from relex.evaluate import evaluate
from relex.extrapolate import ExtrapolateConfig, extrapolate_states, extrapolate_store
from relex.fit import FitConfig, fit_store
from relex.present import decision_kind
from relex.record import (
    DeltaRecorder,
    RecordTiming,
    float_state,
    save_base,
    unwrap_model,
)
from relex.store import TrajectoryStore, is_store
from relex.train.progress import read_log

LOG = logging.getLogger(__name__)

JUMPS_LOG = "jumps.jsonl"
SEGMENTS = "segments"
JUMPS = "jumps"
FINAL = "final"
CURRENT = "current"


def segment_dir(run_dir: Path, index: int) -> Path:
    return run_dir / SEGMENTS / f"{index:03d}"


def read_jumps(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / JUMPS_LOG
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jumps(run_dir: Path, lines: list[dict]) -> None:
    """Replace jumps.jsonl whole (a temporary file renamed over it)."""
    path = Path(run_dir) / JUMPS_LOG
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    tmp.replace(path)


# ---- one segment's recording ----------------------------------------------------------------------------------------
class SegmentRecorder(DeltaRecorder):
    """A DeltaRecorder for one segment: θ₀ is the segment's start weights, steps are local (GRPO step − start).

    It is driven by the JumpController, not registered with the trainer itself."""

    def __init__(self, store_dir: Path, start: int, origin: dict, delta_dtype=None):
        super().__init__(store_dir, every=1, delta_dtype=delta_dtype)
        self.start = start
        self.origin = origin

    def on_train_begin(self, *args, **kwargs):  # driven by the controller
        pass

    def on_step_end(self, *args, **kwargs):
        pass

    def on_train_end(self, *args, **kwargs):
        pass

    def begin(self, model, global_step: int, processing_class=None) -> None:
        self.attach(model, global_step - self.start, processing_class)

    def step(self, global_step: int) -> None:
        local = global_step - self.start
        if self.store is not None and local > 0 and local not in self.store.steps:
            self.record(local)

    def _matching_base_folder(self, model, live, theta0):
        # the first segment starts from the model's own folder; later ones from weights no folder holds yet
        return super()._matching_base_folder(model, live, theta0) if self.start == 0 and not self.origin.get("jump") else None

    def _provenance(self, model) -> dict:
        return {**super()._provenance(model), "command": "relex accelerate", "segment_start_step": self.start, "origin": self.origin}


# ---- the scorer -----------------------------------------------------------------------------------------------------
@dataclass
class ValidationScorer:
    """Scores weights on the validation problems with relex.evaluate on the live model; returns 0/1 per problem."""

    task: object
    n: int
    batch_size: int
    max_new_tokens: int
    seed: int = 0

    def __call__(self, model, tokenizer, states: dict[str, object], restore) -> dict[str, list[float]]:
        generator = LiveGenerator(model, tokenizer, batch_size=self.batch_size, max_new_tokens=self.max_new_tokens)
        with scoring(model, generator, states, restore) as factory:
            result = evaluate(list(states), self.task, n=self.n, seed=self.seed, generator_factory=factory,
                              max_new_tokens=self.max_new_tokens, batch_size=self.batch_size)
        return {r.checkpoint: r.greedy_correct() for r in result.checkpoints}


# ---- the controller ---------------------------------------------------------------------------------------------------
@dataclass
class Timing:
    fit: float = 0.0
    candidates: float = 0.0
    validation: float = 0.0
    policy: float = 0.0

    def total(self) -> float:
        return self.fit + self.candidates + self.validation + self.policy


@dataclass
class JumpController(TrainerCallback):
    """Runs the segments, the decisions and the jumps of `relex accelerate` inside one GRPO trainer."""

    run_dir: Path
    config: AccelerateConfig
    scorer: object  # (model, tokenizer, states, restore) -> {name: [0/1 per validation problem]}
    confirmer: object = None  # the same on fresh problems, for the confirmation of a picked candidate (None: none)
    delta_dtype: object = None
    rollouts_per_step: int = 0
    step_logger: object = None  # relex.train.progress.StepLogger: told how long a decision took
    segment: SegmentRecorder | None = None
    segment_index: int = 0
    virtual_step: float = 0.0  # GRPO steps plus the steps jumps stood in for
    jump_seconds: Timing = field(default_factory=Timing)
    started: float = 0.0
    _model: object = None
    _tokenizer: object = None
    _optimizer: object = None
    _previous_store: TrajectoryStore | None = None  # the previous segment's store (for the drift signal)

    @property
    def timings(self):
        """The current segment's record timings at GRPO step numbers (what the StepLogger reads)."""
        if self.segment is None:
            return []
        return [RecordTiming(t.step + self.segment.start, t.seconds, t.nbytes) for t in self.segment.timings]

    # ---- trainer events ------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, processing_class=None, optimizer=None, **kwargs):
        self._model, self._tokenizer, self._optimizer = unwrap_model(model), processing_class, optimizer
        self.started = time.perf_counter()
        jumps = self._resume_point(state.global_step)
        self.virtual_step = jumps[-1]["virtual_step_after"] if jumps else float(state.global_step)
        if self.segment is None:
            origin = {"jump": False, "after_step": state.global_step} if not jumps else _origin(jumps[-1])
            self._start_segment(state.global_step, origin)

    def on_step_end(self, args, state, control, **kwargs):
        self.segment.step(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "reward" not in logs:
            return
        length = state.global_step - self.segment.start
        if length >= self.config.segment_steps or (state.global_step >= state.max_steps and length > 0):
            started = time.perf_counter()
            self._decide(state)
            if self.step_logger is not None:
                self.step_logger.exclude(time.perf_counter() - started)

    def on_train_end(self, args, state, control, **kwargs):
        final = self.run_dir / FINAL
        if final.exists():
            shutil.rmtree(final)
        tmp = self.run_dir / f".{FINAL}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_base(self._model, float_state(self._model), tmp, self._tokenizer)
        jumps = read_jumps(self.run_dir)
        provenance = {  # what `relex plot accuracy` and `relex report` read: the GRPO steps spent are the x axis
            "made_by": "relex accelerate", "method": "accelerate" if self.config.jump else "plain GRPO",
            "target_step": state.global_step, "grpo_steps": state.global_step, "as_if_step": self.virtual_step,
            "jumps": sum(1 for j in jumps if j["jumped"]), "decisions": len(jumps), "run": str(self.run_dir.resolve()),
        }
        (tmp / "relex.json").write_text(json.dumps(provenance, indent=1) + "\n")
        tmp.rename(final)
        self._write_summary(state)

    # ---- segments --------------------------------------------------------------------------------------------------
    def _start_segment(self, global_step: int, origin: dict) -> None:
        self.segment = SegmentRecorder(segment_dir(self.run_dir, self.segment_index), global_step, origin, self.delta_dtype)
        self.segment.begin(self._model, global_step, self._tokenizer)

    def _resume_point(self, global_step: int) -> list[dict]:
        """Drop what happened after `global_step` (decisions, segments), reopen a segment cut short; the jumps kept."""
        jumps = [j for j in read_jumps(self.run_dir) if j["step"] <= global_step]
        write_jumps(self.run_dir, jumps)
        for folder in sorted((self.run_dir / JUMPS).glob("[0-9][0-9][0-9]")):
            if int(folder.name) >= len(jumps):
                shutil.rmtree(folder)
        kept, created = 0, {}  # created: the last kept segment's provenance
        for folder in sorted((self.run_dir / SEGMENTS).glob("[0-9][0-9][0-9]")):
            made = TrajectoryStore.open(folder).manifest["created_by"] if is_store(folder) else {}
            if made.get("segment_start_step") is None or made["segment_start_step"] >= global_step:
                shutil.rmtree(folder)
            else:
                kept, created = kept + 1, made
        self.segment_index = kept
        if kept:  # a segment that started before the checkpoint and has no decision at its end yet: continue it
            folder = segment_dir(self.run_dir, kept - 1)
            decided = any(j["segment"] == kept - 1 for j in jumps)
            if not decided:
                self.segment_index = kept - 1
                self.segment = SegmentRecorder(folder, created["segment_start_step"], created.get("origin", {}), self.delta_dtype)
                self.segment.begin(self._model, global_step, self._tokenizer)
                LOG.info("continuing segment %d at GRPO step %d", kept - 1, global_step)
        return jumps

    # ---- a decision --------------------------------------------------------------------------------------------------
    def _decide(self, state) -> None:
        step, start = state.global_step, self.segment.start
        length = step - start
        timing = Timing()
        jump_dir = self.run_dir / JUMPS / f"{self.segment_index:03d}"
        signals = Signals(reward_slope=reward_slope(_rewards(state), self.config.warning.reward_window))
        candidates = self._prepare(jump_dir, signals, timing, start, length)
        if self.config.jump and self.config.rollback:  # the segment's start weights: its store's base folder
            candidates.append(Candidate(ROLLBACK, 0.0, 1.0, start, self.segment.store.base_dir))
        tick = time.perf_counter()
        current = snapshot(self._model)
        scores = self.scorer(self._model, self._tokenizer, {CURRENT: current, **{c.name: c.source for c in candidates}}, current)
        for c in candidates:
            c.correct = scores[c.name]
            c.accuracy = float(np.mean(c.correct))
        decision = decide(candidates, scores[CURRENT], margin=self.config.margin, min_gain=self.config.min_gain, seed=step,
                          confirmation_follows=self.confirmer is not None)
        confirmation = self._confirm(decision, current, step) if decision.jump else None
        timing.validation = time.perf_counter() - tick
        reason = self._reason(decision, confirmation, signals, length)
        tick = time.perf_counter()
        virtual_before = self.virtual_step + length
        self._previous_store = self.segment.store
        jumped = decision.jump and (confirmation is None or confirmation.jump)
        chosen = decision.chosen if jumped else None
        if chosen is not None:
            load_into(self._model, tensors_of(chosen.source))
            # going back, the moments belong to the steps undone: they are dropped whatever the policy
            apply_policy(self._optimizer, "reset" if chosen.is_rollback else self.config.optimizer, chosen.target - step)
        self.virtual_step = virtual_before + (chosen.target - step if chosen else 0)
        timing.policy = time.perf_counter() - tick
        current_accuracy = float(np.mean(scores[CURRENT]))
        line = {
            "segment": self.segment_index, "step": step, "segment_start": start, "jumped": jumped,
            "chosen": chosen.to_dict() if chosen else None, "reason": reason,
            "validation_accuracy_before": current_accuracy,
            "validation_accuracy_after": chosen.accuracy if chosen else current_accuracy,
            "validation_n": len(scores[CURRENT]), "virtual_step_before": virtual_before,
            "virtual_step_after": self.virtual_step, "optimizer": self.config.optimizer,
            "candidates": [c.to_dict() for c in candidates], "signals": signals.to_dict(),
            "confirmation": confirmation.to_dict() if confirmation else None,
            "seconds": {"fit": timing.fit, "candidates": timing.candidates, "validation": timing.validation, "policy": timing.policy},
        }
        LOG.info("step %d: %s (%s)", step, ("rollback" if chosen.is_rollback else "jump") if chosen else "kept", reason)
        for c in candidates:
            c.weights = None  # the candidates' tensors are not needed after the decision
        self._cleanup(jump_dir)
        self._record(line, timing)
        if step < state.max_steps or jumped:
            self.segment_index += 1
            self._start_segment(step, _origin(line))

    def _prepare(self, jump_dir: Path, signals: Signals, timing: Timing, start: int, length: int) -> list[Candidate]:
        """Fit the segment, fill in the warning's signals and, unless the warning is raised, write the candidates."""
        if not (self.config.jump and length >= 2):
            check(signals, self.config.warning)
            return []
        tick = time.perf_counter()
        fit = self._fit(jump_dir)
        signals.explained_variance, signals.r2 = fit_signals(fit)
        signals.cosine = self._drift()
        timing.fit = time.perf_counter() - tick
        check(signals, self.config.warning)
        if signals.raised:
            return []
        tick = time.perf_counter()
        candidates = self._write_candidates(jump_dir, fit, start, length)
        timing.candidates = time.perf_counter() - tick
        return candidates

    def _confirm(self, decision: Decision, current: dict, step: int) -> Confirmation | None:
        """The picked candidate against the current weights on the fresh confirmation problems (None: the run has
        no confirmation problems, confirm_size 0)."""
        if self.confirmer is None:
            return None
        chosen = decision.chosen
        scores = self.confirmer(self._model, self._tokenizer, {CURRENT: current, chosen.name: chosen.source}, current)
        return confirm(chosen, scores[chosen.name], scores[CURRENT], margin=self.config.margin,
                       min_gain=self.config.min_gain, seed=step)

    def _reason(self, decision: Decision, confirmation: Confirmation | None, signals: Signals, length: int) -> str:
        judged = f"{decision.reason}; confirmation: {confirmation.reason}" if confirmation is not None else decision.reason
        if not self.config.jump:
            return "jumps are off (accelerate.jump: false)"
        if length < 2 or signals.raised:  # no jump candidates; a rollback, when offered, was judged all the same
            why = f"the segment has {length} step; a fit needs 2" if length < 2 else "linearity warning: " + "; ".join(signals.reasons)
            return f"{why}; {judged}" if decision.chosen is not None and decision.chosen.is_rollback else why
        return judged

    def _record(self, line: dict, timing: Timing) -> None:
        write_jumps(self.run_dir, [*read_jumps(self.run_dir), line])
        for key in ("fit", "candidates", "validation", "policy"):
            setattr(self.jump_seconds, key, getattr(self.jump_seconds, key) + getattr(timing, key))

    def _fit(self, jump_dir: Path):
        fit = fit_store(self.segment.store, FitConfig(rank=self.config.rank))
        fit.save(jump_dir / "fit", overwrite=True)
        return fit

    def _write_candidates(self, jump_dir: Path, fit, start: int, length: int) -> list[Candidate]:
        """One candidate per method × λ × α, formed in memory (the scorer loads their tensors into the model), or
        written under jump_dir/candidates when they are to be kept (keep_candidates)."""
        targets = sorted({max(length + 1, int(round(alpha * length))) for alpha in self.config.alphas})
        candidates = []
        for method in self.config.methods:
            for scale in self.config.scales:
                config = ExtrapolateConfig(targets=targets, method=method, fit=FitConfig(rank=self.config.rank),
                                           scale=scale, keep=tuple(self.config.keep), overwrite=True)
                if self.config.keep_candidates:
                    reports = extrapolate_store(self.segment.store, jump_dir / "candidates" / f"{method}-l{scale:g}", config, fit)
                    states = [None] * len(reports)
                else:
                    reports, states = extrapolate_states(self.segment.store, config, fit)
                candidates += [Candidate(method, r.target / length, scale, start + r.target, r.path if w is None else None, w)
                               for r, w in zip(reports, states)]
        return candidates

    def _drift(self) -> float | None:
        """Median over tensors of cos(this segment's displacement, the previous segment's): each is its store's
        last delta, read one tensor at a time from the two stores (memory holds two tensors, never a model)."""
        previous, current = self._previous_store, self.segment.store
        if previous is None or not previous.steps or not current.steps:
            return None
        before, now = previous.reader([previous.steps[-1]]), current.reader([current.steps[-1]])
        cosines = []
        for name in current.trajectory_names:
            if name not in previous.tensors:
                continue
            a, b = now.read(name).reshape(-1).double(), before.read(name).reshape(-1).double()
            denominator = float(a.norm() * b.norm())
            if denominator > 0:
                cosines.append(float(a @ b) / denominator)
        return float(np.median(cosines)) if cosines else None

    def _cleanup(self, jump_dir: Path) -> None:
        if not self.config.keep_candidates:
            shutil.rmtree(jump_dir / "candidates", ignore_errors=True)

    def _write_summary(self, state) -> None:
        jumps = read_jumps(self.run_dir)
        lines = read_log(self.run_dir / "log.jsonl")
        wall = time.perf_counter() - self.started
        decisions = sum(j["seconds"][k] for j in jumps for k in ("fit", "candidates", "validation", "policy"))
        kinds = [decision_kind(j) for j in jumps]
        summary = {
            "grpo_steps": state.global_step,
            "virtual_steps": self.virtual_step,
            "decisions": len(jumps),
            "jumps": kinds.count("jump"),  # forward only
            "rollbacks": kinds.count("rollback"),
            "final_validation_accuracy": jumps[-1]["validation_accuracy_after"] if jumps else None,
            "rollouts": state.global_step * self.rollouts_per_step,
            "validation_generations": sum(
                j["validation_n"] * (1 + len(j["candidates"])) + 2 * (j.get("confirmation") or {}).get("n", 0) for j in jumps
            ),
            "seconds": {
                "wall": wall,
                "grpo": sum(line.get("step_seconds", 0.0) for line in lines),
                **{k: sum(j["seconds"][k] for j in jumps) for k in ("fit", "candidates", "validation", "policy")},
                "decisions": decisions,
            },
            "config": self.config.to_dict(),
        }
        (self.run_dir / "accelerate-summary.json").write_text(json.dumps(summary, indent=1) + "\n")


def _origin(line: dict) -> dict:
    chosen = line.get("chosen")
    return {"jump": bool(line["jumped"]), "after_step": line["step"], "decision_segment": line["segment"],
            "method": chosen["method"] if chosen else None, "alpha": chosen["alpha"] if chosen else None,
            "scale": chosen["scale"] if chosen else None, "target": chosen["target"] if chosen else None}


def _rewards(state) -> list[float]:
    """The reward of every GRPO step logged so far (the trainer's log history, this step included)."""
    return [entry["reward"] for entry in state.log_history if "reward" in entry]
