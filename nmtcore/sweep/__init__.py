"""Sweeps: a search space (:mod:`~nmtcore.sweep.space`) and a base experiment become a plan of trials
(:mod:`~nmtcore.sweep.plan`, pure Python) run on Ray (:mod:`~nmtcore.sweep.ray_backend`, the only module importing
Ray: the cluster, the pre-sweep tasks of :mod:`~nmtcore.sweep.pre_sweep`, Tune and Ray Train) by the driver
(:mod:`~nmtcore.sweep.driver`), recorded in MLflow (:mod:`~nmtcore.sweep.lifecycle`) and reported from MLflow
alone (:mod:`~nmtcore.sweep.report`). This face imports no Ray: ``from nmtcore.sweep.driver import run_sweep``
to run one."""

from nmtcore.sweep.settings import SweepError, SweepSettings
from nmtcore.sweep.space import SearchSpace, SpaceError

__all__ = ["SearchSpace", "SpaceError", "SweepError", "SweepSettings"]
