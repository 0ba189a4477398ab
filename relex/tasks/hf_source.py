"""The `hf` task source: a Hugging Face hub dataset of question/answer records (needs network access).

    TaskSpec(source="hf", name="openai/gsm8k", config={"subset": "main"}, train_size=2000, eval_size=500)

Config: `subset` (the dataset configuration), `train_split` (default "train") and `eval_split` (default "test";
null for none). train_size / eval_size take the first rows of each split (all when unset).
"""

from __future__ import annotations

from typing import Any

from relex.errors import RelexError
from relex.tasks.records import record_row
from relex.tasks.task import EVAL, TASK_SOURCES, TRAIN, TaskSource


@TASK_SOURCES.register("hf")
class HfSource(TaskSource):
    default_verifier = "math"
    config_defaults = {"subset": None, "train_split": "train", "eval_split": "test"}

    def load(self) -> dict[str, list[dict[str, Any]]]:
        options = self.options()
        wanted = {TRAIN: options["train_split"], EVAL: options["eval_split"]}
        sizes = {TRAIN: self.spec.train_size, EVAL: self.spec.eval_size}
        return {
            split: self._rows(options["subset"], hub_split, sizes[split])
            for split, hub_split in wanted.items()
            if hub_split is not None
        }

    def _rows(self, subset: str | None, hub_split: str, size: int | None) -> list[dict[str, Any]]:
        import datasets

        data = datasets.load_dataset(self.spec.name, subset, split=hub_split)
        if size is not None and size > len(data):
            raise RelexError(f"task {self.task_name}: asked for {size} rows of {hub_split!r}, which has {len(data)}")
        if size is not None:
            data = data.select(range(size))
        where = f"{self.spec.name}[{hub_split}]"
        return [record_row(record, self.spec, f"{where} row {i}", f"{where}:{i}") for i, record in enumerate(data)]
