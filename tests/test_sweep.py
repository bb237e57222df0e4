"""The sweep adapter against a real local Ray cluster (one per module, 2 CPUs) and a temporary MLflow
store: search-algorithm construction, sampled values reaching the trainer, cluster-mode checks, a
2-trial smoke sweep (1 parent + 2 child runs), and (slow) a NaN trial marked FAILED while the other
completes."""

from __future__ import annotations

import dataclasses

import re
import time

import pytest
import torch

import search_spaces
from nmtcore import tracking
from nmtcore.allocator import find_library
from nmtcore.engine import Callback
from nmtcore.sweep import driver, lifecycle, plan, progress, ray_backend, timing
from nmtcore.sweep.ray_backend import callbacks as rb_callbacks, cluster as rb_cluster, tasks as rb_tasks
from nmtcore.sweep import settings as sweep_settings
from nmtcore.testing.sweeps import runs_of, tiny_base, tiny_settings
from nmtcore.tracking import schema
from search_spaces import SearchSpace, grid, loguniform, uniform


# ------------------------------------------------------------------------------- adapter construction
def test_grid_spaces_use_the_grid_and_fifo_and_seeds_are_a_dimension():
    from ray.tune.schedulers import FIFOScheduler
    from ray.tune.search import BasicVariantGenerator

    space = search_spaces.get_space("transformer_grid:demo")
    s = sweep_settings.SweepSettings(name="x", storage="/tmp", seeds=3)
    grid_alg = ray_backend.search_algorithm(space, s, max_concurrent=2)
    assert isinstance(grid_alg, BasicVariantGenerator) and grid_alg.max_concurrent == 2
    assert isinstance(ray_backend.scheduler(space, s, max_epochs=10), FIFOScheduler)
    pspace = ray_backend.param_space(space, seeds=3, base_seed=7)
    assert pspace["train.seed"] == {"grid_search": [7, 8, 9]}
    assert pspace["cell"] == {"grid_search": [0, 1, 2, 3]}  # the grid's 2 x 2 points, enumerated as cells
    assert [c.point for c in space.cells()] == space.grid_points()
    assert ray_backend.num_samples(space, s) == 1
    assert len(ray_backend.preview_samples(space, 100, seeds=3, base_seed=7)) == 12  # 2 x 2 x 3 seeds
    # A study with a control: the control is one more cell, first, and it is never stopped early.
    protocol_space = search_spaces.get_space("drop_net:grid")
    assert ray_backend.param_space(protocol_space, 1, 1) == {"cell": {"grid_search": [0, 1, 2, 3, 4, 5]}}
    asha = sweep_settings.SweepSettings(name="x", storage="/tmp", early_stopping=True)
    assert isinstance(ray_backend.scheduler(protocol_space, asha, max_epochs=10), FIFOScheduler)


def test_sampled_spaces_use_seeded_optuna_tpe_with_asha_and_repeats_for_seeds():
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search import Repeater
    from ray.tune.search.optuna import OptunaSearch

    space = search_spaces.get_space("transformer_grid:optuna")
    one = ray_backend.search_algorithm(space, sweep_settings.SweepSettings(name="x", storage="/tmp", optuna_seed=3))
    assert isinstance(one, OptunaSearch) and one._sampler.__class__.__name__ == "TPESampler"
    rep = ray_backend.search_algorithm(space, sweep_settings.SweepSettings(name="x", storage="/tmp", seeds=2))
    assert isinstance(rep, Repeater) and rep.repeat == 2
    asha = ray_backend.scheduler(space, sweep_settings.SweepSettings(name="x", storage="/tmp", grace_period=2), max_epochs=8)
    assert isinstance(asha, ASHAScheduler) and asha._time_attr == "epoch" and asha._max_t == 8
    assert not asha._stop_last_trials  # a trial that reached the last epoch still decodes its test set
    off = ray_backend.scheduler(space, sweep_settings.SweepSettings(name="x", storage="/tmp", early_stopping=False), max_epochs=8)
    assert not isinstance(off, ASHAScheduler)
    # A trial actor runs the next trial only where no trial is stopped early (its Train run would go on).
    assert not ray_backend.reuse_trial_actors(asha) and ray_backend.reuse_trial_actors(off)
    assert ray_backend.num_samples(space, sweep_settings.SweepSettings(name="x", storage="/tmp", seeds=2)) == 16
    # Seeded: the same suggestions twice; different from another seed.
    a = ray_backend.preview_samples(space, 3, optuna_seed=0)
    assert a == ray_backend.preview_samples(space, 3, optuna_seed=0)
    assert a != ray_backend.preview_samples(space, 3, optuna_seed=1)


