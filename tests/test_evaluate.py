"""relex.evaluate and `relex eval`: metrics by hand, planted verdicts, a tiny Llama end to end, bad input."""

from __future__ import annotations

import json
import re
import sys
import types
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from relex.cli import main
from relex.errors import RelexError
from relex.evaluate import evaluate, format_table
from relex.evaluate.metrics import (
    bootstrap_ci,
    majority_vote,
    mean_pass_at_k,
    paired_bootstrap_diff,
    pass_at_k,
    pass_at_k_values,
)

CHAIN_SUM = ["--task", "chain_sum", "--task-config", '{"min_terms":2,"max_terms":2,"min_digits":1,"max_digits":2}']


# ------------------------------------------------------------------------------------------------------ metrics


def test_pass_at_k_by_hand():
    # n=5 samples, c=2 correct: pass@k = 1 - C(3, k) / C(5, k)
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)
    assert pass_at_k(5, 2, 4) == 1.0  # fewer than 4 wrong samples: any 4 include a correct one
    assert pass_at_k(5, 2, 5) == 1.0
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 5, 1) == 1.0
    assert mean_pass_at_k([2, 0, 5], 5, 2) == pytest.approx((0.7 + 0.0 + 1.0) / 3)
    with pytest.raises(ValueError):
        pass_at_k(5, 6, 1)
    with pytest.raises(ValueError):
        pass_at_k(5, 2, 6)


def test_pass_at_k_values_are_powers_of_two_and_k():
    assert pass_at_k_values(1) == [1]
    assert pass_at_k_values(4) == [1, 2, 4]
    assert pass_at_k_values(6) == [1, 2, 4, 6]
    assert pass_at_k_values(16) == [1, 2, 4, 8, 16]


def test_majority_vote():
    assert majority_vote(["3", "4", "3", None]) == "3"
    assert majority_vote(["4", "3", "3", "4"]) == "4"  # a tie goes to the answer seen first
    assert majority_vote(["3", "4", "4", "3"]) == "3"
    assert majority_vote([None, "7", None, None]) == "7"  # None never wins
    assert majority_vote([None, None]) is None


def test_bootstrap_ci_contains_the_mean_and_shrinks_with_n():
    small = [1.0, 0.0] * 10
    large = [1.0, 0.0] * 1000
    low_s, high_s = bootstrap_ci(small)
    low_l, high_l = bootstrap_ci(large)
    assert low_s < 0.5 < high_s and low_l < 0.5 < high_l
    assert high_l - low_l < (high_s - low_s) / 5  # the width falls like 1/sqrt(n): 10x here
    assert bootstrap_ci([1.0] * 7) == (1.0, 1.0)
    assert bootstrap_ci(small, seed=3) == bootstrap_ci(small, seed=3)


def test_paired_bootstrap_diff():
    a = [1, 1, 1, 0, 1, 0, 1, 1]
    b = [1, 0, 1, 0, 0, 0, 1, 1]
    diff, low, high = paired_bootstrap_diff(a, b)
    assert diff == pytest.approx(0.25)
    assert 0.0 <= low <= diff <= high  # a never does worse than b on any problem
    assert paired_bootstrap_diff(b, b) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError):
        paired_bootstrap_diff([1, 0], [1, 0, 1])


# ------------------------------------------------------------------------------------- planted verdicts (no model)


@dataclass
class PlantedTask:
    """A stand-in Task: four held-out problems whose answers are 3, 5, 7 and 9."""

    name: str = "planted"
    verifier: str = "exact"
    splits: tuple = ("train", "eval")

    def rows(self, split, n=None):
        rows = [
            {"prompt": [{"role": "user", "content": f"problem {i}"}], "answer": str(3 + 2 * i), "id": f"p{i}"}
            for i in range(4)
        ]
        if n is not None and n > len(rows):
            raise RelexError(f"split {split} has {len(rows)} rows, asked for {n}")
        return rows[:n]


