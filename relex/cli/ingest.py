"""`relex ingest CHECKPOINTS --base BASE --out STORE`: parse the options, call `relex.ingest.ingest`, show the store."""

from relex.ingest import ingest, parse_steps
from relex.io.hub import expand_revisions
from relex.present import show, store_summary
from relex.store import IO_MODES


def add_arguments(parser):
    parser.add_argument("checkpoints", nargs="+", help="a run folder, step folders, plain HF folders, or hf://ORG/REPO with --revisions")
    parser.add_argument(
        "--revisions", default=None,
        help="hub revisions holding the steps, e.g. 'step_{1..75}' or main,step_10 (fetched into the hub cache and read "
        "there; HF_HUB_OFFLINE=1 uses the cache only); steps from the digits ending each name, or --steps",
    )
    parser.add_argument("--base", required=True, help="the base checkpoint θ₀: a HF folder (or a hub id)")
    parser.add_argument("--out", required=True, help="the store folder to create")
    parser.add_argument("--steps", default=None, help="step numbers of plain folders, e.g. 10,20,40")
    parser.add_argument("--copy", action="store_true", help="write the deltas into the store instead of referencing the checkpoints")
    parser.add_argument("--delta-dtype", default=None, help="with --copy: store deltas as bf16 or fp16 (default: lossless float32)")
    parser.add_argument(
        "--overwrite", action="store_true",
        help="replace an existing store once the new one is complete (never an input: the run, a checkpoint or the base)",
    )
    parser.add_argument(
        "--verify", action="store_true",
        help="read every value now and refuse NaN/Inf here (by default only names, shapes, dtypes and file headers are "
        "checked, and the fit or extrapolation that reads the values refuses them, naming the tensor and step)",
    )
    parser.add_argument(
        "--io", default="auto", choices=IO_MODES,
        help="with --copy: how the deltas are written; auto and direct go past the page cache (O_DIRECT, where the file "
        "system allows), cached through it (default: auto)",
    )
    parser.add_argument(
        "--repoint", action="store_true",
        help="point the existing store --out at the same checkpoints in a new place (a run folder that moved)",
    )


def run(args):
    store = ingest(
        args.checkpoints, args.base, args.out, steps=parse_steps(args.steps), copy=args.copy,
        delta_dtype=args.delta_dtype, overwrite=args.overwrite, repoint=args.repoint,
        revisions=expand_revisions(args.revisions) if args.revisions is not None else None, verify=args.verify, io=args.io,
    )
    show(store_summary(store, repointed_at=args.checkpoints if args.repoint else None))