def test_asha_never_stops_a_trial_at_its_last_epoch():
    """4 epochs, grace 1, factor 2: Tune's brackets have rungs at epochs 1, 2 and 4. The worse of two trials
    is stopped at a rung before the last epoch, never at the last (it still decodes its test set)."""
    from types import SimpleNamespace

    from ray.tune.schedulers import TrialScheduler

    space = search_spaces.get_space("transformer_grid:optuna")
    asha = ray_backend.scheduler(space, sweep_settings.SweepSettings(name="x", storage="/tmp", grace_period=1,
                                                                     reduction_factor=2), max_epochs=4)
    asha.set_search_properties(space.metric, space.mode)  # as Tune does from the TuneConfig
    good, bad = SimpleNamespace(trial_id="a"), SimpleNamespace(trial_id="b")
    for t in (good, bad):
        asha.on_trial_add(None, t)
    assert sorted(m for m, _ in asha._brackets[0]._rungs) == [1, 2, 4]

    def report(trial, epoch, bleu):  # the space's metric: validation BLEU, higher is better
        return asha.on_trial_result(None, trial, {"epoch": epoch, space.metric: bleu})

    for epoch in (1, 2, 3):
        assert report(good, epoch, 10.0 * epoch) == TrialScheduler.CONTINUE
    assert report(good, 4, 40.0) == TrialScheduler.CONTINUE
    assert report(bad, 1, 11.0) == TrialScheduler.CONTINUE  # better than the good one was at epoch 1
    assert report(bad, 2, 21.0) == TrialScheduler.CONTINUE
    assert report(bad, 3, 25.0) == TrialScheduler.CONTINUE
    assert report(bad, 4, 30.0) == TrialScheduler.CONTINUE  # worse than 40 at the rung of epoch 4: kept anyway
    # It still stops a trial at a rung before the last epoch.
    worse = SimpleNamespace(trial_id="c")
    asha.on_trial_add(None, worse)
    assert report(worse, 1, 1.0) == TrialScheduler.STOP


def test_samples_reach_the_trainer_config(tmp_path):
    """Two samples drawn by the sweep's own search algorithm give two trainer configs that carry them."""
    base = tiny_base(tmp_path)
    for space in (SearchSpace("t", "grid", "transformer", params={"model.d_model": grid((32, 64))}),
                  SearchSpace("t", "tpe", "transformer", params={"train.lr": loguniform(1e-4, 1e-2),
                                                                 "model.dropout": uniform(0.0, 0.3)})):
        samples = ray_backend.preview_samples(space, 2, seeds=2 if space.sampled else 1)
        cfgs = [plan.trial_config(base, plan.trial_overrides(space, s, base.train.seed), tmp_path / str(i))
                for i, s in enumerate(samples)]
        flat = [c.flat() for c in cfgs]
        for sample, f in zip(samples, flat):
            point, control = plan.trial_point(space, sample)
            assert not control and set(point) == set(space.params)
            for key in space.params:
                assert f[key] == pytest.approx(point[key])
        assert {k: v for k, v in flat[0].items() if k != "output_dir"} != \
               {k: v for k, v in flat[1].items() if k != "output_dir"}


def test_cluster_mode_needs_a_tracking_server_and_shared_storage(ray_cluster, tmp_path):
    base = tiny_base(tmp_path)
    local = sweep_settings.resolve_settings(sweep_settings.SweepSettings(name="x", storage=str(tmp_path), address="10.0.0.1:6379",
                                                       tracking_uri=f"sqlite:///{tmp_path / 'm.db'}"))
    with pytest.raises(sweep_settings.SweepError, match="needs an MLflow tracking server every node can reach"):
        ray_backend.check_cluster(local, base)
    served = sweep_settings.resolve_settings(sweep_settings.SweepSettings(name="x", storage=str(tmp_path / "shared"),
                                                        address="10.0.0.1:6379", tracking_uri="http://127.0.0.1:1"))
    ray_backend.check_cluster(served, base)  # one node here: it sees the storage and data paths
    assert ray_backend.trials_that_fit(served) == 2
    with pytest.raises(sweep_settings.SweepError, match="a trial needs 3 CPUs"):
        ray_backend.trials_that_fit(sweep_settings.SweepSettings(name="x", storage="/tmp", cpus_per_trial=3))


