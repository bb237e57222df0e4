"""The study protocol without Ray: the shared baseline is trained once and reused, keyed by exactly what
determines its weights; a warm-started arm starts from the baseline's weights; the control differs from a
BERT arm only in the BERT keys; warm starts that cannot work are refused up front."""

from __future__ import annotations

import shutil

import pytest
import torch

import search_spaces
from nmtcore.checkpoint import load_checkpoint
from nmtcore.engine import build_trainer, warm_start
from nmtcore.sweep import baseline as store
from nmtcore.sweep import plan
from nmtcore.sweep.space import SearchSpace, SpaceError, grid
from nmtcore.testing.synthetic import tiny_experiment
from nmtcore.testing.tiny_bert import tiny_bert_dir
from search_spaces.protocols import FROM_SCRATCH, WARM_START


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny baseline trained through the store, then asked for again."""
    tmp = tmp_path_factory.mktemp("baseline")
    cfg = tiny_experiment(tmp, **{"train.max_epochs": 2})
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    lines: list[str] = []
    first = store.ensure_baseline(cfg, tmp / "store", tracking_uri=uri, used_by="sweep-a", progress=lines.append)
    again = store.ensure_baseline(cfg.with_overrides({"output_dir": str(tmp / "elsewhere"), "train.num_threads": 1,
                                                      "decode.beam": 2}),
                                  tmp / "store", tracking_uri=uri, used_by="sweep-b", progress=lines.append)
    return cfg, tmp, uri, first, again, lines


def test_a_baseline_is_trained_once_and_reused(trained):
    from nmtcore import tracking

    cfg, tmp, uri, first, again, lines = trained
    assert first.trained_now and not again.trained_now and first.key == again.key
    assert [u["used_by"] for u in store.uses(tmp / "store", first.key)] == ["sweep-a", "sweep-b"]
    assert [u["trained_now"] for u in store.uses(tmp / "store", first.key)] == [True, False]
    runs = tracking.search_runs(f"tags.`{store.KEY_TAG}` = '{first.key}'", uri)
    assert len(runs) == 1 and runs[0].status == "FINISHED"  # one tracked training, linked by its key
    assert first.meta["fit"]["epochs"] == 2 and len(first.meta["valid_losses"]) == 2
    assert isinstance(first.meta["converged"], bool)
    assert any("epoch 2/2" in line for line in lines) and any("reused" in line for line in lines)


def test_weight_determining_fields_make_new_baselines(trained):
    cfg, *_ = trained
    checksums = {"train.xx": "a", "vocab": "v"}
    key = store.baseline_key(cfg, checksums, code="c")
    for change in ({"train.lr": 1e-3}, {"train.seed": 2}, {"model.dropout": 0.2}, {"data.max_tokens": 500},
                   {"train.max_epochs": 3}, {"train.average_last": 2, "train.keep_last": 3}):
        assert store.baseline_key(cfg.with_overrides(change), checksums, code="c") != key, change
    assert store.baseline_key(cfg, {**checksums, "vocab": "w"}, code="c") != key  # other data or vocabulary
    assert store.baseline_key(cfg, checksums, code="d") != key  # other training code
    for same in ({"output_dir": "/elsewhere"}, {"train.num_threads": 2}, {"decode.beam": 1},
                 {"train.log_interval": 3}, {"data.test_splits": ["valid"]}):
        assert store.baseline_key(cfg.with_overrides(same), checksums, code="c") == key, same


def test_code_digest_ignores_docstrings_but_not_code(tmp_path, monkeypatch):
    digest = store.code_digest()
    assert digest == store.code_digest() and len(digest) == 64


def test_a_warm_started_arm_starts_from_the_baseline_weights(trained):
    cfg, tmp, *_ = trained
    first = trained[3]
    arm = cfg.with_overrides({"model.name": "bert_fused", "model.bert.name": tiny_bert_dir(),
                              "output_dir": str(tmp / "arm")})
    trainer = build_trainer(arm, device=torch.device("cpu"))
    loaded = warm_start(trainer.model, first.path, arm, trainer.data.vocab)
    base = load_checkpoint(first.path)["model"]
    own = trainer.model.state_dict()
    assert set(loaded.loaded) == set(base) and loaded.fresh  # every baseline tensor loaded; BERT parts fresh
    for name, tensor in base.items():
        assert torch.equal(own[name], tensor), name
    assert all(".bert_attn." in n or n.startswith("bert.") or n.endswith("drop_net_rng") for n in loaded.fresh)


def test_the_control_differs_from_a_bert_arm_only_in_bert_keys():
    base = tiny_experiment_base()
    space = search_spaces.get_space("drop_net:grid")
    cells = space.cells()
    assert cells[0].control and cells[0].label == "control" and not any(c.control for c in cells[1:])
    control = base.with_overrides(cells[0].overrides).flat()
    arm = base.with_overrides(cells[-1].overrides).flat()
    import dataclasses

    from nmtcore.config import BertFusedConfig, ModelConfig

    shared = {k for k in set(control) & set(arm) if control[k] != arm[k]}
    assert shared and all(k == "model.name" or k.startswith("model.bert.") for k in shared), shared
    # What the arm has and the control lacks is the fused model's own knobs (p_net, ...), nothing else.
    own = {f"model.{f.name}" for f in dataclasses.fields(BertFusedConfig)} - \
        {f"model.{f.name}" for f in dataclasses.fields(ModelConfig)}
    assert set(arm) - set(control) == own and "model.p_net" in own, set(arm) - set(control)
    assert not set(control) - set(arm)
    assert control["model.name"] == "transformer" and not control["model.bert.name"]


def tiny_experiment_base():
    import tempfile
    from pathlib import Path

    return tiny_experiment(Path(tempfile.mkdtemp()), **{"model.bert.name": "minilm", "train.valid_bleu": True})


def test_baseline_config_is_the_control_model_with_its_own_budget():
    base = tiny_experiment_base().with_overrides({"train.max_epochs": 3})
    space = SearchSpace("t", "v", "bert_fused", params={"model.p_net": grid((0.0, 1.0))},
                        protocol=WARM_START.__class__(baseline_budget={"train.max_epochs": 7}))
    b = plan.baseline_config(space, base)
    assert b.model.name == "transformer" and not b.model.bert.enabled and b.train.max_epochs == 7


def test_warm_starts_that_cannot_work_are_refused_up_front():
    base = tiny_experiment_base()
    jam = SearchSpace("t", "jam", "bert_jam", arms={"M0": {}}, protocol=WARM_START)
    with pytest.raises(SpaceError, match="bert_jam cannot be warm-started"):
        plan.validate_space(jam, base)
    plan.validate_space(SearchSpace("t", "jam", "bert_jam", arms={"M0": {}}, protocol=FROM_SCRATCH), base)


def test_every_bert_study_runs_under_the_protocol():
    for space in search_spaces.all_spaces():
        if space.study != "transformer_grid":
            assert space.protocol is not None and space.protocol.control, space.name
            assert space.cells()[0].control, space.name


def test_the_protocol_line_states_the_arms_schedule():
    """The report's protocol line says how the arms and the control were trained after the warm start, so a
    reader sees a schedule shorter than the paper's instead of assuming it."""
    from dataclasses import replace

    from nmtcore.sweep.driver import describe_protocol
    from search_spaces.protocols import QUICK_STAGE, STAGE

    space = SearchSpace("s", "v", "bert_fused", params={"model.p_net": grid((0.5, 1.0))}, protocol=WARM_START,
                        budget=STAGE)
    line = describe_protocol(space, None)
    assert "control arm: yes" in line and "second stage, arms and control alike" in line
    for key, value in STAGE.items():
        assert f"{key}={value:g}" in line if isinstance(value, float) else f"{key}={value}" in line
    assert "; to convergence: stopped after 3 epochs without a gain of more than 0.1 in valid_bleu" in line
    assert "not to convergence" not in line
    from nmtcore.config import preset

    converged = describe_protocol(space, None, preset("multi30k_small").with_overrides(STAGE))
    assert "the schedule restarted: update 0, a fresh optimizer, warm-up 400 updates to lr 0.001" in converged
    quick = replace(space, budget=QUICK_STAGE)
    assert "(a fixed number of epochs, not to convergence)" in describe_protocol(quick, None)
    # What the arms really ran: a shortened stage (--arms-set train.max_epochs=1) is what the line says.
    short = preset("multi30k_small").with_overrides({**QUICK_STAGE, "train.max_epochs": 1})
    line = describe_protocol(quick, None, short)
    assert "alike: train.lr=0.0005, train.max_epochs=1, train.warmup_updates=100" in line, line
    assert f"(the study's train.max_epochs={QUICK_STAGE['train.max_epochs']} overridden)" in line
    assert "warm-up 100 updates to lr 0.0005" in line
    patient = SearchSpace("s", "v", "bert_fused", params={"model.p_net": grid((0.5, 1.0))}, protocol=FROM_SCRATCH,
                          budget={"train.max_epochs": 50, "train.patience": 5})
    line = describe_protocol(patient, None)
    assert line.startswith("arms from scratch") and "budget, arms and control alike" in line
    assert "not to convergence" not in line


