"""The figure of accelerated runs: validation accuracy against GRPO steps, jumps marked, next to plain runs.

    from relex.accelerate.figures import plot_jumps
    plot_jumps(["runs/accel", "runs/plain-control"], "jumps.png")

Left: each run's validation accuracy at every decision, against the GRPO steps spent (a jump is a vertical arrow
from the current weights' score to the chosen candidate's; a run made with `accelerate.jump: false` is the plain
control). Right: the step each run's weights stand for ("as if step": GRPO steps plus the steps jumps stood in for)
against the GRPO steps spent; the diagonal is plain training.
"""

from __future__ import annotations

from pathlib import Path

from relex.accelerate.loop import read_jumps
from relex.errors import RelexError
from relex.plot import _pyplot, _save

COLORS = ["tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:brown"]


def run_label(run: Path, jumps: list[dict]) -> str:
    jumped = sum(1 for j in jumps if j["jumped"])
    return f"{run.name} ({jumped} jump{'s' if jumped != 1 else ''} in {len(jumps)} decisions)"


def plot_jumps(runs: list[str | Path], out: str | Path, title: str | None = None) -> Path:
    if not runs:
        raise RelexError("give at least one run folder of relex accelerate")
    series = []
    for run in map(Path, runs):
        jumps = read_jumps(run)
        if not jumps:
            raise RelexError(f"{run}: no jumps.jsonl with decisions; it is not a relex accelerate run (or made none yet)")
        series.append((run, jumps))
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    top = 1
    for color, (run, jumps) in zip(COLORS * 4, series):
        steps = [0] + [j["step"] for j in jumps]
        accuracy = [None] + [j["validation_accuracy_after"] for j in jumps]
        left.plot(steps[1:], accuracy[1:], "-o", color=color, ms=4, label=run_label(run, jumps))
        for j in jumps:
            if j["jumped"]:
                left.annotate("", xy=(j["step"], j["validation_accuracy_after"]), xytext=(j["step"], j["validation_accuracy_before"]),
                              arrowprops={"arrowstyle": "->", "color": color, "lw": 1.5})
                left.plot(j["step"], j["validation_accuracy_before"], "o", mfc="white", color=color, ms=4)
        xs, virtual = [0.0], [0.0]  # training moves along the diagonal's slope, a jump straight up
        for j in jumps:
            xs += [j["step"], j["step"]]
            virtual += [j["virtual_step_before"], j["virtual_step_after"]]
        right.plot(xs, virtual, "-", color=color, label=run.name)
        right.plot([j["step"] for j in jumps if j["jumped"]], [j["virtual_step_after"] for j in jumps if j["jumped"]], "^", color=color, ms=6)
        top = max(top, max(virtual), max(steps))
    right.plot([0, top], [0, top], ":", color="grey", lw=1, label="plain training")
    left.set(xlabel="GRPO steps", ylabel="validation accuracy (greedy)", ylim=(-0.02, 1.02))
    left.set_title(title or "validation accuracy; arrows are jumps", fontsize=10)
    right.set(xlabel="GRPO steps", ylabel="as if step", xlim=(0, None), ylim=(0, None))
    right.set_title("the step the weights stand for", fontsize=10)
    left.legend(fontsize=7, loc="lower right")
    right.legend(fontsize=7, loc="upper left")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, out)