# ------------------------------------------------------------------------------- the console
def test_trials_console_says_each_step_and_where_every_trial_stands_when_silent(monkeypatch):
    from types import SimpleNamespace as T

    clock = [1000.0]
    monkeypatch.setattr(rb_callbacks.time, "monotonic", lambda: clock[0])
    lines: list[str] = []
    console = rb_callbacks._TrialsConsole(lambda t: t.name, "valid_bleu", 3, out=lines.append, heartbeat_s=30)
    a = T(trial_id="a", name="control seed 1", status="RUNNING", last_result={})
    b = T(trial_id="b", name="L2-H384 seed 1", status="PENDING", last_result={})
    console.on_trial_start(0, [a, b], a)
    clock[0] += 29
    console.on_step_end(1, [a, b])
    assert len(lines) == 1  # not silent long enough yet
    clock[0] += 1
    console.on_step_end(2, [a, b])
    assert lines[-1] == "trials: 1 running, 1 pending · control seed 1 epoch 0/3, 30 s"
    clock[0] += 570
    a.last_result = {"epoch": 1.0, "valid_bleu": 33.214}
    console.on_trial_result(3, [a, b], a, a.last_result)
    assert lines[-1] == "trial control seed 1: [#######.............]  33% epoch 1/3 valid_bleu 33.21 (10.0 min so far)"
    console.on_step_end(4, [a, b])
    assert len(lines) == 3  # the result line reset the silence
    b.status, b.last_result = "RUNNING", {"epoch": 1.0}
    console.on_trial_start(5, [a, b], b)
    assert lines[-1] == ("trial L2-H384 seed 1: started (resumed: last reported epoch 1; it continues from its "
                         "newest checkpoint)")
    a.status = "TERMINATED"
    console.on_trial_complete(6, [a, b], a)  # no final result: ASHA stopped it
    assert lines[-1] == "trial control seed 1: stopped by the scheduler after epoch 1 in 10.0 min"
    a.last_result = {"epoch": 4.0, "trial_complete": 1.0, "stopped_by": "patience", "best_epoch": 1.0}
    console.on_trial_complete(6, [a, b], a)  # its own rule stopped it (this read "stopped by the scheduler")
    assert lines[-1] == "trial control seed 1: done after epoch 4: stopped by patience, best epoch 1 in 10.0 min"
    a.last_result = {"epoch": 3.0, "trial_complete": 1.0, "stopped_by": "cap", "best_epoch": 3.0}
    console.on_trial_complete(6, [a, b], a)
    assert lines[-1] == "trial control seed 1: done after epoch 3: stopped by cap, best epoch 3 in 10.0 min"
    console.on_trial_error(7, [a, b], b)
    assert lines[-1].startswith("trial L2-H384 seed 1: FAILED after epoch 1 (0 s)")
    b.status = "ERROR"
    assert console.standing([a, b]) == "trials: 1 done, 1 failed"


