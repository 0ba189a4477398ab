"""`relex accelerate`: train → jump → train, each jump guarded by a validation score (relex.accelerate.loop).

    from relex.accelerate import run_accelerate
    from relex.train import load_config
    run_dir = run_accelerate(load_config("configs/tiny.yaml", out="runs/tiny-accel"))

`config` reads the `accelerate:` section of a train config, `decision` is the guard, `optimizer` the optimizer-state
policies, `warning` the early warning that linearity is breaking, `validation` scores weights on the live model.
"""

from relex.accelerate.config import AccelerateConfig
from relex.accelerate.run import run_accelerate

__all__ = ["AccelerateConfig", "run_accelerate"]
