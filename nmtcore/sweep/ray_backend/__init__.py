"""Everything of a sweep that talks to Ray, and the only package that imports it: the cluster (:mod:`.cluster`), the
pre-sweep tasks (:mod:`.tasks`), the search (:mod:`.search`), the trial's Ray side (:mod:`.trial`), the driver's
callbacks (:mod:`.callbacks`), the Tune run (:mod:`.tuner`), and every use of Ray's private API (:mod:`._private`). The rest of :mod:`nmtcore.sweep` runs and tests
without a Ray cluster.

**The cluster.** :func:`init_ray` starts a local one (or joins ``address``); :func:`trials_that_fit` says how
many trials it runs at once (CPUs, GPUs and each trial's memory estimate); placement groups that Ray Train
leaks are removed. Who can reach a local cluster: every Ray process of it listens on 127.0.0.1 only (GCS,
raylet, workers, dashboard and its agents; see :func:`_loopback_only`), and the dashboard keeps Ray's token
authentication (:mod:`nmtcore.sweep.dashboard` says how to sign in): loopback alone does not keep out other
users of the same machine. A joined cluster keeps its own binding and auth, after :func:`check_cluster` has
seen that every node reaches the storage, the data and MLflow.

**The pre-sweep tasks.** :func:`run_pre_sweep_task` runs the work the trials share
(:mod:`nmtcore.sweep.pre_sweep`) once, as a named Ray task on the driver's node, and streams its progress.

**The search.** A sweep's trials run as one Ray Tune search whose trials each run the unchanged nmtcore
trainer inside a Ray Train ``TorchTrainer`` (:class:`TrialTrainer`: without the helper actors it does not use),
or, for a one-worker CPU trial (``trial_in_actor``, the default), in the Tune trial actor itself: the same
``_train_loop``, reporting to Tune directly, without a Train controller and worker process of its own::

    driver (nmtcore.sweep.driver)     Tune trial actor (_trial_main)      Train workers (_train_loop)
    ─────────────────────────────     ──────────────────────────────      ───────────────────────────
    run_tune(...)                      find / create the MLflow child      run_experiment(cfg, callbacks)
      Tuner(search alg, ASHA).fit()      (by trial key: re-attach)           _RayReport: metrics +
      _SweepCallback: end child runs   TrialTrainer(name = trial key)          checkpoint every epoch
        of stopped/failed trials,        .fit()                              _TrialTracking (rank 0):
        remove leaked worker PGs                                               config, epochs, test,
                                                                               costs → the child run

Search algorithm: a space of grid/choice dimensions is enumerated (Tune's variant generator; seeds are one
more grid dimension); a space with ranges is sampled by Optuna's TPE, seeded, with seeds as Tune
``Repeater`` repeats. ASHA (on the validation metric, time in epochs) stops poor trials early.

Where things run: the cluster above (by default a local one of all cores, bound to 127.0.0.1), trials as
many at once as fit (``cpus_per_trial``/``gpus_per_trial`` per trial: reserved by the Train workers, or by the
Tune actor of a trial that trains in it).
The work the trials share runs before them as named Ray tasks (:mod:`nmtcore.sweep.pre_sweep`).

Failure policy: a crashing trial is retried by Tune (``max_failures``) from its last checkpoint; a trial
whose loss becomes NaN/inf ends FAILED with the reason in MLflow, and Tune's retries of it end at once
without training (it would fail identically); a trial whose worker group cannot start fails after
``controller_failure_limit`` start timeouts instead of waiting forever; placement groups whose creating
Train controller died (the leak that hangs ASHA sweeps with TorchTrainer trials) are removed.
"""

from nmtcore.sweep.ray_backend._private import RESULT_POLL_S, TrialTrainer, remove_leaked_placement_groups
from nmtcore.sweep.ray_backend.cluster import (
    CONTROL_PLANE_NICE,
    DRIVER_RESOURCES,
    LOCAL_RAY_ENV,
    RAY_ENV,
    check_cluster,
    cluster_nodes,
    driver_node_gpus,
    how_many,
    init_ray,
    ray_is_running,
    restore_worker_nice,
    shutdown_ray,
    single_node_idle_cpus,
    trials_that_fit,
    workers_have,
    yield_control_plane,
)
from nmtcore.sweep.ray_backend.search import (
    num_samples,
    param_space,
    preview_samples,
    reuse_trial_actors,
    scheduler,
    search_algorithm,
)
from nmtcore.sweep.ray_backend.tasks import free_cpus, run_pre_sweep_task
from nmtcore.sweep.ray_backend.trial import (
    ACTOR_MEMORY_STEP,
    TRIAL_PROCESS_TAG,
    actor_memory,
    first_keys,
    trial_actor_resources,
)
from nmtcore.sweep.ray_backend.tuner import TuneOutcome, run_tune
from nmtcore.sweep.trial import SweepContext

__all__ = ["ACTOR_MEMORY_STEP", "CONTROL_PLANE_NICE", "DRIVER_RESOURCES", "LOCAL_RAY_ENV", "RAY_ENV", "RESULT_POLL_S",
           "SweepContext", "TRIAL_PROCESS_TAG", "TrialTrainer", "TuneOutcome", "actor_memory", "check_cluster",
           "cluster_nodes", "driver_node_gpus", "first_keys", "free_cpus", "how_many", "init_ray", "num_samples",
           "param_space", "preview_samples", "ray_is_running", "remove_leaked_placement_groups",
           "restore_worker_nice", "reuse_trial_actors", "run_pre_sweep_task", "run_tune", "scheduler",
           "search_algorithm", "shutdown_ray", "single_node_idle_cpus", "trial_actor_resources", "trials_that_fit",
           "workers_have", "yield_control_plane"]
