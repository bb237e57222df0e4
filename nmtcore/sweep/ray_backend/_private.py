"""Every use of Ray's private API in the platform, in one place, so that a Ray upgrade knows what to check
(tests/test_architecture.py keeps ``_private``/``_internal``/``_local_tuner`` out of the other modules).

Each use says why no public API serves; each degrades to a warning or a no-op where this Ray version moved it:

- :func:`remove_leaked_placement_groups`: the GCS's record of a placement group's creating actor;
- :func:`dashboard_url`: where the dashboard of the cluster this process started listens;
- :func:`loopback_only`: Ray's switch for a single-node cluster bound to 127.0.0.1;
- :func:`poll_less`: how often a Tune actor polls its Train session for results;
- :class:`TrialTrainer`: the helper actors a ``TorchTrainer`` starts by default;
- :func:`set_concurrency`, :func:`replace_callbacks`: a restored Tuner's limits and callbacks.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import ray
import ray.train
from ray import tune
from ray.train.torch import TorchTrainer
from ray.tune.search import BasicVariantGenerator



log = logging.getLogger("nmtcore.sweep")


def remove_leaked_placement_groups() -> int:
    """Remove placement groups whose creating actor is dead (and that are not detached); returns how
    many. Such a group is a Train worker group's reservation outliving its controller (a trial
    stopped by ASHA or killed): its resources would otherwise stay reserved until the cluster ends.
    Groups created by a driver (Tune's own trial reservations) have no creating actor and are kept."""
    try:
        from ray.core.generated import gcs_pb2
        from ray.util.placement_group import (
            PlacementGroup,
            PlacementGroupID,
            remove_placement_group,
        )

        table = ray.util.placement_group_table()
        accessor = ray._private.state.state._global_state_accessor  # noqa: SLF001 - no public API has the creator
    except Exception as e:  # pragma: no cover - depends on Ray internals
        log.debug("placement-group check unavailable: %s", e)
        return 0
    removed = 0
    for pg_hex, info in table.items():
        if info.get("state") not in ("CREATED", "PENDING", "RESCHEDULING"):
            continue
        try:
            pg_id = PlacementGroupID(bytes.fromhex(pg_hex))
            data = gcs_pb2.PlacementGroupTableData.FromString(accessor.get_placement_group_info(pg_id))
            creator = bytes(data.creator_actor_id)
            if data.is_detached or not creator or set(creator) == {0xFF} or not data.creator_actor_dead:
                continue
            remove_placement_group(PlacementGroup(pg_id))
            removed += 1
            log.warning("removed leaked placement group %s %s (its creating actor died)", pg_hex, info.get("bundles"))
        except Exception as e:  # pragma: no cover - racing with Ray's own cleanup
            log.debug("placement group %s: %s", pg_hex, e)
    return removed


LOOPBACK_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's node IP is 127.0.0.1, every port on it


@contextlib.contextmanager
def loopback_only() -> Any:
    """While a local cluster starts: Ray's node IP is 127.0.0.1, so the GCS, the raylet, every worker and the
    dashboard's agents listen there only (``dashboard_host`` covers the dashboard's HTTP port alone, and
    ``_node_ip_address="127.0.0.1"`` is swapped for the routable address by Ray itself).

    The one switch Ray has is ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (it also makes the cluster
    single-node, which a local cluster is). Ray reads it once, at ``import ray``, and this module is
    imported before anyone knows whether the sweep will join a cluster (``--address``: there the driver
    must be reachable from the other nodes). So the choice is made here, when a *local* cluster starts:
    the variable is set for the processes ``ray.init`` spawns (they read it at their own import) and Ray's
    constant for this process, both restored afterwards. A joined cluster is untouched, and so is a user's
    explicit ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1`` (a local head other nodes may join).
    """
    from ray._private import ray_constants

    if os.environ.get(LOOPBACK_VAR) == "1":
        yield
        return
    saved_env, saved_const = os.environ.get(LOOPBACK_VAR), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOOPBACK_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_const
        if saved_env is None:
            os.environ.pop(LOOPBACK_VAR, None)
        else:
            os.environ[LOOPBACK_VAR] = saved_env


# How often a Tune trial asks its result queue actor whether the Train run reported, in seconds. Ray's default
# is 0.2 s: five remote calls a second for the trial's whole life. A call returns as soon as a result is there,
# so a longer wait delays no report (the end of a trial is noticed up to this much later).
RESULT_POLL_S = 1.0


def poll_less() -> None:
    """Make this process's Tune result wait :data:`RESULT_POLL_S` (best effort: a private setting of this Ray
    version, checked by ``tests/test_sweep_polling.py``)."""
    try:
        from ray.train._internal import session as train_session
    except ImportError:  # pragma: no cover - another Ray version
        return
    if isinstance(getattr(train_session, "_RESULT_FETCH_TIMEOUT", None), (int, float)):
        train_session._RESULT_FETCH_TIMEOUT = RESULT_POLL_S  # noqa: SLF001


class TrialTrainer(TorchTrainer):
    """Ray Train's ``TorchTrainer`` without two helper actors a sweep trial pays for and does not use.

    Each is one more Ray process per trial, and on this project's 2-core machines one cost 7.7-10.6 CPU seconds over
    one 2-thread trial, taken from the trial's own threads (per-process CPU, docs/performance.md "What a sweep
    costs a trial"):

    * the dataset manager (``DatasetsCallback``): created for every run even with no Ray dataset; trials read
      their data themselves, so a trainer given ``datasets`` keeps it;
    * the placement-group cleaner (``PlacementGroupCleanerCallback``): a detached actor asking the GCS every
      second whether the controller lives, to free its worker reservation if it died. The sweep already does
      that for every trial, from the driver: ``remove_leaked_placement_groups`` before each trial starts,
      after each ends and every ``pg_check_s`` (:class:`_SweepCallback`).
    """

    def _create_default_callbacks(self) -> list[Any]:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
        from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

        unused = (PlacementGroupCleanerCallback,) if self.datasets else (PlacementGroupCleanerCallback,
                                                                          DatasetsCallback)
        return [c for c in super()._create_default_callbacks() if not isinstance(c, unused)]


def set_concurrency(tuner: tune.Tuner, n: int) -> None:
    """Give a restored Tuner this run's number of trials at once (``Tuner.restore`` keeps the old one)."""
    tune_config = getattr(getattr(tuner, "_local_tuner", None), "_tune_config", None)
    if tune_config is None:  # pragma: no cover - Ray internals moved
        log.warning("could not set the restored Tuner's concurrency to %d", n)
        return
    if isinstance(tune_config.search_alg, BasicVariantGenerator):
        tune_config.search_alg.max_concurrent = n
    else:
        tune_config.max_concurrent_trials = n


def replace_callbacks(tuner: tune.Tuner, ours: list[tune.Callback]) -> None:
    """Install this process's sweep callbacks on a restored Tuner in place of the restored copies."""
    internal = getattr(tuner, "_local_tuner", None)
    run_config = getattr(internal, "_run_config", None) if internal is not None else None
    if run_config is None:  # pragma: no cover - Ray internals moved
        log.warning("could not re-install the sweep callbacks on the restored Tuner")
        return
    kinds = tuple(type(c) for c in ours)  # the restored copies of the same callbacks give way to the live ones
    others = [c for c in (run_config.callbacks or []) if not isinstance(c, kinds)]
    run_config.callbacks = [*others, *ours]


def dashboard_url() -> str | None:
    """The dashboard address of the cluster this process started (``ray.init``'s context omits it when it
    starts none), or None."""
    try:
        return ray._private.worker.get_dashboard_url() or None  # noqa: SLF001 - the context has no field for it
    except Exception:  # pragma: no cover - Ray internals moved
        return None
