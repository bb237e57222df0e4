"""Memory-aware trial packing: the estimate of one trial's memory (its parts from the config, checked against
a real model and a real process), how many trials fit a node by CPUs and memory, what counts as running out of
memory, and (slow) a sweep whose trials do not fit in memory together running them one at a time."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from nmtcore.allocator import allocator_choice, preload_env
from nmtcore.config import preset
from nmtcore.engine import Callback
from nmtcore.models import build_model
from nmtcore.sweep import driver
from nmtcore.sweep import ray_backend
from nmtcore.sweep.ray_backend import callbacks as rb_callbacks, cluster as rb_cluster, trial as rb_trial
from nmtcore.sweep.memory import GIB, BertFootprint, nmt_parameters, trial_memory
from nmtcore.sweep.settings import SweepError
from nmtcore.sweep.trial import MEMORY_TAG, is_out_of_memory
from nmtcore.testing.sweeps import runs_of, tiny_base, tiny_settings
from search_spaces import SearchSpace, grid

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.mark.parametrize("overrides", [{}, {"model.pre_norm": True}, {"model.share_embeddings": False},
                                       {"model.d_model": 128, "model.ffn_dim": 256, "model.encoder_layers": 2}])
def test_the_nmt_parameter_count_is_the_built_models(overrides) -> None:
    cfg = preset("multi30k_small").with_overrides(overrides)
    model = build_model(cfg.model, cfg.data.vocab_size, 0, 1, 2)
    assert nmt_parameters(cfg) == sum(p.numel() for p in model.parameters())


def test_the_estimate_grows_with_the_batch_the_bert_and_fine_tuning() -> None:
    base = preset("multi30k_small")
    small, big = trial_memory(base), trial_memory(base.with_overrides({"data.max_tokens": 8192}))
    assert big.activations > 1.9 * small.activations and big.weights == small.weights
    bert = BertFootprint(weight_bytes=90 * 1024**2, layers=6, hidden=384, intermediate=1536)
    fused = base.with_overrides({"model.name": "bert_fused", "model.bert.name": "minilm"})
    frozen = trial_memory(fused, bert)
    tuned = trial_memory(fused.with_overrides({"model.bert.freeze": False}), bert)
    assert frozen.weights >= small.weights + bert.weight_bytes
    assert tuned.weights >= frozen.weights + 3 * bert.weight_bytes and tuned.activations > frozen.activations
    assert trial_memory(fused, None).total < frozen.total  # without its footprint the BERT is not counted
    # The budget counts NMT tokens: a BERT stream with the previous sentence as context is longer per batch.
    doc = base.with_overrides({"model.name": "doc_context", "model.bert.name": "minilm", "model.bert.freeze": False})
    tuned_doc = trial_memory(doc, bert)
    assert tuned_doc.activations - small.activations > 1.4 * (tuned.activations - small.activations)
    longer = trial_memory(doc.with_overrides({"model.context_sentences": 2}), bert)  # a longer context segment
    assert longer.activations > tuned_doc.activations and longer.weights == tuned_doc.weights
    assert "GiB" in frozen.describe()


def test_each_model_declares_what_the_estimate_needs_of_it() -> None:
    """NMTModel.memory_traits: the estimate asks the model class, not the config's field names."""
    from nmtcore.models import MemoryTraits, model_class

    base = preset("multi30k_small")

    def traits(**overrides):
        cfg = base.with_overrides(overrides)
        return model_class(cfg.model).memory_traits(cfg)

    assert traits() == MemoryTraits()  # the Transformer holds no BERT
    assert traits(**{"model.name": "bert_fused", "model.bert.name": "minilm"}) == MemoryTraits(berts=1)
    assert traits(**{"model.name": "bert_fused", "model.bert.name": "minilm", "model.bert.freeze": False}) \
        == MemoryTraits(berts=1, bert_fine_tuned=True)
    assert traits(**{"model.name": "bert_jam", "model.bert.name": "minilm"}).bert_fine_tuned  # phase 3 tunes BERT
    assert not traits(**{"model.name": "bert_jam", "model.bert.name": "minilm",
                         "model.schedule": ["warmup", "glu"]}).bert_fine_tuned  # no phase 3
    doc = traits(**{"model.name": "doc_context", "model.bert.name": "minilm", "model.context_sentences": 2})
    assert doc.context_sentences == 2 and doc.berts == 1
    plm = traits(**{"model.name": "plm_sponsored", "model.bert.name": "minilm"})
    assert plm.berts == 2 and plm.bert_fine_tuned