def test_phase_progress_bar_eta_and_heartbeat(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    lines: list[str] = []
    phase = progress.PhaseProgress("train baseline x", out=lines.append)
    phase.line("loading data")
    assert lines[-1] == "train baseline x: loading data"
    phase.line("epoch 1/10 valid_loss 5.1")
    assert lines[-1] == "train baseline x: [##..................]  10% epoch 1/10 valid_loss 5.1"
    clock[0] = 300.0
    phase.line("epoch 3/10 valid_loss 4.6")  # 2 epochs in 300 s: 7 to go, 1050 s
    assert lines[-1].endswith("epoch 3/10 valid_loss 4.6 (about 17.5 min to go)")
    clock[0] = 340.0
    phase.heartbeat()
    assert lines[-1] == "train baseline x: still running, 5.7 min elapsed; last: epoch 3/10 (about 16.8 min to go)"
    phase.finished()
    assert lines[-1] == "train baseline x: done in 5.7 min"


# ------------------------------------------------------------------------------- the work before the trials
def test_each_document_context_gets_its_features_prepared_before_the_trials(tmp_path, monkeypatch):
    """Three arms reading one BERT through three streams (real, random and fixed context): the BERT is made once,
    and the features of every stream are built by the shared work, not by the first trial that reads them (as row
    11's random and fixed arms built theirs, unseen by the estimate). The control reads none."""
    from nmtcore.sweep import pre_sweep
    from nmtcore.sweep.memory import BertFootprint
    from nmtcore.sweep.space import Protocol

    made: list[str] = []
    built: list[tuple[str, str]] = []
    monkeypatch.setattr(pre_sweep, "data_checksums", lambda data: {"vocab": "v"})
    monkeypatch.setattr(pre_sweep, "ensure_bert_task", lambda cfg, what, quality=True: made.append(what) or (
        cfg.with_overrides({"model.bert.cache_dir": str(tmp_path / "bert")}), BertFootprint(1, 6, 384, 1536)))
    monkeypatch.setattr(pre_sweep, "bert_features_task", lambda cfg, what, shallower=(): built.append(
        (what, cfg.model.context_type)) or True)
    base = tiny_base(tmp_path, **{"model.bert.name": "minilm"})
    space = SearchSpace("t", "v", "doc_context", arms={t: {"model.context_type": t} for t in ("real", "random", "fixed")},
                        protocol=Protocol(warm_start=False))
    _, footprints = driver.prepare_shared(base, space)
    assert made == ["minilm"] and len(footprints) == 1
    assert sorted(built) == [("minilm, fixed context", "fixed"), ("minilm, random context", "random"),
                             ("minilm, real context", "real")]


@pytest.mark.parametrize("stored", [False, True], ids=["baseline-to-train", "baseline-stored"])
def test_a_baseline_still_to_train_starts_before_the_bert_features_and_a_stored_one_after(tmp_path, monkeypatch,
                                                                                        stored):
    """The order of the tasks before the trials. A baseline to train reads no BERT: it trains once the data is
    prepared, the BERTs made (without their quality figures) and the estimate printed, and the quality figures
    and feature caches follow it (a fresh machine's first update within minutes). With the baseline stored, the
    shared work comes first, then the estimate with what it took, then the baseline's reuse."""
    from search_spaces.protocols import WARM_START

    from nmtcore.sweep import pre_sweep
    from nmtcore.sweep.memory import BertFootprint

    done: list[str] = []
    monkeypatch.setattr(pre_sweep, "prepare_data_task", lambda data: done.append("data") or {"vocab": "v"})
    monkeypatch.setattr(pre_sweep, "data_checksums", lambda data: {"vocab": "v"})
    monkeypatch.setattr(pre_sweep, "baseline_stored", lambda cfg, root=None: stored)
    monkeypatch.setattr(pre_sweep, "ensure_bert_task", lambda cfg, what, quality=True: done.append(
        f"bert {what}{' + quality' if quality else ''}") or (cfg, BertFootprint(1, 6, 384, 1536)))
    monkeypatch.setattr(pre_sweep, "bert_features_task", lambda cfg, what, shallower=(): done.append(
        f"features {what}") or True)
    monkeypatch.setattr(pre_sweep, "ensure_baseline_task", lambda cfg, root=None, env=None, **kw: done.append(
        f"baseline {cfg.model.name}") or "made")
    shared: list[object] = []
    monkeypatch.setattr(driver, "_estimate", lambda space, base, settings, baseline, t0, left=None: shared.append(t0)
                        or done.append("estimate") or "estimated")
    base = tiny_base(tmp_path, **{"model.bert.name": "minilm"})
    space = SearchSpace("t", "v", "bert_fused", arms={"a": {"model.p_net": 1.0}}, protocol=WARM_START)
    settings = dataclasses.replace(tiny_settings(tmp_path, "order", f"sqlite:///{tmp_path / 'm.db'}"), estimate=True)
    _, _, estimated, made = driver.before_trials(space, base, settings, None, True, {}, 0.0)
    assert (estimated, made) == ("estimated", "made")
    if stored:
        assert done == ["data", "bert minilm + quality", "features minilm", "estimate", "baseline transformer"]
        assert shared == [0.0]  # the shared work is done: the estimate counts what it took
    else:
        assert done == ["data", "bert minilm", "estimate", "baseline transformer", "bert minilm + quality",
                        "features minilm"]
        assert shared == [None]  # the features are still to come: the estimate times them
    done.clear()
    driver.before_trials(space, base, settings, None, False, {}, 0.0)  # a resumed sweep: no baseline, no estimate
    assert done == ["data", "bert minilm + quality", "features minilm"]


# ------------------------------------------------------------------------------- sweeps on Ray
def test_smoke_sweep_one_parent_a_child_per_trial_with_metrics(ray_cluster, store, tmp_path, capsys):
    space = SearchSpace("smoke", "tiny", "transformer", params={"model.d_model": grid((32, 64, 48))})
    settings = dataclasses.replace(tiny_settings(tmp_path, "smoke", store), estimate=True)
    t_start = time.perf_counter()
    result = driver.run_sweep(space, tiny_base(tmp_path), settings, log_to_driver=False)
    assert not result.interrupted and [t.status for t in result.trials] == ["TERMINATED"] * 3
    # Under FIFO the third trial ran in the Tune actor (process) of one of the first two, not a new one.
    pids = {t.overrides["model.d_model"]: t.metrics["pid"] for t in result.trials}
    assert pids[32] != pids[64] and pids[48] in (pids[32], pids[64]), pids
    # The console followed each trial, every line stamped: started, each epoch with its bar, finished.
    out = capsys.readouterr().out.splitlines()
    console = [line for line in out if " trial " in line]
    # Before the trials, what they would cost here: 3 trials on the 2 CPUs, 2 at once.
    est = out.index(next(line for line in out if line.startswith("estimated cost on this machine")))
    phases = {line.split(":")[0].strip(): line for line in out[est + 1:est + 4]}
    assert list(phases) == ["shared work", "trials", "total"], out[est:est + 5]  # no protocol: no baseline
    assert "3 trials, 2 at once (2 waves)" in phases["trials"] and "done in" in phases["shared work"]
    for arm in ("d_model=32", "d_model=64"):
        mine = [line for line in console if arm in line]
        steps = ("started", "epoch 1/2", "epoch 2/2", "done after epoch 2: stopped by schedule")
        assert [w for w in steps if any(w in x for x in mine)] == list(steps), console
    assert all(re.match(r"\d\d:\d\d:\d\d trial ", line) for line in console), console
    assert out[-2] == "sweep smoke: time split (wall clock)" and "; trials " in out[-1], out[-3:]

    parents, children = runs_of("smoke", store)
    assert len(parents) == 1 and len(children) == 3
    assert parents[0].status == "FINISHED" and parents[0].tags["nmtcore.varied_keys"] == "model.d_model"
    assert {c.parent_run_id for c in children} == {parents[0].run_id}
    # The sampled value reached the trainer: each child logged (from inside its worker) its own d_model.
    assert sorted(c.params["model.d_model"] for c in children) == ["32", "48", "64"]
    for c in children:
        assert c.status == "FINISHED" and c.tags[lifecycle.TRIAL_STATE_TAG] == "complete"
        for key in ("valid_loss", "valid_bleu", "test/test/bleu", "test/test/chrf", "test/test/bp",
                    "test/test/len_ratio", "cost/parameters",
                    "cost/trainable_parameters", "cost/train_tokens_per_s", "cost/wall_s", "cost/cpu_s"):
            assert key in c.metrics, key
        epochs = tracking.get_run_metrics(c.run_id, store)["valid_loss"]
        assert [step for step, _ in epochs] == [1, 2]
        assert c.tags["nmtcore.node_ids"] and c.tags["varied.model.d_model"] in ("32", "48", "64")
        # One worker, no GPU: it trained in its Tune actor, started on tcmalloc where it is installed (the
        # runtime env the cluster was started with, as a sweep starts one).
        assert c.tags[ray_backend.TRIAL_PROCESS_TAG] == "tune actor"
        assert c.tags["nmtcore.allocator"] == ("tcmalloc" if find_library("tcmalloc") else "system")
        assert "references/test.yy" in tracking.list_artifacts(c.run_id, store)
    # Ray's daemons (started by the fixture's init_ray, as a sweep starts them) ran below the trials.
    import psutil

    daemons = [p for p in psutil.Process().children(recursive=True) if p.name() in ("raylet", "gcs_server")]
    assert len(daemons) == 2 and all(p.nice() == ray_backend.CONTROL_PLANE_NICE for p in daemons), daemons
    # The trials, started by that raylet at its 19, trained at Ray's worker niceness (where the suite may lower one).
    if can_lower_nice():
        assert {c.tags[schema.NICE] for c in children} == {str(rb_cluster.WORKER_NICE)}
    # The first two trials ran at once on the 2 CPUs.
    (a, b, _) = sorted(children, key=lambda r: r.start_time)
    assert b.start_time < a.end_time
    # The report is in MLflow and on disk.
    arts = tracking.list_artifacts(parents[0].run_id, store)
    assert {"report/table.md", "report/bleu_vs_cost.png", "estimate.json", "time_split.json"} <= set(arts)
    assert "estimated (min)" in (tmp_path / "report" / "table.md").read_text()
    # Where the time went, phase by phase, in the order the phases ran; the trials' phase spans the trials.
    (split,) = timing.read(parents[0].run_id, store)
    assert list(split["phases"]) == ["Ray start", "data", "BERTs, quality and features", "cost estimate", "trials",
                                     "report"]
    last_end = max(c.end_time for c in children) - min(c.start_time for c in children)
    assert last_end / 1000 <= split["phases"]["trials"] <= split["wall_s"] <= time.perf_counter() - t_start
    assert "Time split (wall clock, measured" in (tmp_path / "report" / "table.md").read_text()
    assert (tmp_path / "report" / "table.md").read_text().count("| 32 |") == 1
    # Same name again without --resume: refused, nothing started.
    with pytest.raises(sweep_settings.SweepError, match="already exists.*--resume"):
        driver.run_sweep(space, tiny_base(tmp_path), tiny_settings(tmp_path, "smoke", store), log_to_driver=False)


@pytest.mark.slow  # ~60-80 s: the NaN trial is retried once (and fails fast) before it is given up
def test_nan_trial_is_failed_with_reason_and_the_sweep_goes_on(ray_cluster, store, tmp_path):
    class PoisonSmallModel(Callback):
        """Turns the d_model=32 trial's weights into NaN at its first log: its next loss is NaN."""

        def on_log(self, trainer, metrics):
            if trainer.cfg.model.d_model == 32:
                import torch

                with torch.no_grad():
                    for p in trainer.model.parameters():
                        p.fill_(float("nan"))

    space = SearchSpace("nan", "tiny", "transformer", params={"model.d_model": grid((32, 64))})
    result = driver.run_sweep(space, tiny_base(tmp_path), tiny_settings(tmp_path, "nan", store, max_failures=1),
                             trial_callbacks=[PoisonSmallModel()], log_to_driver=False)
    assert not result.interrupted
    status = {t.overrides["model.d_model"]: t.status for t in result.trials}
    assert status == {32: "ERROR", 64: "TERMINATED"}
    _, children = runs_of("nan", store)
    assert len(children) == 2  # the retry re-attached, it did not add a run
    by_d = {c.params["model.d_model"]: c for c in children}
    bad, good = by_d["32"], by_d["64"]
    assert bad.status == "FAILED" and bad.tags[lifecycle.FAILURE_KIND_TAG] == "nonfinite"
    assert "NonFiniteLossError" in bad.tags[tracking.FAILURE_REASON_TAG]
    assert good.status == "FINISHED" and "test/test/bleu" in good.metrics
    table = (tmp_path / "report" / "table.md").read_text()
    assert "1 failed" in table and "NonFiniteLossError" in table


@pytest.mark.slow  # ~60 s: a 2-worker gloo group per trial
def test_ddp_trial_with_two_workers(ray_cluster, store, tmp_path):
    """workers_per_trial=2: the unchanged trainer runs under DDP across two Ray Train workers."""
    space = SearchSpace("ddp", "tiny", "transformer", params={"model.d_model": grid((32,))})
    result = driver.run_sweep(space, tiny_base(tmp_path), tiny_settings(tmp_path, "ddp", store, workers_per_trial=2,
                                                             cpus_per_trial=2.0), log_to_driver=False)
    (trial,) = result.trials
    assert trial.status == "TERMINATED" and len(trial.node_ids) == 2
    (child,) = [r for r in tracking.load_runs("ddp", store) if r.parent_run_id]
    assert child.tags["nmtcore.world_size"] == "2" and child.status == "FINISHED"
    assert child.tags[ray_backend.TRIAL_PROCESS_TAG] == "train workers"
    assert child.params["train.num_threads"] == "1"  # 2 CPUs over 2 workers
    assert "test/test/bleu" in child.metrics


def test_a_pre_sweep_task_waits_for_the_cpus_the_last_one_returns(monkeypatch):
    """Ray reports a finished task's CPUs free a moment later: the next task takes both CPUs, not one; CPUs that
    another sweep really holds are given up on after the settling time."""
    reports = iter([1.0, 1.0, 2.0])
    monkeypatch.setattr(rb_tasks.ray, "available_resources", lambda: {"CPU": next(reports)})
    monkeypatch.setattr(rb_tasks.time, "sleep", lambda s: None)
    assert ray_backend.free_cpus(2.0) == 2.0
    clock = [0.0]

    def tick() -> float:
        clock[0] += 1.0
        return clock[0]

    monkeypatch.setattr(rb_tasks.ray, "available_resources", lambda: {"CPU": 1.0})
    monkeypatch.setattr(rb_tasks.time, "monotonic", tick)
    assert ray_backend.free_cpus(2.0, settle_s=5.0) == 1.0 and clock[0] <= 8


def can_lower_nice() -> bool:
    """Whether this process may lower a niceness (root, CAP_SYS_NICE or RLIMIT_NICE): tried in a child."""
    import subprocess
    import sys

    code = "import os; os.nice(1); os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) - 1)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_a_worker_the_reniced_raylet_started_takes_rays_worker_niceness_back():
    """A worker started at the control plane's 19 (as the local cluster's reniced raylet starts them) brings every
    thread, those already running included, down to the niceness the local cluster's environment names, where
    it may; without that variable (a joined cluster) nothing changes."""
    import os
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("per-thread niceness is Linux's")
    code = ("import os, threading, time; from nmtcore.sweep.ray_backend import restore_worker_nice; "
            "threading.Thread(target=time.sleep, args=(5,), daemon=True).start(); n = restore_worker_nice(); "
            "print(n, sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir('/proc/self/task')}))")

    def worker(env: dict) -> str:
        base = {k: v for k, v in os.environ.items() if k != rb_cluster.WORKER_NICE_VAR}
        out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                             preexec_fn=lambda: os.setpriority(os.PRIO_PROCESS, 0, ray_backend.CONTROL_PLANE_NICE))
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert rb_cluster.LOCAL_RAY_ENV[rb_cluster.WORKER_NICE_VAR] == str(rb_cluster.WORKER_NICE) == "15"
    assert worker({}) == "0 [19]"
    changed, nices = worker({rb_cluster.WORKER_NICE_VAR: "15"}).split(" ", 1)
    if can_lower_nice():
        assert int(changed) >= 2 and nices == "[15]"  # the main thread and the one already sleeping, at least
    else:
        assert (changed, nices) == ("0", "[19]")


