"""`relex fit`: one streaming pass over a store builds each tensor's Gram matrix, then tiny T × T algebra fits it.

The result (a FIT folder) is small: per tensor the observed steps, eigenvalues, left vectors, temporal parameters
and the Gram itself, so extrapolating to new targets, backtesting and plotting need no second look at the deltas.

    FIT/fit.json            configuration, steps and per-tensor fit
    FIT/gram.safetensors    the Gram matrix of every tensor (float64)
    FIT/diagnostics.csv     explained variance and temporal R² per tensor
"""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from relex import __version__
from relex.errors import RelexError
from relex.fit.gram import resolve_device
from relex.fit.passes import DEFAULT_CHUNK_ELEMENTS, tensor_grams
from relex.fit.temporal import TEMPORAL_MODELS, TemporalModel, make_temporal
from relex.fit.trajectory_fit import TensorFit, fit_tensor
from relex.io.atomic import atomic_output
from relex.settings import setting
from relex.store import IO_MODES, TrajectoryStore
from relex.util import grouped, module_type

LOG = logging.getLogger(__name__)

RECIPE = ("rank", "temporal", "degree", "window", "observe_until")  # what a saved fit is; the rest is how it ran


@dataclass
class FitConfig:
    """The recipe of a fit (RECIPE: saved with it) and how a command runs it (never saved)."""

    rank: int = setting(1, "directions per tensor")
    temporal: str = setting("linear", "temporal model of the coefficients: linear, poly or robust")
    degree: int | None = setting(None, "degree of the poly temporal model (default 2)")
    window: int | None = setting(None, "the temporal model sees the last N observed steps (default: all)")
    observe_until: int | None = setting(None, "use only recorded steps ≤ this (default: all)")
    device: str = setting("auto", "auto (CUDA when present), cpu, cuda, cuda:N")
    chunk_elements: int = setting(DEFAULT_CHUNK_ELEMENTS, "values per block read from the store")
    io: str = setting(
        "auto", "reading the store and writing checkpoints: direct bypasses the page cache (O_DIRECT), cached goes "
        "through it; auto reads direct when the store is larger than the memory available and writes direct",
    )

    def __post_init__(self) -> None:
        if self.io not in IO_MODES:  # the rest is checked against the store's steps (validate)
            raise RelexError(f"fit.io {self.io!r}: unknown I/O mode; valid: {', '.join(IO_MODES)}")

    def temporal_model(self) -> TemporalModel:
        return make_temporal(self.temporal, self.degree)


def observed_steps(store: TrajectoryStore, observe_until: int | None) -> list[int]:
    steps = store.steps if observe_until is None else [s for s in store.steps if s <= observe_until]
    if not steps:
        raise RelexError(f"{store.path}: no recorded step ≤ {observe_until}; recorded: {store.steps[:5]}…")
    return steps


def window_indices(count: int, window: int | None) -> np.ndarray:
    if window is None:
        return np.arange(count)
    if window < 1:
        raise RelexError(f"--window must be a positive number of steps, got {window}")
    return np.arange(max(0, count - window), count)


def validate(config: FitConfig, steps: list[int]) -> np.ndarray:
    """Check the configuration against the observed steps before any data is read; returns the window."""
    TEMPORAL_MODELS.get(config.temporal)
    if config.rank < 1:
        raise RelexError(f"--rank must be at least 1, got {config.rank}")
    if config.rank > len(steps):
        raise RelexError(f"rank {config.rank} needs at least {config.rank} observed steps; there are {len(steps)}: {steps}")
    window = window_indices(len(steps), config.window)
    config.temporal_model().check_points(np.asarray(steps)[window])
    return window