def test_a_bert_footprint_reads_the_weights_and_the_shape(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 256, "num_hidden_layers": 2,
                                                      "intermediate_size": 1024}))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 12345)
    fp = BertFootprint.of_directory(tmp_path)
    assert (fp.weight_bytes, fp.layers, fp.hidden, fp.intermediate) == (12345, 2, 256, 1024)


def test_trials_are_packed_by_memory_as_well_as_cpus(monkeypatch, tmp_path) -> None:
    nodes = [{"node_id": "a" * 16, "cpus": 8.0, "gpus": 0.0, "memory": 10.0 * GIB},
             {"node_id": "b" * 16, "cpus": 2.0, "gpus": 0.0, "memory": 64.0 * GIB}]
    monkeypatch.setattr(rb_cluster, "cluster_nodes", lambda: nodes)
    settings = tiny_settings(tmp_path, "pack", "sqlite:///x.db")
    assert ray_backend.trials_that_fit(settings) == 10  # 8 + 2 by CPUs
    assert ray_backend.trials_that_fit(settings, int(3 * GIB)) == 3 + 2  # node a: 3 by memory; node b: 2 by CPUs
    with pytest.raises(SweepError, match="GiB of memory"):
        ray_backend.trials_that_fit(settings, int(100 * GIB))


@pytest.mark.parametrize("reason, oom", [
    ("OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", True),
    ("MemoryError: ", True),
    ("ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.", True),
    ("NonFiniteLossError: non-finite training loss (nan) at update 3", False),
    ("ValueError: memory_gb must be > 0", False),
])
def test_what_counts_as_out_of_memory(reason: str, oom: bool) -> None:
    assert is_out_of_memory(reason) is oom


PEAK_SCRIPT = """
import json, re, sys, torch
from nmtcore.config import preset
from nmtcore.data import prepare_data
from nmtcore.engine import build_trainer

def hwm():  # peak resident set since the last reset, bytes
    return int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024

cfg = preset("multi30k_small").with_overrides({"data.data_dir": sys.argv[1], "output_dir": sys.argv[2],
                                               "train.num_threads": 1, "train.precision": "fp32"})
data = prepare_data(cfg.data)
trainer = build_trainer(cfg, data, device=torch.device("cpu"))
batches = sorted(trainer.train_batches(epoch=1), key=lambda b: -b.src.numel())[:4]  # the largest batches
prepared = hwm()  # building the vocabulary on a cold cache (SentencePiece) peaks higher than training
open("/proc/self/clear_refs", "w").write("5")  # reset the peak to what is resident now
for b in batches:
    trainer.train_step([b])
print(json.dumps({"peak": hwm(), "prepared": prepared}))
"""


@pytest.mark.slow
def test_the_estimate_covers_a_real_training_process(tmp_path) -> None:
    if not (DATA / "multi30k").is_dir():
        pytest.skip("../shared/data/multi30k not found")
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(DATA), str(tmp_path)], capture_output=True,
                         text=True, timeout=600, check=True)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    peak = figures["peak"]
    estimate = trial_memory(preset("multi30k_small")).total
    print(f"\nmulti30k_small, 4 largest batches: peak RSS while training {peak / GIB:.2f} GiB (data preparation "
          f"{figures['prepared'] / GIB:.2f}), estimate {estimate / GIB:.2f} GiB")
    assert peak <= estimate < 1.6 * peak  # covers it, without wasting most of a node