def test_a_bert_arm_trains_on_its_controls_batches(tmp_path):
    """The token budget counts NMT tokens only: a BERT arm gets the control's batches (sentences, order, number
    of updates), although its BERT stream is longer than the NMT sentence for some of them."""
    from nmtcore.data import batch_indices

    base = tiny_experiment(tmp_path, **{"data.max_tokens": 200})
    control = build_trainer(base.with_overrides({"output_dir": str(tmp_path / "c")}), device=torch.device("cpu"))
    arm = build_trainer(base.with_overrides({"model.name": "bert_fused", "model.bert.name": tiny_bert_dir(),
                                             "output_dir": str(tmp_path / "a")}), device=torch.device("cpu"))
    split = arm.data.splits[base.data.train_split]
    assert split.bert_lens is not None and control.data.splits[base.data.train_split].bert_lens is None
    # The check can fail: counting the BERT stream too would give this arm other batches.
    longer = split.bert_lens > split.src_lens + 1
    assert longer.any()
    bert_aware = batch_indices(split.src_lens, split.tgt_lens, 200, shuffle=True, seed=1, epoch=2,
                               bert_lens=split.bert_lens)
    for epoch in (1, 2):
        mine = [b.ids.tolist() for b in arm.train_batches(epoch)]
        theirs = [b.ids.tolist() for b in control.train_batches(epoch)]
        assert mine == theirs
    assert mine != [b.tolist() for b in bert_aware]
    assert arm.updates_per_epoch() == control.updates_per_epoch()
    valid = control.data.splits[base.data.valid_split]
    assert [b.ids.tolist() for b in arm.eval_batches(arm.data.splits[base.data.valid_split])] == \
        [b.ids.tolist() for b in control.eval_batches(valid)]


