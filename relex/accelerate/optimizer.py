"""What happens to the optimizer's state when the weights jump (the `accelerate.optimizer` policy).

- `reset`: every parameter's state is dropped, as RL-Extra does after each extrapolation (arXiv 2601.04537):
  Adam starts again from zero moments at the jumped weights.
- `keep`: the moments stay as they were at the segment's end, as if the jump had not happened.
- `rescale`: the moments are aged as if the jumped-over steps had passed without a gradient: k = the jump's
  horizon beyond the segment's end in steps, first moments × β₁ᵏ, second moments × β₂ᵏ and the step count + k
  (so Adam's bias correction matches the moments' age).

Only optimizers with Adam's state (`exp_avg`, `exp_avg_sq`, `step`) can be rescaled; others are refused in one line.
"""

from __future__ import annotations

import torch

from relex.errors import RelexError


def unwrap_optimizer(optimizer):
    """The torch optimizer under accelerate's `AcceleratedOptimizer` (or the same object)."""
    while hasattr(optimizer, "optimizer") and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def apply_policy(optimizer, policy: str, skipped_steps: int) -> None:
    """Change the optimizer's state after a jump over `skipped_steps` GRPO steps."""
    optimizer = unwrap_optimizer(optimizer)
    if policy == "keep":
        return
    if policy == "reset":
        optimizer.state.clear()
        return
    if policy != "rescale":
        raise RelexError(f"unknown optimizer policy {policy!r}; valid: reset, keep, rescale")
    k = max(0, int(skipped_steps))
    for group in optimizer.param_groups:
        beta1, beta2 = group.get("betas", (None, None))
        if beta1 is None:
            raise RelexError(f"optimizer {type(optimizer).__name__}: no Adam betas, so its moments cannot be rescaled; use reset or keep")
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                continue
            with torch.no_grad():
                state["exp_avg"].mul_(beta1**k)
                state["exp_avg_sq"].mul_(beta2**k)
                if torch.is_tensor(state["step"]):
                    state["step"].add_(k)
                else:
                    state["step"] += k