def test_the_control_plane_of_a_local_cluster_runs_below_its_trials(monkeypatch):
    """The processes a local cluster's driver started (Ray's daemons) go to nice 19, every thread; Ray's workers
    (``ray::…``: trials) keep theirs; on a cluster this process did not start, nothing changes."""
    import os
    import subprocess
    import sys
    import time

    import psutil

    fake_worker = ("import ctypes, time; ctypes.CDLL(None).prctl(15, b'ray::Trial', 0, 0, 0); "
                   "print('up', flush=True); time.sleep(60)")
    daemon = subprocess.Popen([sys.executable, "-c", "import threading, time; threading.Thread(target=time.sleep, "
                               "args=(60,)).start(); print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    worker = subprocess.Popen([sys.executable, "-c", fake_worker], stdout=subprocess.PIPE)
    try:
        assert daemon.stdout.readline() == b"up\n" and worker.stdout.readline() == b"up\n"
        deadline = time.monotonic() + 10
        while psutil.Process(worker.pid).name() != "ray::Trial" and time.monotonic() < deadline:
            time.sleep(0.05)

        def nices(pid: int) -> set[int]:
            return {os.getpriority(os.PRIO_PROCESS, t.id) for t in psutil.Process(pid).threads()}

        base = os.getpriority(os.PRIO_PROCESS, 0)
        monkeypatch.setattr(rb_cluster, "_local_cluster_pid", None)  # a joined cluster, or none
        assert ray_backend.yield_control_plane() == 0 and nices(daemon.pid) == {base}
        monkeypatch.setattr(rb_cluster, "_local_cluster_pid", os.getpid())
        changed = ray_backend.yield_control_plane()
        if base < ray_backend.CONTROL_PLANE_NICE:
            assert changed >= 2  # the daemon's two threads at least
        else:  # the suite itself runs at the control plane's nice or lower priority: nothing to lower
            assert changed == 0
        assert nices(daemon.pid) == {max(base, ray_backend.CONTROL_PLANE_NICE)}
        assert nices(worker.pid) == {base}
        assert ray_backend.yield_control_plane() == 0  # once is enough
    finally:
        for proc in (daemon, worker):
            proc.kill()
            proc.wait()


def test_a_local_cluster_runs_trials_without_ray_trains_preemption_watcher(monkeypatch):
    """A local cluster (one machine, no node drains) turns Ray Train's preemption watcher off for its processes;
    a user's own setting wins, and a joined cluster keeps Ray's default."""
    from types import SimpleNamespace

    key = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
    for k in [*ray_backend.RAY_ENV, key]:
        monkeypatch.delenv(k, raising=False)  # init_ray sets defaults in os.environ; monkeypatch restores them
    calls: list[dict] = []
    monkeypatch.setattr(rb_cluster.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(rb_cluster.ray, "init", lambda **kw: calls.append(kw) or SimpleNamespace(dashboard_url=None))
    ray_backend.init_ray(num_cpus=1)
    assert calls[-1]["runtime_env"]["env_vars"][key] == "0"
    monkeypatch.setenv(key, "1")
    ray_backend.init_ray(num_cpus=1)
    assert calls[-1]["runtime_env"]["env_vars"][key] == "1"
    monkeypatch.delenv(key)
    ray_backend.init_ray(address="ray://head:10001")
    assert calls[-1]["address"] == "ray://head:10001" and key not in calls[-1]["runtime_env"]["env_vars"]


def test_a_trial_trains_on_idle_cpus_of_its_node_and_gives_them_back(monkeypatch):
    """The last wave's trial takes the idle core (after two checks: between two trials a CPU is free for a
    moment only), shares idle CPUs evenly with the other running trials, and gives them back when Ray hands
    them out; a failing probe changes nothing."""
    from nmtcore.sweep.idle_cpus import BorrowIdleCpus, threads_to_use

    assert threads_to_use(1, total=2, idle=1) == 2  # alone on 2 cores
    assert threads_to_use(1, total=3, idle=1) == 1  # two trials, one idle core: neither takes it
    assert threads_to_use(1, total=4, idle=2) == 2  # ... two idle cores: one each
    # two 2-thread trials on 16 cores: 6 more each
    assert threads_to_use(2, total=16, idle=12) == 8 and threads_to_use(1, total=2, idle=0) == 1
    saved = torch.get_num_threads()
    state = {"t": 0.0, "idle": 1.0}

    def probe() -> tuple[float, float]:
        if state["idle"] is None:
            raise ConnectionError("cluster gone")
        return 2.0, state["idle"]

    try:
        torch.set_num_threads(1)
        borrow = BorrowIdleCpus(probe, every_s=30.0, clock=lambda: state["t"])
        borrow.on_train_start(None)  # first sight of the idle core: not yet
        assert torch.get_num_threads() == 1
        state["t"] = 10.0
        borrow.on_log(None, {})  # within every_s: not even looked
        assert torch.get_num_threads() == 1
        state["t"] = 31.0
        borrow.on_log(None, {})  # idle on two checks in a row: taken
        assert torch.get_num_threads() == 2 and borrow.max_threads == 2
        state["t"], state["idle"] = 62.0, 0.0  # Ray gave it to a new trial: given back at once
        borrow.on_log(None, {})
        assert torch.get_num_threads() == 1
        state["t"], state["idle"] = 93.0, 1.0
        borrow.on_log(None, {})
        state["t"], state["idle"] = 124.0, None
        borrow.on_log(None, {})
        assert torch.get_num_threads() == 1 and borrow.max_threads == 2
    finally:
        torch.set_num_threads(saved)


def test_a_lone_trial_borrows_the_idle_cpu_and_a_full_wave_does_not(ray_cluster, store, tmp_path):
    """In a real sweep on the 2-CPU test cluster: one trial alone trains on 2 threads once the idle CPU has
    been seen twice; its run records it (nmtcore.max_threads). Off with --no-borrow-idle-cpus."""
    space = SearchSpace("lone", "tiny", "transformer", params={"model.d_model": grid((32,))})
    # One epoch of ~100 updates logged every 10: the trial looks at the node at its start and at every log.
    base = tiny_base(tmp_path, **{"train.max_epochs": 1})
    driver.run_sweep(space, base, tiny_settings(tmp_path, "lone", store, borrow_check_s=0.0), log_to_driver=False)
    (child,) = runs_of("lone", store)[1]
    assert child.tags["nmtcore.max_threads"] == "2"
    driver.run_sweep(space, base, tiny_settings(tmp_path / "off", "lone-off", store, borrow_check_s=0.0,
                                                borrow_idle_cpus=False), log_to_driver=False)
    (child,) = runs_of("lone-off", store)[1]
    assert "nmtcore.max_threads" not in child.tags


def test_a_resumed_sweep_takes_settings_that_change_no_result_from_its_command(tmp_path, capsys):
    """A sweep spread over sessions continues with the base config it started with, but settings that change
    only speed and memory (activation checkpointing, turned off to train faster) come from the command that
    resumes it: said on the console and written to its state; anything else stays as it started."""
    from nmtcore.sweep.state import STATE_FILE, ResumeState

    started = tiny_base(tmp_path, **{"model.bert.activation_checkpointing": True, "train.lr": 1e-3})
    state = ResumeState(space="t", model="transformer", parent_run_id="0" * 32, tracking_uri="sqlite:///x.db",
                        seeds=1, base=started)
    command = started.with_overrides({"model.bert.activation_checkpointing": False, "train.lr": 5e-4})
    exp_dir = tmp_path / "sweep"
    resumed = driver._speed_settings_from(state, command, str(exp_dir), "s")
    assert resumed.base.model.bert.activation_checkpointing is False and resumed.base.train.lr == 1e-3
    assert ("sweep s: resumed with model.bert.activation_checkpointing=False (it started with True)"
            in capsys.readouterr().out)
    assert ResumeState.read(exp_dir / STATE_FILE).base == resumed.base
    assert driver._speed_settings_from(resumed, command, str(exp_dir), "s") is resumed  # nothing more to take
