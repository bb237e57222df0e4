"""Trials trained before, copied instead of trained again (:mod:`nmtcore.sweep.reuse`): what the reuse key
counts and ignores, and two sweeps in one store, the second copying the trial they share."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nmtcore import tracking
from nmtcore.config import preset
from nmtcore.sweep import archive, cost, driver, lifecycle, reuse
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
        assert (root / entry).exists(), entry  # a renamed layer would silently change what the key covers
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
    # A finished trial outlives its machine: the first sweep exported, imported into an empty store (another
    # machine's), and its trial is found there as in its own store (docs/sweeps.md, "Across machines").
    other = f"sqlite:///{tmp_path / 'mlflow-other.db'}"
    tracking.Tracker(other, experiment="warmup").end()
    archive.import_sweep(archive.export_sweep("reuse-a", tmp_path / "reuse-a.json.gz", store).where, other)
    found = reuse.find_trained(copy.tags[reuse.REUSE_KEY_TAG], other)
    assert found is not None and found.tags[archive.IMPORTED_FROM_TAG] == original.run_id
    moved = cost.dry_run(second, base, dataclasses.replace(settings, tracking_uri=other), progress=lambda line: None)
    assert len(moved.runs) == 1 and "1 trained before: copied" in next(p for p in moved.phases
                                                                      if p.name == "trials").detail
    # Turned off, the same trial trains again.
    driver.run_sweep(second, base, tiny_settings(tmp_path / "c", "reuse-c", store), log_to_driver=False)
    _, again = runs_of("reuse-c", store)
    assert not any(reuse.REUSED_FROM_TAG in r.tags for r in again) and len(again) == 2


def test_a_trial_key_leaves_out_the_other_model_families_files():
    """Each family's trials hash its own model file and the model files it imports, not another family's: the
    Transformer's leave out every BERT family's, BERT-fused's keep the Transformer's, PLM-sponsored's keep FWET's."""
    assert {"nmtcore/models/plm_sponsored.py", "nmtcore/models/bert_fused.py", "nmtcore/models/fwet.py"} \
        <= reuse.other_family_files("nmtcore.models.transformer")
    assert "nmtcore/models/transformer.py" not in reuse.other_family_files("nmtcore.models.transformer")
    assert "nmtcore/models/transformer.py" not in reuse.other_family_files("nmtcore.models.bert_fused")
    assert "nmtcore/models/bert_jam.py" in reuse.other_family_files("nmtcore.models.bert_fused")
    plm = reuse.other_family_files("nmtcore.models.plm_sponsored")
    assert "nmtcore/models/fwet.py" not in plm and "nmtcore/models/transformer.py" in plm
    assert not set(reuse.SHARED_MODEL_FILES) & plm  # base and registry count for every family
    with pytest.raises(ValueError, match="not a model family"):
        reuse.other_family_files("nmtcore.models.registry")


def test_a_change_to_one_family_file_changes_only_the_keys_of_the_trials_that_run_it(tmp_path):
    """On a copy of the package: an added function in PLM-sponsored's file changes its trials' code digest and
    no Transformer's or BERT-fused's; one in the Transformer's changes the Transformer's and BERT-fused's."""
    root = Path(reuse.__file__).resolve().parents[2]
    shutil.copytree(root / "nmtcore", tmp_path / "nmtcore", ignore=shutil.ignore_patterns("__pycache__"))
    families = ("transformer", "bert_fused", "plm_sponsored")
    probe = ("import json; from nmtcore.sweep import reuse; "
             f"print(json.dumps({{f: reuse.trial_code('nmtcore.models.' + f) for f in {families!r}}}))")

    def digests() -> dict[str, str]:
        out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(tmp_path)}, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    before = digests()
    with open(tmp_path / "nmtcore/models/plm_sponsored.py", "a", encoding="utf-8") as f:
        f.write("\n\ndef _added():\n    return 1\n")
    after_plm = digests()
    assert after_plm["plm_sponsored"] != before["plm_sponsored"]
    assert after_plm["transformer"] == before["transformer"] and after_plm["bert_fused"] == before["bert_fused"]
    with open(tmp_path / "nmtcore/models/transformer.py", "a", encoding="utf-8") as f:
        f.write("\n\ndef _added():\n    return 1\n")
    after_tf = digests()
    assert after_tf["transformer"] != after_plm["transformer"] and after_tf["bert_fused"] != after_plm["bert_fused"]
    assert after_tf["plm_sponsored"] == after_plm["plm_sponsored"]  # PLM-sponsored does not build on the Transformer
    # A family file that code outside the zoo imports counts for every family.
    (tmp_path / "nmtcore/engine/_uses_plm.py").write_text("from nmtcore.models.plm_sponsored import PlmSponsored\n")
    after_import = digests()
    (tmp_path / "nmtcore/engine/_uses_plm.py").unlink()
    with open(tmp_path / "nmtcore/models/plm_sponsored.py", "a", encoding="utf-8") as f:
        f.write("\n\ndef _added_again():\n    return 2\n")
    (tmp_path / "nmtcore/engine/_uses_plm.py").write_text("from nmtcore.models.plm_sponsored import PlmSponsored\n")
    assert digests()["transformer"] != after_import["transformer"]
