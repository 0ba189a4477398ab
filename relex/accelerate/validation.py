"""Scoring weights on the validation problems inside a running trainer, without writing or reloading a model.

The loop scores the current weights and every candidate with the same greedy generation and verifier as
`relex eval` (relex.evaluate.evaluate), on the live model: a candidate's tensors are copied into the model's
parameters, scored, and the current weights put back. Validation problems come from relex.sweep.validation_task:
another draw of the task's held-out split, minus the test questions, so they never overlap training or test.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

import torch

from relex.errors import RelexError
from relex.evaluate.generate import TransformersGenerator
from relex.sweep import validation_task
from relex.tasks import EVAL, Task, load_task
from relex.tasks.task import count_leaked

LOG = logging.getLogger(__name__)


class LiveGenerator(TransformersGenerator):
    """`TransformersGenerator` on a model that is already loaded (the trainer's), switched to eval mode while it runs."""

    def __init__(self, model, tokenizer, *, batch_size: int, max_new_tokens: int):  # noqa: D107 - no load
        self.model_path = getattr(getattr(model, "config", None), "_name_or_path", "live model")
        self.batch_size, self.max_new_tokens = batch_size, max_new_tokens
        self.device = next(model.parameters()).device
        self.model = model
        self.tokenizer = tokenizer
        if getattr(tokenizer, "chat_template", None) is None:
            raise RelexError("the trained model's tokenizer has no chat template to render validation prompts with")
        self.padding_side = tokenizer.padding_side
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.stop_ids = self._stop_ids()

    def generate(self, prompts, *, samples, temperature, seed):
        was_training = self.model.training
        self.tokenizer.padding_side = "left"
        self.model.eval()
        try:
            return super().generate(prompts, samples=samples, temperature=temperature, seed=seed)
        finally:
            self.tokenizer.padding_side = self.padding_side
            self.model.train(was_training)

    def close(self) -> None:  # the trainer owns the model
        pass


def validation_split(spec, n: int, train_rows: list[dict]):
    """The validation Task: `n` problems disjoint from the train and test problems, checked, in one line if not.

    A task whose held-out split can be drawn again with another seed (reasoning-gym, unlabelled files) gets a
    fresh draw minus the test questions (relex.sweep.validation_task); one with fixed split labels (a hub
    dataset's train/test) gets its last `n` train problems, which `carve_from_train` then keeps out of training."""
    if n < 1:
        raise RelexError("accelerate.validation_size: the validation split is empty; give at least one problem")
    try:
        task = validation_task(spec, n)
    except RelexError as error:
        if len(train_rows) < 2 * n:
            raise RelexError(f"{error}; carving {n} validation problems out of {len(train_rows)} train problems would leave too few") from None
        LOG.info("validation problems: the last %d of the train split (the held-out split cannot be redrawn)", n)
        return Task(f"{spec.name} (validation, from train)", load_verifier_name(spec), {EVAL: train_rows[-n:]})
    rows = task.rows(EVAL)
    leaked = count_leaked(train_rows, rows)
    if leaked:
        raise RelexError(f"task {task.name}: {leaked} of {n} validation problems also occur in the train split")
    return task


def split_confirmation(task, n: int):
    """(the first `n` validation problems, the rest): the problems that pick a candidate and those that confirm it."""
    rows = task.rows(EVAL)
    return (Task(task.name, task.verifier, {EVAL: rows[:n]}),
            Task(f"{task.name} (confirmation)", task.verifier, {EVAL: rows[n:]}))


def carved_from_train(task) -> bool:
    return task.name.endswith("(validation, from train)")


def load_verifier_name(spec) -> str:
    return load_task(spec).verifier


def snapshot(model) -> dict[str, torch.Tensor]:
    """A copy of every tensor of the model's state (the weights to return to after scoring candidates)."""
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def load_into(model, state: dict[str, torch.Tensor]) -> None:
    """Copy `state`'s tensors into the model's own (same names and shapes), in place."""
    own = model.state_dict()
    with torch.no_grad():
        for name, tensor in own.items():
            if name in state:
                tensor.copy_(state[name])


def read_folder(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder's safetensors shards."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(folder).glob("*.safetensors")):
        state.update(load_file(shard))
    if not state:
        raise RelexError(f"{folder}: no safetensors shard to load")
    return state


def tensors_of(source: str | Path | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of weights given as a Hugging Face folder (read) or already in memory (as they are)."""
    return read_folder(source) if isinstance(source, (str, Path)) else source


def check_complete(model, state: dict[str, torch.Tensor], where: str) -> None:
    """Every parameter of the model must be in `state` (tied aliases may be absent), with its shape."""
    for name, param in model.named_parameters():
        if name not in state:
            raise RelexError(f"{where}: has no tensor {name}")
        if tuple(state[name].shape) != tuple(param.shape):
            raise RelexError(f"{where}: tensor {name} has shape {tuple(state[name].shape)}, the model {tuple(param.shape)}")


@contextmanager
def scoring(model, generator: LiveGenerator, states: dict[str, object], restore: dict[str, torch.Tensor]):
    """A generator factory for relex.evaluate.evaluate: the checkpoint name picks the weights to load."""
    def factory(name: str):
        @contextmanager
        def opened():
            source = states[name]
            weights = tensors_of(source)
            if weights is not restore:
                check_complete(model, weights, str(source) if isinstance(source, (str, Path)) else name)
            load_into(model, weights)
            yield generator

        return opened()

    try:
        yield factory
    finally:
        load_into(model, restore)