@dataclass
class FitResult:
    config: FitConfig
    steps: np.ndarray
    tensors: dict[str, TensorFit]
    grams: dict[str, np.ndarray]
    numel: dict[str, int]
    store_path: str = ""

    @property
    def model(self) -> TemporalModel:
        return self.config.temporal_model()

    def rows(self) -> list[dict]:
        """One diagnostics row per tensor."""
        out = []
        for name, fit in self.tensors.items():
            out.append(
                {
                    "tensor": name,
                    "module_type": module_type(name),
                    "numel": self.numel[name],
                    "rank": fit.rank,
                    "explained_variance": fit.explained_variance(self.config.rank),
                    "explained_variance_rank1": fit.explained_variance(1),
                    "r2_direction1": fit.r2[0] if fit.r2 else float("nan"),
                    "sigma1": float(fit.sigma[0]) if fit.rank else 0.0,
                }
            )
        return out

    def summary_by_module_type(self) -> list[dict]:
        groups = grouped((row["module_type"], row) for row in self.rows())
        return [_summarise(name, rows) for name, rows in groups.items()] + [_summarise("all", self.rows())]

    def summary(self) -> dict:
        overall = _summarise("all", self.rows())
        return {k: overall[k] for k in ("tensors", "median_explained_variance", "share_ev_ge_0.9", "median_r2")}

    # ---- persistence ---------------------------------------------------------------------------------------------
    def save(self, out_dir: str | Path, overwrite: bool = False, inputs=()) -> Path:
        """Write the fit folder atomically (relex.io.atomic); `overwrite` never replaces one of `inputs`."""
        out_dir = Path(out_dir)
        with atomic_output(out_dir, overwrite=overwrite, inputs=inputs) as tmp:
            self.write_into(tmp)
        return out_dir

    def write_into(self, folder: Path) -> None:
        """The fit's files in `folder` (created; the caller makes it atomic): fit.json, gram.safetensors, CSVs."""
        folder.mkdir(parents=True, exist_ok=True)
        payload = {
            "relex_version": __version__,
            "store": self.store_path,
            "config": {key: asdict(self.config)[key] for key in RECIPE},  # how it ran is not saved
            "steps": self.steps.tolist(),
            "tensors": {
                name: {
                    "numel": self.numel[name],
                    "window": fit.window.tolist(),
                    "eigenvalues": fit.eigenvalues.tolist(),
                    "u": fit.u.tolist(),
                    "temporal": fit.temporal,
                    "r2": fit.r2,
                }
                for name, fit in self.tensors.items()
            },
        }
        (folder / "fit.json").write_text(json.dumps(payload) + "\n")
        save_file({f"gram/{n}": torch.from_numpy(g) for n, g in self.grams.items()}, str(folder / "gram.safetensors"))
        _write_csv(folder / "diagnostics.csv", self.rows())
        _write_csv(folder / "summary_by_module_type.csv", self.summary_by_module_type())

    @classmethod
    def load(cls, path: str | Path) -> "FitResult":
        path = Path(path)
        if not (path / "fit.json").is_file():
            raise RelexError(f"{path}: not a relex fit (no fit.json); make one with `relex fit STORE --out {path}`")
        payload = json.loads((path / "fit.json").read_text())
        grams = {k.removeprefix("gram/"): v.numpy() for k, v in load_file(str(path / "gram.safetensors")).items()}
        steps = np.asarray(payload["steps"], dtype=np.int64)
        tensors = {}
        for name, t in payload["tensors"].items():
            u = np.asarray(t["u"], dtype=np.float64).reshape(len(steps), -1)
            tensors[name] = TensorFit(name, steps, np.asarray(t["window"]), np.asarray(t["eigenvalues"]), u, t["temporal"], t["r2"])
        numel = {name: t["numel"] for name, t in payload["tensors"].items()}
        recipe = {key: value for key, value in payload["config"].items() if key in RECIPE}  # older fits saved device, io
        result = cls(FitConfig(**recipe), steps, tensors, grams, numel, payload.get("store", ""))
        result.folder = path  # where it was read from: an input that an --overwrite must not replace
        return result


def _summarise(name: str, rows: list[dict]) -> dict:
    ev = [r["explained_variance"] for r in rows if r["rank"]]
    r2 = [r["r2_direction1"] for r in rows if r["rank"] and np.isfinite(r["r2_direction1"])]
    return {
        "module_type": name,
        "tensors": len(rows),
        "median_explained_variance": median(ev) if ev else float("nan"),
        "share_ev_ge_0.9": float(np.mean([e >= 0.9 for e in ev])) if ev else float("nan"),
        "median_r2": median(r2) if r2 else float("nan"),
        "zero_trajectories": sum(1 for r in rows if not r["rank"]),
    }


def _write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else ["tensor"])
        writer.writeheader()
        writer.writerows(rows)


def fit_from_grams(config: FitConfig, steps: list[int], grams: dict[str, np.ndarray], numel: dict[str, int], store_path: str = "") -> FitResult:
    window = validate(config, steps)
    model = config.temporal_model()
    step_array = np.asarray(steps, dtype=np.int64)
    tensors = {name: fit_tensor(name, step_array, g, config.rank, model, window) for name, g in grams.items()}
    return FitResult(config, step_array, tensors, grams, numel, store_path)


def refit(store: TrajectoryStore, config: FitConfig, previous_dir: str | Path) -> FitResult:
    """A new fit (other rank, temporal model or window) from the Gram matrices an earlier fit saved."""
    previous = FitResult.load(previous_dir)
    steps = observed_steps(store, config.observe_until)
    if previous.steps.tolist() != steps:
        raise RelexError(f"{previous_dir}: fitted on steps {previous.steps.tolist()}, not the observed steps {steps}")
    return fit_from_grams(config, steps, previous.grams, previous.numel, str(store.path))


def fit_store(store: TrajectoryStore, config: FitConfig) -> FitResult:
    """One pass over the store's observed steps: the Gram of every trajectory tensor, then the fit.

    Args:
        store: an open trajectory store (`TrajectoryStore.open(path)`).
        config: the recipe (rank, temporal model, window, `observe_until`) and how to run it (device, I/O mode,
            chunk size); only the recipe is saved with the result.

    Returns:
        A `FitResult`: per tensor its rank-r directions and fitted temporal line, with the Gram matrices;
        `.rows()` and `.summary()` give the diagnostics, `.save(folder)` writes what `relex fit` writes.

    Example:
        from relex.fit import FitConfig, fit_store
        fit = fit_store(TrajectoryStore.open("runs/demo/trajectory"), FitConfig(rank=1, observe_until=6))
        fit.summary()["median_explained_variance"]
        fit.save("runs/demo/fit")
    """
    steps = observed_steps(store, config.observe_until)
    validate(config, steps)
    device = resolve_device(config.device)
    reader = store.reader(steps, direct=store.reads_direct(config.io))
    infos = store.tensors
    names = store.trajectory_names
    grams = dict(tensor_grams(reader, names, device, config.chunk_elements, desc="fit: Gram matrices"))
    LOG.info("fitted %d tensors over %d steps on %s, reading %s", len(grams), len(steps), device, "direct" if reader.direct else "through the page cache")
    numel = {name: infos[name].numel for name in grams}
    return fit_from_grams(config, steps, grams, numel, str(store.path))


