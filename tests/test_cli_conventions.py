"""What a new user meets first: `relex` alone, --version, -v anywhere, one-line errors, clean piped output.

Also the horizon ratio, defined once for every method, and a store step without a tokenizer in `relex eval`.
"""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from relex import __version__
from relex.cli import COMMANDS, OnceFilter, build_parser
from relex.errors import RelexError
from relex.present import Table, Terminal
from tests.conftest import cli


@pytest.fixture
def store(tmp_path, planted):
    base, run, _ = planted
    assert cli("ingest", run, "--base", base, "--out", tmp_path / "store") == 0
    return tmp_path / "store"


def test_relex_alone_lists_the_commands(capsys):
    assert cli() == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS) and "--version" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli("--version")
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"relex {__version__}"


@pytest.mark.parametrize("argv", [
    ["-v", "fit", "store", "--out", "x"],
    ["fit", "store", "--out", "x", "-v"],
    ["fit", "store", "--verbose", "--out", "x"],
    ["plot", "variance", "fit", "--out", "x.png", "-v"],
])
def test_verbose_before_or_after_the_command(argv):
    assert build_parser(only=argv[1] if argv[0] == "-v" else argv[0]).parse_args(argv).verbose is True


def test_not_verbose_unless_asked():
    assert build_parser(only="fit").parse_args(["fit", "store", "--out", "x"]).verbose is False


def test_unreachable_hub_is_one_line(tmp_path, planted, capsys, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*args, **kwargs):
        raise LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub ...")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    _, run, _ = planted
    assert cli("ingest", run, "--base", "Qwen/Qwen2.5-Math-1.5B", "--out", tmp_path / "store") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hub cannot be reached" in err[0] and "not in the local cache" in err[0], err

    from relex.models import download_model

    with pytest.raises(RelexError, match="model Qwen/Qwen2.5-Math-1.5B is not in the local cache"):
        download_model("Qwen/Qwen2.5-Math-1.5B")


def test_horizon_ratio_is_target_over_last_observed_step_for_every_method(tmp_path, store):
    from relex.extrapolate import ExtrapolateConfig, extrapolate_store
    from relex.store import TrajectoryStore

    opened = TrajectoryStore.open(store)
    last = 13  # observe until 13: recorded steps 2, 4, 6, 9, 13
    for method in ("relex", "two-point", "per-param"):
        config = ExtrapolateConfig(targets=[1, 26], method=method)
        config.fit.observe_until = last
        reports = extrapolate_store(opened, tmp_path / method, config)
        assert [r.horizon_ratio for r in reports] == pytest.approx([1 / last, 26 / last]), method
        assert [r.interpolation for r in reports] == [True, False], method  # step 1 lies before the first recorded


def test_store_step_without_tokenizer_says_so(store):
    from relex.evaluate.checkpoints import parse_checkpoint

    with pytest.raises(RelexError, match=r"store recorded no tokenizer .*copy the model's tokenizer files into"):
        parse_checkpoint(f"{store}@13")


def test_repeated_warning_is_logged_once():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(OnceFilter())
    log = logging.getLogger("relex.test_once")
    log.addHandler(handler)
    try:
        for _ in range(3):
            log.warning("skipped %d held-out questions", 1)
        log.warning("skipped %d held-out questions", 2)
    finally:
        log.removeHandler(handler)
    assert stream.getvalue().splitlines() == ["skipped 1 held-out questions", "skipped 2 held-out questions"]


def test_wide_table_is_split_not_cropped():
    columns = ["method"] + [f"step {s}" for s in range(14, 62, 6)]
    rows = [["two-point"] + list(np.linspace(0.1, 2.0, len(columns) - 1)), ["relex"] + [1.5] * (len(columns) - 1)]
    console = Console(file=io.StringIO(), width=80)
    console.print(Terminal(Table("relative error, fit on steps ≤ 12", columns, rows)))
    out = console.file.getvalue()
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= 80
    assert all(c in out for c in columns) and "2.000" in out and out.count("two-point") == 2