@pytest.fixture
def planted_verifiers(monkeypatch):
    """A stand-in relex.verifiers: exact match of the last number; the completion CRASH counts as a failure."""
    counting: list[Counter] = []  # the open count_failures() blocks

    def extract(text):
        numbers = re.findall(r"-?\d+", text)
        return numbers[-1] if numbers else None

    def exact(completions, answer, **columns):
        assert set(columns) == {"id"}  # every column but the prompt reaches the verifier
        scores = []
        for completion, gold in zip(completions, answer):
            if completion == "CRASH":
                for counted in counting:
                    counted["exact"] += 1
                scores.append(0.0)
            else:
                scores.append(float(extract(completion) == gold))
        return scores

    @contextmanager
    def count_failures():
        counting.append(Counter())
        try:
            yield counting[-1]
        finally:
            counting.pop()

    evaluation = sys.modules["relex.evaluate.evaluation"]  # the names it imported from relex.verifiers
    monkeypatch.setattr(evaluation, "get_verifier", lambda name: {"exact": exact}[name])
    monkeypatch.setattr(evaluation, "extract_final_answer", extract)
    monkeypatch.setattr(evaluation, "count_failures", count_failures)


class PlantedGenerator:
    def __init__(self, greedy: list[str], sampled: list[list[str]] | None = None):
        self.greedy, self.sampled = greedy, sampled
        self.calls = []

    def generate(self, prompts, *, samples, temperature, seed):
        self.calls.append((samples, temperature, seed))
        from relex.evaluate.generate import Completion

        texts = [[t] for t in self.greedy] if temperature == 0 else self.sampled
        return [[Completion(t, len(t.split())) for t in group] for group in texts[: len(prompts)]]

    def close(self):
        pass


def planted_factory(generators):
    @contextmanager
    def factory(checkpoint):
        yield generators[checkpoint]

    return factory


