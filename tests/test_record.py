"""relex.record: DeltaRecorder inside a plain HF Trainer on a tiny Llama (causal-LM loss on random tokens)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from relex import DeltaRecorder
from relex.errors import RelexError
from relex.io.checkpoint import CheckpointReader
from relex.store import TrajectoryStore

VOCAB = 64


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def random_tokens(n: int = 32, length: int = 16) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(0, VOCAB, (n, length), generator=generator)
    return [{"input_ids": row, "labels": row} for row in rows]


class Snapshots(TrainerCallback):
    """Copies every parameter at each optimizer step: the independent truth the recorder is checked against."""

    def __init__(self):
        self.at: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.at[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}


def trainer_for(model, tmp_path, max_steps: int, callbacks=(), **overrides) -> Trainer:
    options = dict(
        output_dir=str(tmp_path / "hf"), max_steps=max_steps, per_device_train_batch_size=4, learning_rate=1e-2,
        report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True, use_cpu=True, seed=0,
    )
    args = TrainingArguments(**{**options, **overrides})
    return Trainer(model=model, args=args, train_dataset=random_tokens(), callbacks=list(callbacks))


def test_records_real_steps_and_exact_deltas(tmp_path):
    model = tiny_model()
    theta0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    snapshots = Snapshots()
    recorder = DeltaRecorder(tmp_path / "trajectory", every=2)
    trainer = trainer_for(model, tmp_path, max_steps=5, callbacks=[snapshots])
    trainer.add_callback(recorder)  # as the README shows
    trainer.train()

    store = TrajectoryStore.open(tmp_path / "trajectory")
    assert store.steps == [2, 4, 5]  # every 2, plus the last step
    assert [t.step for t in recorder.timings] == [2, 4, 5] and all(t.seconds > 0 for t in recorder.timings)
    reader = store.reader()
    for name in store.trajectory_names:
        matrix = reader.read(name)
        for row, step in zip(matrix, store.steps):
            expected = (snapshots.at[step][name] - theta0[name]).reshape(-1)
            assert torch.equal(row, expected), (name, step)
    assert reader.read("model.layers.0.self_attn.q_proj.weight").abs().sum(dim=1).min() > 0
    overhead = recorder.overhead()
    assert overhead["records"] == 3 and overhead["steps"] == 5 and overhead["overhead"] > 0


def test_tied_tensors_are_recorded_once(tmp_path):
    model = tiny_model()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    trainer_for(model, tmp_path, max_steps=1, callbacks=[DeltaRecorder(tmp_path / "trajectory")]).train()
    store = TrajectoryStore.open(tmp_path / "trajectory")
    assert store.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in store.trajectory_names
    deltas = CheckpointReader.from_file(store.path / store.entries[0].path).names()
    assert "model.embed_tokens.weight" in deltas and "lm_head.weight" not in deltas
    # the base saved in the store loads as a user would, with the initial weights
    reloaded = LlamaForCausalLM.from_pretrained(store.base_dir)
    for name, tensor in tiny_model().state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_references_the_models_own_folder(tmp_path):
    tiny_model().save_pretrained(tmp_path / "model")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "model")
    trainer_for(model, tmp_path, max_steps=2, callbacks=[DeltaRecorder(tmp_path / "trajectory", every=1)]).train()
    store = TrajectoryStore.open(tmp_path / "trajectory")
    assert store.manifest["base"]["path"] == "../model"  # relative: the run folder can move
    assert store.base_dir.resolve() == (tmp_path / "model").resolve() and store.steps == [1, 2]
    assert not (store.path / "base").exists()


def test_refuses_a_store_from_another_base(tmp_path):
    trainer_for(tiny_model(seed=0), tmp_path, max_steps=1, callbacks=[DeltaRecorder(tmp_path / "trajectory")]).train()
    other = trainer_for(tiny_model(seed=1), tmp_path, max_steps=1, callbacks=[DeltaRecorder(tmp_path / "trajectory")])
    with pytest.raises(RelexError, match=r"tensor \S+ differs from the model's initial weights"):
        other.train()
    assert TrajectoryStore.open(tmp_path / "trajectory").steps == [1]


def test_refuses_a_base_with_other_shapes(tmp_path):
    tiny_model().save_pretrained(tmp_path / "base")
    config = tiny_model().config
    config.intermediate_size = 48
    wider = LlamaForCausalLM(config)
    trainer = trainer_for(wider, tmp_path, max_steps=1, callbacks=[DeltaRecorder(tmp_path / "t", base=tmp_path / "base")])
    with pytest.raises(RelexError, match=r"tensor model\.layers\.0\.mlp\.\w+_proj\.weight has shape"):
        trainer.train()


def test_a_step_already_recorded_is_refused(tmp_path):
    model = tiny_model()
    recorder = DeltaRecorder(tmp_path / "trajectory")
    recorder.attach(model)
    recorder.record(3)
    with pytest.raises(RelexError, match="step 3 is already recorded"):
        recorder.record(3)
    # a new training from step 0 into a store that already holds steps is refused before it trains
    again = DeltaRecorder(tmp_path / "trajectory")
    with pytest.raises(RelexError, match="already holds step 3"):
        again.attach(model, global_step=0)
    assert TrajectoryStore.open(tmp_path / "trajectory").steps == [3]


def test_resume_continues_the_store(tmp_path):
    kwargs = dict(save_strategy="steps", save_steps=2, save_only_model=False)
    first = DeltaRecorder(tmp_path / "trajectory", every=2)
    trainer_for(tiny_model(), tmp_path, max_steps=4, callbacks=[first], **kwargs).train()
    trainer = trainer_for(LlamaForCausalLM(tiny_model().config), tmp_path, max_steps=6, callbacks=[DeltaRecorder(tmp_path / "trajectory", every=2)], **kwargs)
    trainer.train(resume_from_checkpoint=str(tmp_path / "hf" / "checkpoint-4"))
    store = TrajectoryStore.open(tmp_path / "trajectory")
    assert store.steps == [2, 4, 6]
    # resuming from an earlier checkpoint would record steps 4 and 6 twice
    again = trainer_for(tiny_model(), tmp_path, max_steps=6, callbacks=[DeltaRecorder(tmp_path / "trajectory", every=2)], **kwargs)
    with pytest.raises(RelexError, match="already holds steps 4, 6"):
        again.train(resume_from_checkpoint=str(tmp_path / "hf" / "checkpoint-2"))


def test_every_must_be_positive():
    with pytest.raises(RelexError, match="every"):
        DeltaRecorder("x", every=0)


def test_a_killed_recorders_base_leftover_is_removed(tmp_path):
    import os

    dead = tmp_path / ".trajectory.base-tmp-999999999"  # no such process
    live = tmp_path / f".trajectory.base-tmp-{os.getppid()}"  # a running process's: its own business
    for folder in (dead, live):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
    recorder = DeltaRecorder(tmp_path / "trajectory")
    recorder.attach(tiny_model())  # saves θ₀ into the new store through its own .trajectory.base-tmp-PID
    assert not dead.exists() and live.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "trajectory"]
    assert (recorder.store.base_dir / "config.json").is_file()


def test_a_background_recorder_writes_the_same_deltas_while_training_goes_on(tmp_path, monkeypatch):
    model = tiny_model()
    theta0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    snapshots = Snapshots()
    recorder = DeltaRecorder(tmp_path / "trajectory", every=1, background=True)
    written_behind = []
    real_append = DeltaRecorder._append_behind

    def append_behind(self, step):
        written_behind.append(step)
        return real_append(self, step)

    monkeypatch.setattr(DeltaRecorder, "_append_behind", append_behind)
    trainer_for(model, tmp_path, max_steps=5, callbacks=[snapshots, recorder]).train()
    assert written_behind == [1, 2, 3, 4]  # the last step is written before training ends
    store = TrajectoryStore.open(tmp_path / "trajectory")
    assert store.steps == [1, 2, 3, 4, 5] and recorder._writer is None
    reader = store.reader()
    for name in store.trajectory_names:
        for row, step in zip(reader.read(name), store.steps):
            assert torch.equal(row, (snapshots.at[step][name] - theta0[name]).reshape(-1)), (name, step)
    assert [t.step for t in recorder.timings] == [1, 2, 3, 4, 5]


def test_a_step_the_trainer_saves_is_recorded_before_the_save(tmp_path):
    recorder = DeltaRecorder(tmp_path / "trajectory", every=1, background=True)
    seen = []

    class AtSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            seen.append((state.global_step, recorder._writer is None, list(TrajectoryStore.open(tmp_path / "trajectory").steps)))

    trainer = trainer_for(tiny_model(), tmp_path, max_steps=4, callbacks=[recorder, AtSave()], save_strategy="steps",
                          save_steps=2)
    trainer.train()
    assert seen[0] == (2, True, [1, 2])  # step 1 went behind; step 2, saved, was written before the checkpoint


def test_a_background_write_that_fails_ends_training_in_one_line(tmp_path, monkeypatch):
    recorder = DeltaRecorder(tmp_path / "trajectory", every=1, background=True)
    real = TrajectoryStore.append_deltas

    def full_disk(self, step, *args, **kwargs):
        if step == 2:
            raise OSError(28, "No space left on device")
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(TrajectoryStore, "append_deltas", full_disk)
    with pytest.raises(RelexError, match="recording in the background failed: .*No space left on device") as error:
        trainer_for(tiny_model(), tmp_path, max_steps=5, callbacks=[recorder]).train()
    assert len(str(error.value).splitlines()) == 1
    assert TrajectoryStore.open(tmp_path / "trajectory").steps == [1]