def test_piped_output_has_no_progress_frames(tmp_path, store):
    """A subprocess with stdout and stderr piped, as in CI: no tqdm `\\r` frames."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TQDM_DISABLE", None)
    done = subprocess.run(
        [sys.executable, "-m", "relex", "extrapolate", str(store), "--targets", "40", "--method", "two-point",
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr and "\r" not in done.stdout
    assert "horizon ratio = step / 30" in done.stdout


def test_sweep_prints_the_horizon_ratio_as_extrapolate_does(tmp_path, monkeypatch, capsys):
    import relex.sweep
    from relex.sweep import Comparison, SweepResult

    def row(accuracy):
        return {"checkpoint": "x", "accuracy": accuracy, "ci_low": accuracy - 0.1, "ci_high": accuracy + 0.1, "n": 16}

    def fake_sweep(store, out, config):
        return SweepResult(
            Path(out), 18, row(0.3), Comparison("base", 0.2, 0.1, 0.3), Comparison("last", 0.0, -0.1, 0.1), 12,
            {t: row(0.3) for t in config.targets}, {"base": row(0.1), "last observed": row(0.3)},
        )

    monkeypatch.setattr(relex.sweep, "sweep", fake_sweep)
    assert cli("sweep", tmp_path, "--targets", "18,24", "--task", "chain_sum", "--out", tmp_path / "sweep") == 0
    out = capsys.readouterr().out
    assert "horizon ratio = step / 12, the last observed step" in out
    assert re.search(r"step 18 .*1\.500", out) and re.search(r"step 24 .*2\.000", out)


@pytest.mark.parametrize("argv", [["fit", "/nonexistent/store"], ["fit", "--bad-flag"]])
def test_a_command_leaves_the_garbage_collector_as_it_found_it(argv, monkeypatch):
    """Off while a command's modules import, on with them frozen while it runs; as before once it returns."""
    import gc

    import relex.cli

    load, seen = relex.cli._load, []

    def loading(name):
        seen.append((gc.isenabled(), gc.get_freeze_count()))
        return load(name)

    monkeypatch.setattr(relex.cli, "_load", loading)
    assert relex.cli.main(argv) == 2
    assert seen[0] == (False, 0)  # collecting nothing while the command's modules import
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:
        assert relex.cli.main(argv) == 2
        assert not gc.isenabled() and gc.get_freeze_count() == 0  # a caller that had it off keeps it off
    finally:
        gc.enable()


def test_a_command_runs_with_the_collector_on_and_its_imports_frozen(monkeypatch, capsys):
    import gc

    import relex.cli

    class Probe:
        @staticmethod
        def add_arguments(parser):
            pass

        @staticmethod
        def run(args):
            print(gc.isenabled(), gc.get_freeze_count() > 0)

    monkeypatch.setitem(relex.cli.COMMANDS, "probe", "a command that reports the collector's state")
    monkeypatch.setattr(relex.cli, "_load", lambda name: Probe)
    assert relex.cli.main(["probe"]) == 0
    assert capsys.readouterr().out.split() == ["True", "True"]
    assert gc.get_freeze_count() == 0


def test_the_process_ends_with_every_object_frozen_so_the_last_collection_skips_them(tmp_path):
    """At exit CPython's collector walks every unfrozen object (1.0-1.2 s after `relex fit` on the SmolLM2 store:
    scripts/bench_exit.py). relex.cli freezes them at exit, after the command has unfrozen what it froze."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import atexit, gc, sys\n"
        "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count()))\n"  # runs after relex.cli's
        "import relex.cli\n"
        "code = relex.cli.main(['fit', '/nonexistent/store'])\n"
        "print('after the command:', gc.get_freeze_count())\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    after, at_exit = (int(line.rsplit(" ", 1)[1]) for line in done.stdout.splitlines())
    assert after == 0  # the command leaves the collector as it found it (test above)
    assert at_exit > 10_000  # the interpreter's objects, relex's and what it imported: frozen before the last walk
