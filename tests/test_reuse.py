"""Trials trained before, copied instead of trained again (:mod:`nmtcore.sweep.reuse`): what the reuse key
counts and ignores, and two sweeps in one store, the second copying the trial they share."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from nmtcore import tracking
from nmtcore.config import preset
from nmtcore.sweep import cost, driver, lifecycle, reuse
from nmtcore.testing.sweeps import runs_of, tiny_base, tiny_settings
from nmtcore.tracking import schema
from search_spaces import SearchSpace, grid

DATA = {"train.en": "a" * 64, "vocab": "b" * 64}


def test_the_key_ignores_paths_threads_and_logging_and_counts_what_decides_results(tmp_path):
    cfg = preset("multi30k_small")
    key = reuse.reuse_key(cfg, DATA)
    same = cfg.with_overrides({"output_dir": str(tmp_path / "elsewhere"), "train.num_threads": 7,
                               "train.log_interval": 3, "data.data_dir": "/somewhere", "train.keep_last": 9,
                               "name": "other", "model.bert.activation_checkpointing": False})
    assert reuse.reuse_key(same, DATA) == key
    differs = {"seed": cfg.with_overrides({"train.seed": 2}), "decoding": cfg.with_overrides({"decode.beam": 4}),
               "tested on": cfg.with_overrides({"data.test_splits": ["test_2017_flickr"]}),
               "precision": cfg.with_overrides({"train.precision": "fp32" if reuse.reuse_key(
                   cfg.with_overrides({"train.precision": "fp32"}), DATA) != key else "bf16"})}
    for what, other in differs.items():
        assert reuse.reuse_key(other, DATA) != key, what
    assert reuse.reuse_key(cfg, {**DATA, "train.en": "c" * 64}) != key  # other data
    assert reuse.reuse_key(cfg, DATA, device="cuda") != key
    # The starting weights count by content, not by path: a copy elsewhere is the same start, one byte off is not.
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"w": torch.arange(4.0)}, a)
    b.write_bytes(a.read_bytes())
    ka = reuse.reuse_key(cfg.with_overrides({"train.init_from": str(a)}), DATA)
    assert ka == reuse.reuse_key(cfg.with_overrides({"train.init_from": str(b)}), DATA) != key
    torch.save({"w": torch.arange(4.0) + 1}, b)
    assert reuse.reuse_key(cfg.with_overrides({"train.init_from": str(b)}), DATA) != ka


def test_the_code_it_hashes_is_the_package_but_the_layers_that_run_and_record_trials():
    root = Path(reuse.__file__).resolve().parents[2]
    for entry in (*reuse.CODE, *reuse.NOT_CODE):
        assert (root / entry).is_dir(), entry  # a renamed layer would silently change what the key covers
    from nmtcore.sweep.baseline import code_digest

    assert reuse.trial_code() == code_digest(reuse.CODE, reuse.NOT_CODE) != code_digest(reuse.CODE)
    assert code_digest(reuse.CODE, ("nmtcore/",)) == code_digest(())  # everything excluded: the empty digest


def test_a_second_sweep_copies_the_trial_the_first_trained(ray_cluster, store, tmp_path, capsys):
    base = tiny_base(tmp_path)
    first = SearchSpace("reuse", "a", "transformer", params={"model.d_model": grid((32, 48))})
    driver.run_sweep(first, base, tiny_settings(tmp_path / "a", "reuse-a", store, reuse_trials=True),
                     log_to_driver=False)
    _, trained = runs_of("reuse-a", store)
    assert all(reuse.REUSE_KEY_TAG in r.tags and reuse.REUSED_FROM_TAG not in r.tags for r in trained)
    capsys.readouterr()

    second = SearchSpace("reuse", "b", "transformer", params={"model.d_model": grid((48, 64))})
    settings = tiny_settings(tmp_path / "b", "reuse-b", store, reuse_trials=True)
    # Its estimate knows: one trial to train, one to copy.
    est = cost.dry_run(second, base, settings, progress=lambda line: None)
    trials = next(p for p in est.phases if p.name == "trials")
    assert len(est.runs) == 1 and trials.detail.startswith("1 trial (and 1 trained before: copied"), trials
    off = cost.dry_run(second, base, dataclasses.replace(settings, reuse_trials=False), progress=lambda line: None)
    assert len(off.runs) == 2
    result = driver.run_sweep(second, base, settings, log_to_driver=False)
    assert not result.interrupted
    (parent,), children = runs_of("reuse-b", store)
    by_d = {c.params["model.d_model"]: c for c in children}
    assert sorted(by_d) == ["48", "64"]
    original = next(r for r in trained if r.params["model.d_model"] == "48")
    copy, fresh = by_d["48"], by_d["64"]
    assert copy.tags[reuse.REUSED_FROM_TAG] == original.run_id and copy.tags[schema.REUSED_FROM_SWEEP] == "reuse-a"
    assert reuse.REUSED_FROM_TAG not in fresh.tags and fresh.tags[reuse.REUSE_KEY_TAG] != copy.tags[reuse.REUSE_KEY_TAG]
    # The copy is a complete trial of the second sweep, with the first's numbers, histories and test outputs.
    assert copy.status == "FINISHED" and copy.tags[lifecycle.TRIAL_STATE_TAG] == "complete"
    assert copy.tags[schema.SWEEP] == "reuse-b" and copy.parent_run_id == parent.run_id
    assert copy.metrics["test/test/bleu"] == original.metrics["test/test/bleu"]
    assert (tracking.get_run_metrics(copy.run_id, store)["valid_loss"]
            == tracking.get_run_metrics(original.run_id, store)["valid_loss"])
    assert (tracking.read_artifact_text(copy.run_id, "references/test.yy", store)
            == tracking.read_artifact_text(original.run_id, "references/test.yy", store))
    out = capsys.readouterr().out
    assert f"d_model=48 seed 1 (" in out and f"copied, not trained again: run {original.run_id} of sweep reuse-a" in out
    # The report says which row is a copy, and of what.
    table = (tmp_path / "b" / "report" / "table.md").read_text()
    assert "not trained again" in table and original.run_id in table and "reuse-a" in table
    # Turned off, the same trial trains again.
    driver.run_sweep(second, base, tiny_settings(tmp_path / "c", "reuse-c", store), log_to_driver=False)
    _, again = runs_of("reuse-c", store)
    assert not any(reuse.REUSED_FROM_TAG in r.tags for r in again) and len(again) == 2
