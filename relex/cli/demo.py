"""`relex demo [--quick] [--out DIR]`: parse the options, call `relex.demo.run_demo`, print where things are."""


def add_arguments(parser):
    parser.add_argument("--quick", action="store_true", help="about 5 minutes: fewer steps, rollouts, problems and tokens")
    parser.add_argument("--out", default=None, help="run folder (default runs/demo, or runs/demo-quick with --quick)")
    parser.add_argument("--config", default=None, help="training config (default: the packaged configs/smollm2-arithmetic.yaml)")
    parser.add_argument("--overwrite", action="store_true", help="replace the run folder of an earlier demo")


def run(args):
    from pathlib import Path

    from relex.accelerate.loop import read_jumps
    from relex.cli.common import console, table
    from relex.demo import ACCELERATED, DEFAULT, DEMO_CONFIG, PLAIN, QUICK, run_demo

    out = args.out or ("runs/demo-quick" if args.quick else "runs/demo")
    result = run_demo(QUICK if args.quick else DEFAULT, out, config_file=args.config or DEMO_CONFIG, overwrite=args.overwrite)
    names = {PLAIN: "plain GRPO", ACCELERATED: "relex accelerate"}
    rows = []
    for r in result.evaluation.checkpoints:
        run = Path(r.checkpoint).parent.name
        summary = result.runs.get(run)
        diff = r.diff_vs_first
        rows.append([names.get(run, "base"), summary["grpo_steps"] if summary else 0,
                     f"{summary['virtual_steps']:g}" if summary else "0", f"{r.accuracy:.3f} ({r.ci_low:.2f}–{r.ci_high:.2f})",
                     "—" if diff is None else f"{diff['diff']:+.3f} ({diff['ci_low']:+.2f}, {diff['ci_high']:+.2f})"])
    title = f"held-out accuracy on {result.evaluation.checkpoints[0].n} problems (95% CI), same seed and GRPO budget"
    console.print(table(title, ["final weights", "GRPO steps", "as if step", "accuracy", "Δ vs plain"], rows))
    console.print("jump decisions of the accelerated run (validation accuracy of the current weights → after):")
    for j in read_jumps(result.run_dir / ACCELERATED):
        verdict = f"jump to {j['chosen']['name']}" if j["jumped"] else "kept"
        console.print(f"  step {j['step']}: {j['validation_accuracy_before']:.3f} → {j['validation_accuracy_after']:.3f}, {verdict} ({j['reason']})")
    stages = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in result.seconds.items())
    console.print(f"time: {stages} (total {sum(result.seconds.values()) / 60:.1f} min)")
    console.print(f"run folder {result.run_dir}: report {result.report}, figures {result.run_dir / 'figures'}")