def test_planted_completions_give_the_expected_metrics(planted_verifiers, tmp_path):
    generators = {
        "a": PlantedGenerator(
            ["3", "the answer is 5", "6", "8"],  # 2 of 4 right
            [
                ["3", "3", "4", "3"],  # 3/4 right, majority 3: right
                ["4", "5", "4", "5"],  # 2/4 right, tie 4-5 goes to 4 (seen first): wrong
                ["1", "2", "3", "7"],  # 1/4 right, all tied, 1 first: wrong
                ["0", "0", "0", "0"],  # 0/4
            ],
        ),
        "b": PlantedGenerator(
            ["3", "5", "7", "CRASH"],  # 3 of 4 right, one verifier failure
            [["3"] * 4, ["5"] * 4, ["7"] * 4, ["CRASH", "9", "9", "0"]],
        ),
    }
    result = evaluate(
        ["a", "b"], PlantedTask(), samples=4, temperature=0.8, seed=5, out_dir=tmp_path / "out",
        max_new_tokens=3, generator_factory=planted_factory(generators),
    )
    a, b = result.checkpoints
    assert a.accuracy == 0.5 and b.accuracy == 0.75 and a.n == b.n == 4
    assert a.ci_low <= a.accuracy <= a.ci_high
    counts = [3, 2, 1, 0]
    assert a.pass_at_k == pytest.approx({k: mean_pass_at_k(counts, 4, k) for k in (1, 2, 4)})
    assert a.pass_at_k[1] == pytest.approx(6 / 16) and a.pass_at_k[4] == pytest.approx(3 / 4)
    assert a.maj_at_k == 0.25
    assert b.maj_at_k == 1.0  # problem 3 votes 9 (2 of 4) despite the crash
    assert a.verifier_failures == {} and b.verifier_failures == {"exact": 2}
    assert a.diff_vs_first is None and b.diff_vs_first["diff"] == pytest.approx(0.25)
    assert a.mean_tokens == pytest.approx((1 + 4 + 1 + 1) / 4)
    assert generators["a"].calls == [(1, 0.0, 5), (4, 0.8, 5)]

    records = [json.loads(line) for line in (tmp_path / "out" / "completions.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 4 * (1 + 4)
    greedy_b = [r for r in records if r["checkpoint"] == "b" and r["mode"] == "greedy"]
    assert [r["score"] for r in greedy_b] == [1.0, 1.0, 1.0, 0.0]
    assert greedy_b[0] | {"prompt": None} == {
        "checkpoint": "b", "problem_id": "p0", "mode": "greedy", "sample": 0, "prompt": None, "completion": "3",
        "answer": "3", "gold": "3", "score": 1.0, "correct": True, "n_tokens": 1,
    }
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["settings"]["seed"] == 5 and summary["checkpoints"][1]["verifier_failures"] == {"exact": 2}
    assert summary["checkpoints"][0]["pass_at_k"]["4"] == pytest.approx(0.75)

    table = format_table(result)
    assert "maj@4" in table and "+0.250" in table and len(table.splitlines()) == 4


def test_a_failure_while_writing_leaves_no_output_folder(planted_verifiers, tmp_path, monkeypatch):
    from relex.evaluate.evaluation import EvalResult

    def broken(self):
        raise OSError("disk full")

    monkeypatch.setattr(EvalResult, "summary", broken)
    factory = planted_factory({"a": PlantedGenerator(["3"] * 4)})
    with pytest.raises(OSError, match="disk full"):
        evaluate(["a"], PlantedTask(), out_dir=tmp_path / "out", generator_factory=factory)
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its temporary twin


def test_sampling_needs_a_temperature_before_any_generation(planted_verifiers, tmp_path):
    generator = PlantedGenerator(["3"] * 4)
    with pytest.raises(RelexError, match="--temperature"):
        evaluate(["a"], PlantedTask(), samples=4, generator_factory=planted_factory({"a": generator}))
    assert generator.calls == []


# ------------------------------------------------------------------------------------------ tiny Llama end to end


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Two tiny Llamas and a trajectory store whose step 10 is the second one."""
    import torch

    from relex.io.checkpoint import CheckpointReader
    from relex.models import make_tiny_llama
    from relex.store import TrajectoryStore

    root = tmp_path_factory.mktemp("eval-models")
    base = make_tiny_llama(root / "base", seed=0)
    later = make_tiny_llama(root / "later", seed=1)
    store = TrajectoryStore.create(root / "trajectory", base_dir=base, tensors=CheckpointReader(base).infos())
    store.append_checkpoint(10, later, torch.float32)
    return {"base": base, "later": later, "store": root / "trajectory"}


def test_end_to_end_on_chain_sum(tiny_models, tmp_path, capsys):
    out = tmp_path / "eval"
    status = main(
        ["eval", str(tiny_models["base"]), f"{tiny_models['store']}@10", *CHAIN_SUM, "--n", "4", "--samples", "2",
         "--temperature", "1.0", "--max-new-tokens", "8", "--batch-size", "4", "--out", str(out)]
    )
    printed = capsys.readouterr()
    assert status == 0, printed.err
    assert "greedy acc [95% CI]" in printed.out and "pass@2" in printed.out and "maj@2" in printed.out
    assert sorted(p.name for p in out.iterdir()) == ["completions.jsonl", "summary.json"]
    assert not list(tmp_path.glob(".eval*"))  # no temporary folder left beside it

    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 4 * (1 + 2)
    assert all(isinstance(r["score"], float) and 0 <= r["n_tokens"] <= 8 for r in records)
    assert {r["checkpoint"] for r in records} == {str(tiny_models["base"]), f"{tiny_models['store']}@10"}
    assert len({r["problem_id"] for r in records}) == 4
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"]["name"] and summary["settings"]["seed"] == 0
    first, second = summary["checkpoints"]
    for key in ("accuracy", "ci_low", "ci_high", "n", "pass_at_k", "maj_at_k", "mean_tokens", "verifier_failures",
                "diff_vs_first", "completions_per_s"):
        assert key in first, key
    assert first["n"] == 4 and set(first["pass_at_k"]) == {"1", "2"} and first["diff_vs_first"] is None
    assert set(second["diff_vs_first"]) == {"diff", "ci_low", "ci_high"}


def test_store_step_is_the_checkpoint_it_recorded(tiny_models, planted_verifiers):
    """Greedy completions of the materialised step 10 equal those of the folder it was recorded from."""
    result = evaluate(
        [str(tiny_models["later"]), f"{tiny_models['store']}@10"], PlantedTask(), max_new_tokens=6, batch_size=2
    )
    later, step = ([r["completion"] for r in c.records] for c in result.checkpoints)
    assert later == step and result.checkpoints[1].diff_vs_first["diff"] == 0.0


def test_generation_leaves_the_callers_random_stream_as_it_was(tiny_models, planted_verifiers):
    """Sampling is seeded for reproducible scores, but the caller's torch stream is put back afterwards (inside a
    training process, relex accelerate's validation must not change the rollouts GRPO draws next)."""
    import torch

    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = evaluate([str(tiny_models["base"])], PlantedTask(), samples=2, temperature=1.0, max_new_tokens=4, batch_size=2)
    assert torch.equal(torch.get_rng_state(), before)
    torch.rand(3)  # a different stream state: the seeded samples must not depend on it
    again = evaluate([str(tiny_models["base"])], PlantedTask(), samples=2, temperature=1.0, max_new_tokens=4, batch_size=2)
    assert [r["completion"] for r in first.checkpoints[0].records] == [r["completion"] for r in again.checkpoints[0].records]


# ------------------------------------------------------------------------------------------------ configuration


def test_task_names_become_task_specs():
    from relex.tasks.spec import task_spec_from_name

    assert task_spec_from_name("chain_sum") == {"source": "reasoning_gym", "name": "chain_sum"}
    assert task_spec_from_name("reasoning_gym:chain_sum") == {"source": "reasoning_gym", "name": "chain_sum"}
    assert task_spec_from_name("data/gsm8k.jsonl") == {"source": "jsonl", "name": "data/gsm8k.jsonl"}
    assert task_spec_from_name("hf:openai/gsm8k") == {"source": "hf", "name": "openai/gsm8k"}
    with pytest.raises(RelexError, match="hf:DATASET_ID"):
        task_spec_from_name("hf:")


def test_flags_override_the_config_file_and_task_file(tmp_path):
    from relex.evaluate.config import load_eval_config
    from relex.tasks import TaskSpec

    (tmp_path / "eval.yaml").write_text("checkpoints: [a, b]\ntask: chain_sum\nn: 50\nsamples: 8\ntemperature: 0.7\n")
    (tmp_path / "train.yaml").write_text("task:\n  source: reasoning_gym\n  name: chain_sum\n  eval_size: 40\nlr: 1\n")
    config = load_eval_config(str(tmp_path / "eval.yaml"), n=10, task_config='{"min_terms": 2}', checkpoints=[])
    assert (config.checkpoints, config.n, config.samples, config.temperature) == (["a", "b"], 10, 8, 0.7)
    assert config.task_spec() == TaskSpec(source="reasoning_gym", name="chain_sum", config={"min_terms": 2})
    config = load_eval_config(task_file=str(tmp_path / "train.yaml"), checkpoints=["a"])
    assert config.task_spec() == TaskSpec(source="reasoning_gym", name="chain_sum", eval_size=40)
    assert config.settings() == {"n": None, "samples": 1, "temperature": 0.0, "seed": 0, "backend": "transformers",
                                 "batch_size": 32, "max_new_tokens": 512}
    (tmp_path / "bad.yaml").write_text("checkpoint: [a]\n")
    with pytest.raises(RelexError, match="eval: unknown key 'checkpoint'; valid keys: n, samples, .*checkpoints"):
        load_eval_config(str(tmp_path / "bad.yaml"))


# ------------------------------------------------------------------------------------------------------ bad input


def run_eval(capsys, *argv):
    status = main(["eval", *argv])
    err = capsys.readouterr().err
    assert status != 0
    assert len(err.strip().splitlines()) == 1, err  # one line, no traceback
    return err


def test_bad_checkpoint_folders(tiny_models, tmp_path, capsys):
    out = tmp_path / "out"
    empty = tmp_path / "empty"
    empty.mkdir()
    err = run_eval(capsys, str(empty), *CHAIN_SUM, "--out", str(out))
    assert str(empty) in err and "config.json" in err
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((tiny_models["base"] / "config.json").read_text())
    err = run_eval(capsys, str(tiny_models["base"]), str(no_weights), *CHAIN_SUM, "--out", str(out))
    assert "no-weights" in err and "safetensors" in err
    err = run_eval(capsys, str(tmp_path / "missing" / "model"), *CHAIN_SUM, "--out", str(out))
    assert "missing" in err
    assert not out.exists()


def test_missing_store_step(tiny_models, tmp_path, capsys):
    out = tmp_path / "out"
    err = run_eval(capsys, f"{tiny_models['store']}@999", *CHAIN_SUM, "--out", str(out))
    assert "999" in err and "10" in err  # names the recorded steps
    err = run_eval(capsys, f"{tmp_path / 'run' / 'trajectory'}@40", *CHAIN_SUM, "--out", str(out))
    assert "trajectory" in err
    assert not out.exists()


def test_samples_without_temperature(tiny_models, tmp_path, capsys):
    out = tmp_path / "out"
    for extra in ([], ["--temperature", "0"]):
        err = run_eval(capsys, str(tiny_models["base"]), *CHAIN_SUM, "--samples", "4", *extra, "--out", str(out))
        assert "--temperature" in err
    assert not out.exists()


def test_n_larger_than_the_split(tiny_models, tmp_path, capsys):
    out = tmp_path / "out"
    run_eval(capsys, str(tiny_models["base"]), *CHAIN_SUM, "--n", "1000000", "--out", str(out))
    assert not out.exists()


def test_task_without_held_out_split(tiny_models, tmp_path, capsys, monkeypatch):
    import relex.evaluate.evaluation
    import relex.tasks

    train_only = relex.tasks.Task("planted", "exact", {"train": PlantedTask().rows("train"), "eval": []})
    monkeypatch.setattr(relex.evaluate.evaluation, "load_task", lambda spec: train_only)
    out = tmp_path / "out"
    err = run_eval(capsys, str(tiny_models["base"]), "--task", "planted", "--out", str(out))
    assert "held-out" in err and "planted" in err
    assert not out.exists()


def test_non_empty_output_folder_is_refused_unless_overwrite(tiny_models, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("earlier results")
    err = run_eval(capsys, str(tiny_models["base"]), *CHAIN_SUM, "--n", "2", "--out", str(out))
    assert str(out) in err and "--overwrite" in err
    assert (out / "keep.txt").read_text() == "earlier results"
    args = [str(tiny_models["base"]), *CHAIN_SUM, "--n", "2", "--max-new-tokens", "2", "--out", str(out)]
    assert main(["eval", *args, "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["completions.jsonl", "summary.json"]


def test_vllm_backend_missing(tiny_models, tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    err = run_eval(capsys, str(tiny_models["base"]), *CHAIN_SUM, "--backend", "vllm", "--out", str(tmp_path / "out"))
    assert "vLLM is not installed" in err and "--backend transformers" in err
    assert not (tmp_path / "out").exists()


def test_vllm_backend_through_a_stand_in(monkeypatch, planted_verifiers):
    """The vLLM generator's plumbing (prompts, sampling parameters, token counts) against a stand-in `vllm`."""
    import importlib.machinery

    seen = {}

    class Output:
        def __init__(self, text, stop_reason=None):
            self.text, self.token_ids = text, list(range(len(text.split()) + 1))  # + the eos vLLM keeps
            self.finish_reason, self.stop_reason = "stop", stop_reason

    class LLM:
        def __init__(self, model, dtype):
            seen["model"] = model

        def get_tokenizer(self):
            return types.SimpleNamespace(apply_chat_template=lambda m, **kw: m[-1]["content"])

        def generate(self, texts, params, use_tqdm):
            seen.setdefault("params", []).append(params)
            return [types.SimpleNamespace(outputs=[Output(str(3 + 2 * int(t.split()[-1])))] * params.n) for t in texts]

    fake = types.ModuleType("vllm")
    fake.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    fake.LLM, fake.SamplingParams = LLM, lambda **kw: types.SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", fake)

    result = evaluate(["org/model"], PlantedTask(), samples=2, temperature=0.5, backend="vllm", max_new_tokens=7)
    (checkpoint,) = result.checkpoints
    assert seen["model"] == "org/model" and checkpoint.accuracy == 1.0 and checkpoint.maj_at_k == 1.0
    assert [(p.n, p.temperature, p.max_tokens, p.top_p) for p in seen["params"]] == [(1, 0.0, 7, 1.0), (2, 0.5, 7, 1.0)]
    assert checkpoint.mean_tokens == 1.0  # the eos is not counted



@pytest.mark.parametrize("where", ["is", "contains", "lies inside"])
def test_overwrite_refuses_an_output_that_is_contains_or_lies_inside_a_checkpoint(tiny_models, capsys, where):
    base, store = tiny_models["base"], tiny_models["store"]
    before = {p: p.read_bytes() for folder in (base, store) for p in sorted(folder.rglob("*")) if p.is_file()}
    out = {"is": base, "contains": base.parent, "lies inside": store / "eval"}[where]
    err = run_eval(capsys, str(base), f"{store}@10", *CHAIN_SUM, "--n", "2", "--out", str(out), "--overwrite")
    assert f"{where} the input" in err and str(out) in err
    after = {p: p.read_bytes() for folder in (base, store) for p in sorted(folder.rglob("*")) if p.is_file()}
    assert after == before and not (store / "eval").exists()
