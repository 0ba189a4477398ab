"""`relex demo [--quick] [--out DIR]`: parse the options, call `relex.demo.run_demo`, print where things are."""


def add_arguments(parser):
    parser.add_argument("--quick", action="store_true", help="a few minutes: fewer steps, rollouts, problems and tokens")
    parser.add_argument("--out", default=None, help="run folder (default runs/demo, or runs/demo-quick with --quick)")
    parser.add_argument("--config", default=None, help="training config (default: the packaged configs/smollm2-arithmetic.yaml)")
    parser.add_argument("--overwrite", action="store_true", help="replace the run folder of an earlier demo")


def run(args):
    from pathlib import Path

    from relex.cli.common import console, table
    from relex.demo import DEFAULT, DEMO_CONFIG, QUICK, run_demo
    from relex.plot import BASE, checkpoint_position
    from relex.report import short_label

    out = args.out or ("runs/demo-quick" if args.quick else "runs/demo")
    result = run_demo(QUICK if args.quick else DEFAULT, out, config_file=args.config or DEMO_CONFIG, overwrite=args.overwrite)
    rows = []
    for r in result.evaluation.checkpoints:
        series, step, _ = checkpoint_position(r.checkpoint, [result.run_dir])
        name = Path(r.checkpoint).name if series == BASE else short_label(r.checkpoint, result.run_dir)
        diff = r.diff_vs_first
        rows.append([name, step, f"{r.accuracy:.3f} ({r.ci_low:.2f}–{r.ci_high:.2f})",
                     "—" if diff is None else f"{diff['diff']:+.3f} ({diff['ci_low']:+.2f}, {diff['ci_high']:+.2f})"])
    title = f"held-out accuracy on {result.evaluation.checkpoints[0].n} problems (95% CI); fit on steps ≤ {result.observe_until} of {result.last_step}"
    console.print(table(title, ["checkpoint", "step", "accuracy", "Δ vs base"], rows))
    stages = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in result.seconds.items())
    console.print(f"time: {stages} (total {sum(result.seconds.values()) / 60:.1f} min)")
    console.print(f"run folder {result.run_dir}: report {result.report}, figures {result.run_dir / 'figures'}, "
                  f"checkpoints {result.run_dir / 'extrapolated'} and {result.run_dir / 'two-point'}")
