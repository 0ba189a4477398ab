"""The layers of relex, checked from its imports (top-level and in-function alike): a module imports only its own
layer or lower ones, so the store never reaches up into the fit, nor the fit into a command.

    cli                          one thin module per subcommand
    demo, report                 what a person runs end to end and reads
    accelerate                   train → jump → train
    sweep, train, backtest, plot, distributed     pipeline commands
    evaluate                     generation and scoring of checkpoints
    present                      tables of results, rendered to the terminal, Markdown and plain text
    ingest, record, record_sharded, recording, extrapolate   what writes stores and checkpoints
    fit                          Gram matrices and the rank-r fit
    store, verifiers, tasks      the trajectory store; rewards and problems
    io, models, synthetic        files, the embedded model, planted runs
    errors, registry, ranks, settings, util   shared by everything (ranks: the processes torchrun starts; settings:
                                 the settings base; util: small helpers)
"""

from __future__ import annotations

import ast
from pathlib import Path

LAYERS = [
    {"cli", "__main__"},
    {"demo", "report"},
    {"accelerate"},
    {"sweep", "train", "backtest", "plot", "distributed"},
    {"evaluate"},
    {"present"},
    {"ingest", "record", "record_sharded", "recording", "extrapolate"},
    {"fit"},
    {"store", "verifiers", "tasks"},
    {"io", "models", "synthetic"},
    {"errors", "registry", "version", "ranks", "settings", "util"},
]
PACKAGE = Path(__file__).resolve().parent.parent / "relex"


def unit(module: str) -> str:
    """The top-level part of relex a module belongs to (relex.fit.gram -> fit)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "version"  # `from relex import __version__`


def rank(name: str) -> int:
    for i, layer in enumerate(LAYERS):
        if name in layer:
            return i
    raise AssertionError(f"relex.{name} is in no layer of tests/test_layers.py; add it where it belongs")


def imports() -> list[tuple[str, str, str]]:
    """(importing file, importing unit, imported unit) for every relex import of the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "__init__.py":  # the package's public face: lazy re-exports of DeltaRecorder, TrajectoryStore
            continue
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        here = unit(module)
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                if name == "relex" or name.startswith("relex."):
                    found.append((str(path.relative_to(PACKAGE.parent)), here, unit(name)))
    return found


def test_every_import_goes_down_the_layers():
    upward = [f"{path}: {here} imports {there}" for path, here, there in imports() if rank(there) < rank(here)]
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_every_part_of_relex_has_a_layer():
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if not p.name.startswith("_") or p.name == "__main__.py"}
    for name in parts - {"py", "__pycache__"}:
        rank(name)


# relex modules imported inside a function, each for a reason; every other relex import sits at the top of its module,
# so a module's first lines show what it depends on
LAZY = {
    ("relex/fit/native.py", "relex.fit"): "relex.fit.gram_kernel imports numba, which only compiling the kernels "
                                          "needs; a process that loads them compiled never imports it",
}


def test_relex_modules_are_imported_at_the_top():
    inside = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "__init__.py":  # the package's public face: lazy re-exports
            continue
        where = str(path.relative_to(PACKAGE.parent))
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                names = [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
                names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
                inside += [(where, n) for n in names if (n == "relex" or n.startswith("relex.")) and (where, n) not in LAZY]
    assert not inside, "relex imports inside functions (move them to the top, or add to LAZY with a reason):\n" + "\n".join(
        f"{where}: {name}" for where, name in inside
    )
