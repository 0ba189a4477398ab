"""`relex report RUN`: parse the options and call `relex.report.write_report`."""


def add_arguments(parser):
    parser.add_argument("run", help="a run folder (config.yaml, log.jsonl, trajectory/, fit/, backtest.json, eval/)")
    parser.add_argument("--out", default=None, help="the Markdown file to write (default RUN/report.md); figures go to figures/ beside it")


def run(args):
    from relex.cli.common import console
    from relex.report import write_report

    path = write_report(args.run, args.out)
    console.print(f"report written to {path} (figures in {path.parent / 'figures'})")