# ---------------------------------------------------------------------- adopting a baseline across a code change
def _old_code(monkeypatch):
    monkeypatch.setattr(store, "code_digest", lambda: "the older code")


def test_a_finished_baseline_is_adopted_by_newer_code_only_for_the_same_config_and_data(tmp_path, monkeypatch,
                                                                                          capsys):
    from nmtcore import tracking

    cfg = tiny_experiment(tmp_path, **{"train.max_epochs": 1})
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    root = tmp_path / "store"
    with monkeypatch.context() as m:
        _old_code(m)
        old = store.ensure_baseline(cfg, root, tracking_uri=uri, progress=lambda line: None)
    assert (root / old.key / store.INPUTS_FILE).is_file()

    # Before it is adopted, the newer code's sweep names it in a line before it would train a new one.
    sums = store.prepare_data(cfg.data).checksums
    assert [r["key"] for r in store.adoptable(cfg, sums, root)] == [old.key]
    assert store.adoptable(cfg.with_overrides({"train.lr": 1e-3}), sums, root) == []
    with monkeypatch.context() as m:
        m.setattr(store, "_train", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("would train")))
        lines: list[str] = []
        with pytest.raises(RuntimeError, match="would train"):
            store.ensure_baseline(cfg, root, tracking_uri=uri, progress=lines.append)
    assert lines == [f"baseline {store.baseline_key(cfg, sums)[:12]}: none trained by this code; {old.key} (trained "
                     f"{old.meta['created']}) has the same config and data, other engine code: if the change touches "
                     f"no weight, stop now and add --adopt-baseline {old.key} to reuse it"], lines

    with pytest.raises(store.AdoptError, match="another config.*train.lr"):
        store.adopt_baseline(cfg.with_overrides({"train.lr": 1e-3}), old.key, root, tracking_uri=uri)
    with pytest.raises(store.AdoptError, match="no baseline nope"):
        store.adopt_baseline(cfg, "nope", root, tracking_uri=uri)
    # This code's own baseline, stopped part way (no meta.json): adoption says so rather than "a baseline of its own".
    partial = root / store.baseline_key(cfg, sums)
    (partial / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(store.AdoptError, match="trained part way: continue it .* or remove that folder"):
        store.adopt_baseline(cfg, old.key, root, tracking_uri=uri)
    shutil.rmtree(partial)
    new_key = store.adopt_baseline(cfg, old.key, root, tracking_uri=uri, reason="a comment changed")
    assert new_key != old.key and (root / new_key).is_symlink()
    with pytest.raises(store.AdoptError, match="exists already: this code has a finished baseline"):
        store.adopt_baseline(cfg, old.key, root, tracking_uri=uri)

    again = store.ensure_baseline(cfg, root, tracking_uri=uri, progress=lambda line: None)
    assert again.key == new_key and not again.trained_now and again.path.resolve() == old.path.resolve()
    [run] = tracking.search_runs(f"tags.`{store.KEY_TAG}` = '{new_key}'", uri)
    assert run.tags["nmtcore.baseline_adopted_from"] == old.key
    [row] = store.stored_baselines(root)
    assert row["key"] == old.key and row["finished"] and row["adopted_as"] == [new_key] and row["epochs"] == 1
    from nmtcore.cli.main import main

    capsys.readouterr()
    assert main(["baselines", "--root", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("1 baseline(s)") and out[1].split()[0] == old.key and f"adopted as {new_key[:12]}" in out[1]

    # The code changes again: the adopted key is adopted in turn, straight onto the directory that trained.
    monkeypatch.setattr(store, "code_digest", lambda: "the newest code")
    newest = store.adopt_baseline(cfg, new_key, root, tracking_uri=uri, reason="another comment")
    assert newest not in (old.key, new_key) and (root / newest).resolve() == (root / old.key).resolve()
    assert [a["key"] for a in store._adoptions(root / old.key)] == [new_key, newest]
    assert store.ensure_baseline(cfg, root, tracking_uri=uri, progress=lambda line: None).key == newest


def test_a_checkout_updated_while_a_baseline_trains_leaves_it_adoptable(tmp_path, monkeypatch):
    """The code on disk changes while the baseline trains (a merge during a long training): its record keeps the
    code its key hashed, so the next code adopts it (it recorded the new code once, and adoption was refused)."""
    from nmtcore.engine import Callback

    class CodeChanges(Callback):
        def on_train_start(self, trainer):
            monkeypatch.setattr(store, "code_digest", lambda: "the code merged meanwhile")

    cfg = tiny_experiment(tmp_path, **{"train.max_epochs": 1})
    root = tmp_path / "store"
    _old_code(monkeypatch)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    old = store.ensure_baseline(cfg, root, tracking_uri=uri, progress=lambda line: None, callbacks=(CodeChanges(),))
    assert old.meta["code"] == "the older code"
    new_key = store.adopt_baseline(cfg, old.key, root, tracking_uri=uri)
    assert new_key != old.key and (root / new_key).resolve() == (root / old.key).resolve()


def test_a_baseline_trained_before_a_setting_existed_is_adoptable_at_the_setting_s_default(tmp_path, monkeypatch):
    """Older code had no ``train.loss_guard``: its baseline recorded (and hashed) a weight config without it. Newer
    code adopts it with the setting at its default (the older behaviour), and names the setting when it is not."""
    cfg = tiny_experiment(tmp_path, **{"train.max_epochs": 1})
    root, uri = tmp_path / "store", f"sqlite:///{tmp_path / 'mlflow.db'}"
    older_weights = store.weight_config
    with monkeypatch.context() as m:
        _old_code(m)
        m.setattr(store, "weight_config", lambda c: {k: v for k, v in older_weights(c).items()
                                                     if k != "train.loss_guard"})
        old = store.ensure_baseline(cfg, root, tracking_uri=uri, progress=lambda line: None)
    assert "train.loss_guard" not in old.meta["weight_config"]
    sums = store.prepare_data(cfg.data).checksums
    guarded = cfg.with_overrides({"train.stop_metric": "valid_bleu", "train.valid_bleu": True, "train.patience": 1,
                                  "train.loss_guard": True})
    assert [r["key"] for r in store.adoptable(cfg, sums, root)] == [old.key]
    assert store.adoptable(guarded, sums, root) == []
    with pytest.raises(store.AdoptError, match="another config.*train.loss_guard"):
        store.adopt_baseline(guarded, old.key, root, tracking_uri=uri)
    new_key = store.adopt_baseline(cfg, old.key, root, tracking_uri=uri, reason="a setting added, at its default")
    assert store.ensure_baseline(cfg, root, tracking_uri=uri, progress=lambda line: None).key == new_key


def test_a_baseline_is_adopted_under_a_changed_stopping_rule_only_if_its_epochs_replay_to_the_same_stop(
        tmp_path, monkeypatch):
    """A stopping-rule setting (``train.patience``, ``train.min_delta``, ``train.loss_guard``) changes the weights
    only through where the run stops: the stored baseline's recorded epochs are replayed under the new rule, and
    it is adopted when the rule stops it at the same epoch with the same best epoch, refused (saying where the new
    rule would stop it) otherwise. Any other setting is still refused outright."""
    cfg = tiny_experiment(tmp_path, **{"train.max_epochs": 3})
    root, uri = tmp_path / "store", f"sqlite:///{tmp_path / 'mlflow.db'}"
    with monkeypatch.context() as m:
        _old_code(m)
        old = store.ensure_baseline(cfg, root, tracking_uri=uri, progress=lambda line: None)
    assert old.meta["fit"]["epochs"] == 3 and old.meta["fit"]["stopped_by"] == "schedule"
    sums = store.prepare_data(cfg.data).checksums
    # the tiny experiment warms up over 50 updates: every epoch here ends after it
    falling = [{"valid_loss": x, "num_updates": 100.0 * e} for e, x in enumerate((5.0, 4.0, 3.0), start=1)]
    rising = [{"valid_loss": x, "num_updates": 100.0 * e} for e, x in enumerate((3.0, 4.0, 5.0), start=1)]
    patient = cfg.with_overrides({"train.patience": 2})  # a rule where there was none, same cap
    with monkeypatch.context() as m:
        m.setattr(store, "load_checkpoint", lambda path: {"train_state": {"history": rising}})
        assert store.adoptable(patient, sums, root) == []
        with pytest.raises(store.AdoptError, match="another stopping rule \\(train.patience\\) and this rule would "
                                                   "stop it after epoch 3 \\(best 1\\), not where it stopped "
                                                   "\\(after epoch 3, best 3, by schedule\\): not adoptable"):
            store.adopt_baseline(patient, old.key, root, tracking_uri=uri)
    with pytest.raises(store.AdoptError, match="another config \\(train.lr, train.patience\\)"):
        store.adopt_baseline(patient.with_overrides({"train.lr": 1e-3}), old.key, root, tracking_uri=uri)
    with monkeypatch.context() as m:
        m.setattr(store, "load_checkpoint", lambda path: {"train_state": {"history": falling}})
        assert [r["key"] for r in store.adoptable(patient, sums, root)] == [old.key]
        new_key = store.adopt_baseline(patient, old.key, root, tracking_uri=uri)
    [record] = store._adoptions(root / old.key)
    assert record["key"] == new_key and "stopping rule changed (train.patience: 0 -> 2)" in record["reason"]
    assert store.ensure_baseline(patient, root, tracking_uri=uri, progress=lambda line: None).key == new_key

    # The code changes again: the key adopted under the new rule is adopted in turn (its own hash covered a config
    # no record keeps, so the directory that trained is what is checked against the data).
    monkeypatch.setattr(store, "code_digest", lambda: "the newest code")
    with monkeypatch.context() as m:
        m.setattr(store, "load_checkpoint", lambda path: {"train_state": {"history": falling}})
        newest = store.adopt_baseline(patient, new_key, root, tracking_uri=uri)
        # ... and refused on other data: one training sentence changed
        shutil.copytree(cfg.data.data_dir, tmp_path / "other")
        train = tmp_path / "other" / "train.yy"
        first, rest = train.read_text(encoding="utf-8").split("\n", 1)
        train.write_text(first + " changed\n" + rest, encoding="utf-8")
        other = patient.with_overrides({"data.data_dir": str(tmp_path / "other"),
                                        "data.cache_dir": str(tmp_path / "other-cache")})
        with monkeypatch.context() as m2:
            m2.setattr(store, "code_digest", lambda: "code after that")
            with pytest.raises(store.AdoptError, match="trained on other data"):
                store.adopt_baseline(other, newest, root, tracking_uri=uri)
    assert (root / newest).resolve() == (root / old.key).resolve()
    assert store.ensure_baseline(patient, root, tracking_uri=uri, progress=lambda line: None).key == newest


def test_a_part_trained_baseline_adopted_by_newer_code_resumes_where_it_stopped(tmp_path, monkeypatch):
    from nmtcore import tracking
    from nmtcore.engine import Callback

    class StopAfterFirstEpoch(Callback):
        def on_epoch_end(self, trainer, epoch, metrics, checkpoint):
            raise KeyboardInterrupt("stopped after epoch 1")

    cfg = tiny_experiment(tmp_path, **{"train.max_epochs": 2})
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    root = tmp_path / "store"
    with monkeypatch.context() as m:
        _old_code(m)
        old_key = store.baseline_key(cfg, store.prepare_data(cfg.data).checksums)
        with pytest.raises(KeyboardInterrupt):
            store.ensure_baseline(cfg, root, tracking_uri=uri, progress=lambda line: None,
                                  callbacks=(StopAfterFirstEpoch(),))
    assert not (root / old_key / "meta.json").exists() and (root / old_key / "run" / "checkpoints").is_dir()

    new_key = store.adopt_baseline(cfg, old_key, root, tracking_uri=uri)
    lines: list[str] = []
    done = store.ensure_baseline(cfg, root, tracking_uri=uri, progress=lines.append)
    assert done.trained_now and done.key == new_key and done.meta["fit"]["epochs"] == 2
    assert any("epochs 2..2 (resumed)" in line for line in lines), lines
    runs = tracking.search_runs(f"tags.`{store.ROLE_TAG}` = 'baseline'", uri)
    assert len(runs) == 1 and runs[0].status == "FINISHED"  # the same tracked run, continued
    assert (root / old_key / "meta.json").is_file()  # written where it trained, found through the new key


def test_a_sweep_run_holding_the_baseline_key_is_never_attached_as_the_baseline(tmp_path):
    """A sweep's parent run carries the key of the baseline it used (and comes into another machine's store with
    ``nmtcore import``, without the baseline's own run): a baseline trained there has a run of its own, and the
    sweep's run keeps its role and status."""
    from nmtcore import tracking
    from nmtcore.data import prepare_data
    from nmtcore.tracking import schema

    cfg = tiny_experiment(tmp_path, **{"train.max_epochs": 1})
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    key = store.baseline_key(cfg, prepare_data(cfg.data).checksums)
    with tracking.Tracker(uri, experiment="sweeps", run_name="an imported sweep",
                          tags={schema.ROLE: "sweep", store.KEY_TAG: key}) as parent:
        sweep_run = parent.run_id
    made = store.ensure_baseline(cfg, tmp_path / "store", tracking_uri=uri, progress=lambda line: None)
    assert made.key == key and made.trained_now
    runs = {r.run_id: r for r in tracking.search_runs(f"tags.`{store.KEY_TAG}` = '{key}'", uri)}
    assert runs[sweep_run].tags[schema.ROLE] == "sweep" and runs[sweep_run].status == "FINISHED"
    assert made.meta["mlflow_run_id"] != sweep_run and runs[made.meta["mlflow_run_id"]].tags[schema.ROLE] == "baseline"
