"""`relex report RUN`: parse the options, call `relex.report.write_report`, say where the report is."""

from relex.present import show
from relex.report import write_report


def add_arguments(parser):
    parser.add_argument("run", help="a run folder (config.yaml, log.jsonl, trajectory/, fit/, backtest.json, eval/)")
    parser.add_argument("--out", default=None, help="the Markdown file to write (default RUN/report.md); figures go to figures/ beside it")


def run(args):
    path = write_report(args.run, args.out)
    show(f"report written to {path} (figures in {path.parent / 'figures'})")
