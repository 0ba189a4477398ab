"""relex: record, fit and extrapolate the weight trajectories of RLVR runs.

    from relex import DeltaRecorder   # a transformers.TrainerCallback that records θ_step − θ₀

The pipeline follows the data: record (relex.record) → store (relex.store) → fit (relex.fit) →
extrapolate (relex.extrapolate) → evaluate (relex.evaluate) → plot (relex.plot).
"""

__version__ = "0.1.0"

__all__ = ["DeltaRecorder", "TrajectoryStore", "__version__"]


def __getattr__(name):  # lazy, so that `import relex` stays cheap
    if name == "DeltaRecorder":
        from relex.record import DeltaRecorder

        return DeltaRecorder
    if name == "TrajectoryStore":
        from relex.store import TrajectoryStore

        return TrajectoryStore
    raise AttributeError(name)
