"""GRPO training with verifiable rewards that records its own weight trajectory (`relex train`).

    from relex.train import load_config, run_training
    run_dir = run_training(load_config("configs/smollm2-arithmetic.yaml", out="runs/arith", max_steps=10))

`config` defines `TrainConfig` (the YAML file), `grpo` builds TRL's GRPOTrainer with the task, the verifier and
`relex.record.DeltaRecorder`, and `progress` writes RUN/log.jsonl and the progress bar.
"""

from relex.train.config import TrainConfig, load_config
from relex.train.grpo import run_training

__all__ = ["TrainConfig", "load_config", "run_training"]