class _Interval(Callback):
    """Writes when each trial trained (first to last epoch) to a file per trial."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_start(self, trainer) -> None:
        self.t0 = time.time()

    def on_train_end(self, trainer, summary) -> None:
        Path(self.folder, f"{trainer.cfg.model.d_model}.json").write_text(json.dumps([self.t0, time.time()]))


@pytest.mark.slow
def test_trials_that_do_not_fit_in_memory_together_run_one_at_a_time(store, tmp_path, deadline) -> None:
    space = SearchSpace("mem", "t", "transformer", params={"model.d_model": grid((32, 64))})
    base = tiny_base(tmp_path)
    one = max(trial_memory(base.with_overrides({"model.d_model": d})).total for d in (32, 64))
    # Room for one trial (and its Tune actor's reservation, rounded up: ray_backend.actor_memory), not two.
    budget_gb = 1.5 * ray_backend.actor_memory(one) / GIB
    temp = Path("/tmp") / f"ray-mem-{tmp_path.name[-8:]}"
    ray_backend.init_ray(num_cpus=2, dashboard=False, temp_dir=str(temp), log_to_driver=False, memory_gb=budget_gb,
                         worker_env=preload_env(allocator_choice()))  # as a sweep starts one: trials in their actors
    try:
        settings = tiny_settings(tmp_path, "mem", store)
        assert ray_backend.trials_that_fit(settings) == 2  # by CPUs alone both would run at once
        assert ray_backend.trials_that_fit(settings, ray_backend.actor_memory(one)) == 1
        folder = tmp_path / "intervals"
        folder.mkdir()
        result = driver.run_sweep(space, base, settings, trial_callbacks=[_Interval(str(folder))],
                                  log_to_driver=False)
    finally:
        ray_backend.shutdown_ray()
    assert not result.interrupted and {t.status for t in result.trials} == {"TERMINATED"}
    (a0, a1), (b0, b1) = sorted(json.loads(p.read_text()) for p in folder.glob("*.json"))
    assert a1 <= b0, f"trials overlapped: {a0:.0f}-{a1:.0f} and {b0:.0f}-{b1:.0f}"
    _, children = runs_of("mem", store)
    assert len(children) == 2 and all(float(c.tags[MEMORY_TAG]) > 0 for c in children)
    assert {c.tags[ray_backend.TRIAL_PROCESS_TAG] for c in children} == {"tune actor"}


def test_a_trial_that_trains_in_its_actor_reserves_its_own_estimate_there(tmp_path) -> None:
    """The Tune actor of a one-worker trial reserves that trial's CPUs and memory estimate (not the sweep's
    largest), as a Train worker would; an actor whose trial runs Train workers reserves no CPU."""
    from nmtcore.sweep.trial import SweepContext

    space = SearchSpace("mem", "t", "transformer", params={"model.d_model": grid((32, 1024))})
    base = tiny_base(tmp_path)
    ctx = SweepContext(name="mem", space=space, base=base, base_seed=1, tracking_uri="sqlite:///x.db",
                       parent_run_id="0" * 32, train_storage=str(tmp_path), scratch_dir=str(tmp_path), workers=1,
                       cpus_per_worker=1.5, gpus_per_worker=0.0, threads_per_worker=1, controller_failure_limit=1,
                       metric="valid_loss", test_split="test", in_actor=True)
    reserve = ray_backend.trial_actor_resources(ctx)
    bundles = {d: reserve({"model.d_model": d}).bundles for d in (32, 1024)}
    for d, (bundle,) in bundles.items():
        estimate = trial_memory(base.with_overrides({"model.d_model": d, "train.num_threads": 1})).total
        share = ray_backend.DRIVER_RESOURCES["memory"] + estimate
        step = ray_backend.ACTOR_MEMORY_STEP
        assert bundle["CPU"] == 1.5 and share <= bundle["memory"] < share + step, (d, bundle, share)
        assert bundle["memory"] % step == 0  # trials with nearby estimates ask alike: Tune can reuse actors
    assert bundles[1024][0]["memory"] > bundles[32][0]["memory"]
    assert ray_backend.trial_actor_resources(replace(ctx, in_actor=False)) == ray_backend.DRIVER_RESOURCES


def test_a_trial_actor_killed_for_memory_is_failed_as_oom_and_its_retry_ends_at_once(monkeypatch, tmp_path) -> None:
    """A trial that trains in its Tune actor cannot record why Ray's memory monitor killed it: the driver's callback
    ends its run FAILED, tagged out-of-memory from Tune's error, and the retry Tune then starts refuses to train."""
    from types import SimpleNamespace

    from nmtcore import tracking
    from nmtcore.sweep import lifecycle
    from nmtcore.sweep.plan import trial_key, trial_overrides
    from nmtcore.sweep.trial import SweepContext, TrialOutOfMemoryError

    uri = f"sqlite:///{tmp_path}/m.db"
    space = SearchSpace("oomkill", "t", "transformer", params={"model.d_model": grid((32,))})
    with tracking.Tracker(uri, experiment="oomkill", run_name="sweep") as parent:
        parent_id = parent.run_id
    ctx = SweepContext(name="oomkill", space=space, base=tiny_base(tmp_path), base_seed=1, tracking_uri=uri,
                       parent_run_id=parent_id, train_storage=str(tmp_path), scratch_dir=str(tmp_path), workers=1,
                       cpus_per_worker=1.0, gpus_per_worker=0.0, threads_per_worker=1, controller_failure_limit=1,
                       metric="valid_loss", test_split="test", in_actor=True)
    config = {"model.d_model": 32}
    key = trial_key(trial_overrides(space, config, 1))
    run_id, _ = lifecycle.open_child_run(parent_id, key, "d_model=32 seed 1", {}, uri)
    lifecycle.set_trial_state(run_id, lifecycle.TrialState.RUNNING, uri)
    killed = RuntimeError("ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.")
    trial = SimpleNamespace(trial_id="t0", config=config, last_result={}, get_pickled_error=lambda: killed)
    monkeypatch.setattr(rb_callbacks, "remove_leaked_placement_groups", lambda: 0)  # no cluster here
    monkeypatch.setattr(rb_trial, "poll_less", lambda: None)  # a Tune actor's setting: not this process's
    rb_callbacks._SweepCallback(ctx).on_trial_error(0, [], trial)
    run = tracking.get_run(run_id, uri)
    assert run.status == "FAILED" and run.tags[lifecycle.FAILURE_KIND_TAG] == "oom", run.tags
    assert "running low on memory" in run.tags[tracking.FAILURE_REASON_TAG]
    with pytest.raises(TrialOutOfMemoryError, match="running low on memory"):
        rb_trial._trial_main(config, ctx)
    # Another failure (the actor killed by a signal) is retried: no kind tag, so the retry trains.
    run2, _ = lifecycle.open_child_run(parent_id, "other-key", "x", {}, uri)
    monkeypatch.setattr(rb_callbacks, "trial_key", lambda overrides: "other-key")
    crashed = RuntimeError("ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.")
    rb_callbacks._SweepCallback(ctx).on_trial_error(0, [], SimpleNamespace(trial_id="t1", config=config, last_result={},
                                                                          get_pickled_error=lambda: crashed))
    assert lifecycle.FAILURE_KIND_TAG not in tracking.get_run(run2, uri).tags


def test_fractional_resources_fit_as_ray_counts_them(monkeypatch, tmp_path) -> None:
    node = {"node_id": "a" * 16, "cpus": 2.0, "gpus": 1.0, "memory": 64.0 * GIB}
    monkeypatch.setattr(rb_cluster, "cluster_nodes", lambda: [node])
    settings = tiny_settings(tmp_path, "frac", "sqlite:///x.db")
    assert ray_backend.trials_that_fit(replace(settings, cpus_per_trial=0.4)) == 5  # 2.0 // 0.4 == 4.0 in floats
    one_tenth = replace(settings, cpus_per_trial=0.1, gpus_per_trial=0.1)
    assert ray_backend.trials_that_fit(one_tenth) == 10  # 1.0 // 0.1 == 9.0
