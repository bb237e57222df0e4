"""Search spaces as data: every key is a real config field, distinct samples give distinct trainer
configs, malformed spaces and unregistered models fail up front with one line. No Ray cluster here."""

from __future__ import annotations

import pytest

import search_spaces
from nmtcore.config import MODEL_CONFIGS, ConfigError, preset
from search_spaces import (
    SearchSpace,
    SpaceError,
    choice,
    grid,
    integer,
    loguniform,
    steps,
    uniform,
)

SPACES = search_spaces.all_spaces()


def _base():
    """The sweeps' default base experiment (Multi30k small Transformer) with a BERT named, as the BERT
    studies' entry points default to (``--set model.bert.name=minilm``)."""
    return preset("multi30k_small").with_overrides({"model.bert.name": "minilm"})


def _skip_unregistered(space: SearchSpace) -> None:
    models = {space.model} | {arm["model.name"] for arm in space.arms.values() if "model.name" in arm}
    missing = sorted(m for m in models if m is not None and m not in MODEL_CONFIGS)
    if missing:
        pytest.skip(f"{space.name}: model(s) {', '.join(missing)} not registered yet "
                    f"(registered: {', '.join(sorted(MODEL_CONFIGS))})")


@pytest.mark.parametrize("space", SPACES, ids=[s.name for s in SPACES])
def test_every_key_maps_to_a_real_config_field(space):
    """For every registered model: each key a space may set (params, fixed, arm overrides) exists in the
    model's config, and every grid value / range end / arm builds a valid experiment config."""
    from nmtcore.sweep import plan

    _skip_unregistered(space)
    base = _base()
    for point in space.example_points():
        overrides = plan.trial_overrides(space, point, base_seed=1)
        cfg = (base).with_overrides(overrides)  # raises ConfigError on an unknown key or a bad value
        flat = cfg.flat()
        for key, value in overrides.items():
            assert key in flat, f"{space.name}: {key} is not a config field"
            assert flat[key] == (list(value) if isinstance(value, tuple) else value), (space.name, key)
    plan.validate_space(space, base)


def test_unregistered_models_are_reported_not_crashed():
    """A space naming a model that is not registered fails with one clear line, before Ray starts."""
    from nmtcore.sweep import plan

    space = SearchSpace("t", "v", "bert_jam_not_there", params={"model.d_model": grid((128, 256))})
    with pytest.raises(SpaceError) as e:
        plan.validate_space(space, _base())
    assert str(e.value) == (f"model 'bert_jam_not_there' is not registered "
                            f"(registered: {', '.join(sorted(MODEL_CONFIGS))})")


def test_unknown_key_fails_up_front_naming_it():
    from nmtcore.sweep import plan

    space = SearchSpace("t", "v", "transformer", params={"model.d_modle": grid((128, 256))})
    with pytest.raises(SpaceError, match=r"t:v: model.d_modle: unknown key"):
        plan.validate_space(space, _base())
    bad_value = SearchSpace("t", "v", "transformer", params={"model.dropout": uniform(0.0, 1.5)})
    with pytest.raises(SpaceError, match=r"model.dropout: must be in \[0, 1\]"):
        plan.validate_space(bad_value, _base())


def test_two_samples_give_two_trainer_configs():
    """The known failure elsewhere: sampled values never reached the trainer, so every trial trained the
    same. Here each distinct point yields a trainer config that differs exactly in the varied keys."""
    from nmtcore.sweep import plan

    base = _base()
    space = search_spaces.get_space("transformer_grid:demo")
    a, b = space.grid_points()[0], space.grid_points()[-1]
    cfg_a = plan.trial_config(base, plan.trial_overrides(space, a, 1), "/tmp/a")
    cfg_b = plan.trial_config(base, plan.trial_overrides(space, b, 1), "/tmp/b")
    diff = {k for k, v in cfg_a.flat().items() if cfg_b.flat()[k] != v}
    assert diff == {"model.d_model", "train.lr", "output_dir"}
    assert (cfg_a.model.d_model, cfg_a.train.lr) == (a["model.d_model"], a["train.lr"])
    assert (cfg_b.model.d_model, cfg_b.train.lr) == (b["model.d_model"], b["train.lr"])


def test_a_study_model_keeps_the_base_sizes():
    """Switching model.name for a study keeps every base model field the new config also has."""

    base = preset("multi30k_small")
    if "bert_fused" not in MODEL_CONFIGS:
        pytest.skip("bert_fused is not registered yet")
    cfg = (base).with_overrides({"model.name": "bert_fused", "model.bert.name": "minilm", "model.p_net": 0.5})
    assert (cfg.model.name, cfg.model.d_model, cfg.model.encoder_layers) == ("bert_fused", 256, 3)
    assert cfg.model.p_net == 0.5
    with pytest.raises(ConfigError, match="model.p_nett: unknown key"):
        (base).with_overrides({"model.name": "bert_fused", "model.bert.name": "minilm", "model.p_nett": 0.5})


def test_seeds_are_one_more_dimension_and_never_collapse_trials():
    from nmtcore.sweep import plan

    space = search_spaces.get_space("transformer_grid:demo")
    keys = {plan.trial_key(plan.trial_overrides(space, {**p, "train.seed": s}, 1))
            for p in space.grid_points() for s in (1, 2)}
    assert len(keys) == 8
    same_config = {plan.config_key(plan.trial_overrides(space, {**space.grid_points()[0], "train.seed": s}, 1))
                   for s in (1, 2, 3)}
    assert len(same_config) == 1


def test_paper_grids_and_spec_validation():
    assert search_spaces.get_space("mask_threshold:paper").params["model.mask_threshold"].values == (
        0.0, 0.01, 0.02, 0.03, 0.04, 0.05)
    full = search_spaces.get_space("bert_size_grid:full")
    assert full.grid_size() == 24 and search_spaces.get_space("bert_size_grid").grid_size() == 4
    assert full.params["model.bert.layers"].values == (2, 4, 6, 8, 10, 12)
    assert full.params["model.bert.hidden"].values == (128, 256, 512, 768)
    assert steps(0, 1, 0.25) == (0.0, 0.25, 0.5, 0.75, 1.0)
    with pytest.raises(SpaceError, match="cannot be mixed"):
        SearchSpace("t", "v", None, params={"a.b": grid((1, 2)), "c.d": uniform(0, 1)})
    with pytest.raises(SpaceError, match="both varied and fixed"):
        SearchSpace("t", "v", None, params={"a.b": grid((1, 2))}, fixed={"a.b": 1})
    with pytest.raises(SpaceError, match="reference arm"):
        SearchSpace("t", "v", None, arms={"x": {}}, reference="y")
    with pytest.raises(SpaceError, match="unknown study"):
        search_spaces.get_space("nope")
    with pytest.raises(SpaceError, match="no variant"):
        search_spaces.get_space("bert_size_grid:nope")
    sampled = SearchSpace("t", "v", None, params={"a.b": loguniform(1e-4, 1e-2), "c.d": integer(1, 3),
                                                  "e.f": choice(("x", "y"))})
    assert sampled.sampled and sampled.grid_size() is None and len(sampled.example_points()) == 2


def test_shrunk_spaces_for_smoke_tests():
    space = search_spaces.get_space("bert_size_grid:demo").shrunk(2)
    assert space.grid_points() == [{"model.bert.layers": 2, "model.bert.hidden": 384},
                                   {"model.bert.layers": 4, "model.bert.hidden": 384}]
    arms = search_spaces.get_space("ablations:bert_jam").shrunk(2)
    assert [p["arm"] for p in arms.grid_points()] == ["M0_full", "M1_weighted_sum"]
    assert search_spaces.get_space("mask_threshold:optuna").shrunk(2).num_samples == 2


# ---------------------------------------------------------------------- the papers' protocols in the studies
def _experiment(space, tmp_path, sets=(), arms=(), smoke: bool = False):
    """What the entry point makes of ``space`` with ``--set sets --arms-set arms`` (the arms' base experiment, the
    baseline's, ...: ``nmtcore.cli.sweep.base_experiment``)."""
    from argparse import Namespace

    from nmtcore.cli.sweep import base_experiment

    return base_experiment(space, Namespace(smoke_test=smoke, data_dir=str(tmp_path), config=None,
                                            preset="multi30k_small", set=list(sets), arms_set=list(arms)))


def _study_base(space, smoke: bool, tmp_path):
    """The arms' base experiment exactly as the entry point makes it."""
    return _experiment(space, tmp_path, smoke=smoke)[0]


@pytest.mark.parametrize("smoke", [False, True])
def test_the_bert_jam_study_runs_every_phase_and_averages_within_its_budget(tmp_path, smoke):
    """Every M0-M3 arm's schedule fits the study's scaled budget (``--budget scaled``, and the smoke test):
    all its phases run, scaled by train.phase_scale, none cut; checkpoint averaging is on (>= 2 epochs, within
    the last phase) and phase 3 stops early on a plateau. Without the scale the same arms are refused."""
    from nmtcore.engine.phases import schedule_of
    from nmtcore.models import build_model
    from nmtcore.sweep import plan
    from nmtcore.testing.zoo import BOS, EOS, PAD, TINY_BERT, VOCAB

    space = search_spaces.get_space("ablations:bert_jam")
    space = space if smoke else space.with_budget("scaled")
    base = _study_base(space, smoke, tmp_path)
    tc = base.train
    assert tc.average_last >= 2 and tc.keep_last >= tc.average_last and tc.patience >= 1
    if not smoke:
        assert (tc.phase_scale, tc.max_epochs, tc.average_last) == (0.2, 12, 2)  # the docstring's budget
    for cell in space.cells():
        cfg = base.with_overrides({**cell.overrides, **({} if cell.control else {"model.bert.name": TINY_BERT["name"]})})
        model = build_model(cfg.model, VOCAB, PAD, BOS, EOS)
        phases = schedule_of(cfg, model)
        if cell.control:
            assert phases == () and cfg.train.kd_alpha == 1.0
            continue
        names = [p.name for p in model.default_phases()]
        assert [p.name for p in phases] == names and len(names) >= 2, cell.label
        assert sum(p.epochs for p in phases) <= tc.max_epochs
        assert phases[-1].name == "finetune" and phases[-1].early_stop
        if not smoke:
            assert phases[-1].epochs >= tc.average_last  # the averaged window lies in the fine-tuning phase
        unscaled = cfg.with_overrides({"train.phase_scale": 1.0})
        with pytest.raises(ConfigError, match=rf"^train.max_epochs: {tc.max_epochs} epochs cannot run"):
            schedule_of(unscaled, model)
    plan.validate_space(space, base)


def test_the_bert_jam_study_trains_every_phase_to_convergence_by_default(tmp_path):
    """The paper trains phases 1-2 "until convergence" and stops phase 3 on the validation curve: the study's
    default budget runs every phase of every arm until the baseline's patience rule fires in it (no phase
    length, no scale), averages the last 2 x patience epochs of phase 3, and trains its control from scratch
    under the same rule; the cap leaves every phase room to converge."""
    from nmtcore.engine.phases import schedule_of
    from nmtcore.models import build_model
    from nmtcore.sweep import plan
    from nmtcore.testing.zoo import BOS, EOS, PAD, TINY_BERT, VOCAB
    from search_spaces.protocols import CONVERGE

    space = search_spaces.get_space("ablations:bert_jam")
    assert space.budget_name == "converged"
    base = _study_base(space, False, tmp_path)
    tc = base.train
    assert {k: getattr(tc, k.split(".")[1]) for k in CONVERGE} == {k: v for k, v in CONVERGE.items()}
    assert tc.phases_converge and tc.phase_scale == 1.0 and tc.average_last == 2 * tc.patience <= tc.keep_last
    for cell in space.cells():
        cfg = base.with_overrides({**cell.overrides, **({} if cell.control else {"model.bert.name": TINY_BERT["name"]})})
        phases = schedule_of(cfg, build_model(cfg.model, VOCAB, PAD, BOS, EOS))
        if cell.control:
            assert phases == ()
            continue
        assert [p.epochs for p in phases] == [0] * len(phases) and phases[-1].name == "finetune", cell.label
        assert tc.max_epochs >= 4 * len(phases) * (tc.patience + 1)  # room: each phase four times its minimum
    plan.validate_space(space, base)


def test_the_plm_studies_train_the_papers_alpha_and_their_controls_train_none():
    """α = 0.9 (Eq. 5) is the KD arms' value of the loss ablation (its reference arm) and a point of both PLM
    α grids; every study's control (a Transformer without a teacher) trains at α = 1."""
    from nmtcore.sweep import plan

    loss = search_spaces.get_space("ablations:plm_sponsored_loss")
    assert loss.reference == "full" and loss.arms["full"]["train.kd_alpha"] == 0.9
    assert {a["train.kd_alpha"] for a in loss.arms.values() if a["model.kd_teacher"]} == {0.9}
    assert 0.9 in search_spaces.get_space("kd_alpha:plm_sponsored").params["train.kd_alpha"].values
    assert 0.9 in search_spaces.get_space("kd_alpha:baseline_kd").params["train.kd_alpha"].values
    for space in SPACES:
        if space.protocol is None or not space.protocol.control:
            continue
        base = _base().with_overrides(dict(space.defaults))
        control = next(c for c in space.cells() if c.control)
        assert plan.trial_config(base, control.overrides, "/tmp/c").train.kd_alpha == 1.0, space.name


def test_arms_set_shortens_the_second_stage_and_leaves_the_shared_baseline_alone(tmp_path):
    """``--arms-set`` reaches the arms' base config only: the baseline (and so its key: the cached one is
    reused) is the same as without it; ``--set`` reaches both."""
    from nmtcore.sweep.baseline import baseline_key

    space = search_spaces.get_space("mask_threshold:paper")

    def made(set_=(), arms=()):
        return _experiment(space, tmp_path, set_, arms)[:2]

    base, baseline = made()
    short, short_baseline = made(arms=["train.max_epochs=1"])
    assert base.train.max_epochs == space.budget["train.max_epochs"] and short.train.max_epochs == 1
    assert short_baseline == baseline and baseline_key(short_baseline, {}, "c") == baseline_key(baseline, {}, "c")
    both, both_baseline = made(set_=["train.max_epochs=1"])
    assert both.train.max_epochs == 1 and both_baseline.train.max_epochs == 1


FUSION_STUDIES = ("bert_size_grid:demo", "bert_benefit:bert_fused", "drop_net:grid", "mask_threshold:paper",
                  "ablations:mask_fusion", "ablations:bert_jam")


def test_the_fusion_studies_train_at_the_papers_dropout_and_share_one_baseline(tmp_path):
    """The studies of models that fuse BERT into the Transformer train at their papers' dropout 0.3, the shared
    baseline and the control too (the preset's 0.1 is the peer benchmark's); the warm-starting ones among them
    share one baseline; ``--set model.dropout=0.1`` gives back the runs made before, baseline included; the
    PLM-sponsored and document-context studies keep the preset's 0.1, as their papers train."""
    from nmtcore.sweep.baseline import weight_config
    from nmtcore.sweep.plan import trial_config

    def made(name, *sets):
        return _experiment(search_spaces.get_space(name), tmp_path, sets)[:2]

    baselines = set()
    for name in FUSION_STUDIES:
        space = search_spaces.get_space(name)
        base, baseline = made(name)
        control = next(c for c in space.cells() if c.control)
        assert base.model.dropout == 0.3, name
        assert trial_config(base, control.overrides, "/tmp/c").model.dropout == 0.3, name
        if space.protocol.warm_start:
            assert baseline.model.dropout == 0.3, name
            baselines.add(repr(sorted(weight_config(baseline).items())))
            old_base, old_baseline = made(name, "model.dropout=0.1")
            assert old_base.model.dropout == 0.1 and old_baseline.model.dropout == 0.1, name
    assert len(baselines) == 1
    for name in ("ablations:plm_sponsored_loss", "ablations:doc_context_type"):
        assert made(name)[0].model.dropout == preset("multi30k_small").model.dropout == 0.1, name


def test_a_key_only_the_arms_model_has_is_set_on_the_arms_alone(tmp_path):
    """PLM-sponsored's target BERT exists in its arms' model, not in the Transformer the study's base config (the
    control's) is: ``--set model.tgt_bert.…`` reaches every arm (after the arm's own bundle) and not the control,
    and the report's protocol line says so; a key no model has is still an unknown key."""
    from nmtcore.sweep.driver import describe_protocol
    from nmtcore.sweep.plan import trial_config, validate_space

    space = search_spaces.get_space("ablations:plm_sponsored_loss")

    def made(*sets, arms=()):
        return _experiment(space, tmp_path, sets, arms)

    plain = made()[0]
    assert plain.model.name == "transformer" and made()[3] is space
    for sets, arms in ((["model.tgt_bert.activation_checkpointing=false"], []),
                       ([], ["model.tgt_bert.activation_checkpointing=false"])):
        base, _, _, spaced = made(*sets, arms=arms)
        assert base == plain and spaced.arm_overrides == {"model.tgt_bert.activation_checkpointing": False}
        validate_space(spaced, base)
        configs = {c.label: trial_config(base, c.overrides, tmp_path / c.label) for c in spaced.cells()}
        assert configs["control"].model.name == "transformer" and not hasattr(configs["control"].model, "tgt_bert")
        arms_ = [c for label, c in configs.items() if label != "control"]
        assert len(arms_) == 7 and all(c.model.tgt_bert.activation_checkpointing is False for c in arms_)
        assert "set on every arm but the control (--set): model.tgt_bert.activation_checkpointing=False" in \
            describe_protocol(spaced, None, base)
        assert spaced.describe()["arm_overrides"] == {"model.tgt_bert.activation_checkpointing": False}
    assert all(c.model.tgt_bert.activation_checkpointing is True for c in
               (trial_config(plain, c.overrides, tmp_path) for c in space.cells() if not c.control))
    assert "arm_overrides" not in space.describe()  # what existing sweeps recorded stays as it was
    with pytest.raises(ConfigError, match=r"^model\.tgt_bert\.nope: unknown key"):
        made("model.tgt_bert.nope=1")
    # a key of the base config's model stays in the base config (and the baseline's, through --set)
    base, _, _, spaced = made("model.bert.activation_checkpointing=false")
    assert base.model.bert.activation_checkpointing is False and spaced is space


def test_a_key_of_some_arms_model_only_is_refused_and_the_users_value_wins_over_an_arms(tmp_path):
    """``--set`` sets a key of the arms' model on every arm or on none: one that some arms' model has and the
    others' lacks is refused naming both; where an arm sets the key itself, the user's value wins."""
    from nmtcore.sweep.plan import trial_config
    from nmtcore.sweep.space import SearchSpace, SpaceError, grid

    def made(space, *sets):
        return _experiment(space, tmp_path, sets)

    mixed = SearchSpace("t", "mixed", None, arms={"plm": {"model.name": "plm_sponsored"},
                                                  "fused": {"model.name": "bert_fused"}})
    with pytest.raises(ConfigError, match=r"^model\.tgt_bert\.activation_checkpointing: a key of some arms' model "
                                          r"\(plm_sponsored\) that the others' \(bert_fused\) lacks"):
        made(mixed, "model.tgt_bert.activation_checkpointing=false")
    own = SearchSpace("t", "own", "plm_sponsored",
                      arms={"a": {"model.tgt_bert.activation_checkpointing": True}, "b": {}})
    base, _, _, spaced = made(own, "model.tgt_bert.activation_checkpointing=false")
    assert [trial_config(base, c.overrides, tmp_path).model.tgt_bert.activation_checkpointing
            for c in spaced.cells()] == [False, False]
    with pytest.raises(SpaceError, match="is varied by the study"):
        SearchSpace("t", "v", "plm_sponsored", params={"model.tgt_bert.layers": grid([2, 4])},
                    arm_overrides={"model.tgt_bert.layers": 2})


def test_warm_started_studies_train_to_convergence_by_default_and_keep_the_quick_stage_by_name():
    """Every warm-started study's default budget is the patience rule (and its baseline's too); ``--budget quick``
    runs the short fixed stage under its own variant name; an unknown budget is one line naming the known."""
    from nmtcore.sweep.space import SpaceError
    from search_spaces.protocols import QUICK_STAGE

    warm = [s for s in search_spaces.all_spaces() if s.protocol is not None and s.protocol.warm_start]
    assert warm
    for space in warm:
        assert space.budget.get("train.patience", 0) > 0 and space.budget_name == "converged", space.name
        assert space.protocol.baseline_budget.get("train.patience", 0) > 0, space.name
        quick = space.with_budget("quick")
        assert quick.variant == f"{space.variant}-quick" and quick.budget_name == "quick"
        assert not quick.budget.get("train.patience") and quick.protocol == space.protocol
    grid = search_spaces.get_space("bert_size_grid:demo")
    assert grid.with_budget("quick").budget == QUICK_STAGE and grid.with_budget("converged") is grid
    with pytest.raises(SpaceError, match="no budget 'slow' \\(budgets: converged, quick\\)"):
        grid.with_budget("slow")


def test_from_scratch_studies_train_to_convergence_unless_they_run_a_phase_schedule():
    """A from-scratch study's arms stop by the baseline's patience rule (PLM-sponsored's) unless the model trains
    the paper's own phase schedule (BERT-JAM's); ``--budget quick`` is the earlier fixed 10 epochs."""
    from search_spaces.protocols import BASELINE_BUDGET

    scratch = [s for s in search_spaces.all_spaces() if s.protocol is not None and not s.protocol.warm_start]
    assert {s.name for s in scratch} >= {"ablations:plm_sponsored_loss", "kd_alpha:plm_sponsored", "ablations:bert_jam"}
    for space in scratch:
        if "train.phase_scale" in space.budget:  # the paper's phases, each until the baseline's rule fires in it
            assert space.budget.get("train.phases_converge") and space.budget_name == "converged", space.name
            assert {k: space.budget[k] for k in BASELINE_BUDGET} == BASELINE_BUDGET, space.name
            continue
        assert space.budget == BASELINE_BUDGET and space.budget_name == "converged", space.name
        quick = space.with_budget("quick")
        assert quick.budget == {"train.max_epochs": 10} and not quick.budget.get("train.patience"), space.name


def test_each_document_context_is_a_stream_of_its_own_for_the_shared_features(tmp_path):
    """Real, random and fixed context are one BERT read through three streams: the features the trials read are
    prepared (and counted by the estimate) per stream, the BERT itself made once. Where only the integration varies,
    every arm reads the same stream; a grid of BERT sizes has one stream per BERT."""
    from nmtcore.sweep.plan import bert_key, distinct_berts

    types = search_spaces.get_space("ablations:doc_context_type")
    base = _study_base(types, False, tmp_path)
    assert len(distinct_berts(types, base)) == 1
    streams = distinct_berts(types, base, streams=True)
    assert sorted(c.model.context_type for c in streams) == ["fixed", "random", "real"]
    assert len({bert_key(c) for c in streams}) == 1
    integration = search_spaces.get_space("ablations:doc_context_integration")
    base = _study_base(integration, False, tmp_path)
    assert len(distinct_berts(integration, base, streams=True)) == len(distinct_berts(integration, base)) == 1
    grid = search_spaces.get_space("bert_size_grid:demo")
    base = _study_base(grid, False, tmp_path)
    assert len(distinct_berts(grid, base, streams=True)) == len(distinct_berts(grid, base)) == 4


def test_arms_selects_some_of_a_studys_arms_under_a_name_of_their_own():
    """``--arms``: the named arms in the study's order, the control kept, the variant (and so the sweep's default
    name) naming them; an unknown arm, a study of parameters, or a study without a control losing its reference
    arm are one line each."""
    import subprocess
    import sys
    from pathlib import Path

    from nmtcore.sweep.space import SpaceError

    space = search_spaces.get_space("ablations:plm_sponsored_loss")
    some = space.with_arms(["no_kd", "full"])
    assert list(some.arms) == ["full", "no_kd"] and some.variant == "plm_sponsored_loss-full+no_kd"
    assert some.arms["no_kd"] == space.arms["no_kd"] and some.protocol == space.protocol and some.protocol.control
    assert {c.label for c in some.cells() if not c.control} == {"full", "no_kd"}
    assert any(c.control for c in some.cells())
    assert space.with_arms([]) is space
    # BERT-JAM's M1 and M2 without M0, its reference arm: they compare with the control, and the space is valid
    jam = search_spaces.get_space("ablations:bert_jam")
    assert jam.reference == "M0_full" and jam.protocol.control
    m12 = jam.with_arms(["M2_last_layer", "M1_weighted_sum"])
    assert list(m12.arms) == ["M1_weighted_sum", "M2_last_layer"] and m12.reference is None
    assert jam.with_arms(["M0_full", "M1_weighted_sum"]).reference == "M0_full"
    with pytest.raises(SpaceError, match="no arm 'nope' \\(arms: full, no_mlm, "):
        space.with_arms(["nope"])
    with pytest.raises(SpaceError, match="--arms selects arms, and this study varies model.bert.layers"):
        search_spaces.get_space("bert_size_grid:demo").with_arms(["x"])
    plain = SearchSpace("toy", "v", "transformer", arms={"a": {"model.dropout": 0.1}, "b": {"model.dropout": 0.2}},
                        reference="a")  # no protocol, so no control: its arms compare with arm "a"
    assert list(plain.with_arms(["b", "a"]).arms) == ["a", "b"]
    with pytest.raises(SpaceError, match="no control and compares with its arm 'a': add it to --arms"):
        plain.with_arms(["b"])
    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(repo / "sweeps" / "ablation.py"), "--study", "plm_sponsored_loss",
                        "--arms", "nope"], capture_output=True, text=True, timeout=300, cwd=repo)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "ablation.py: error: ablations:plm_sponsored_loss: no arm 'nope' (arms: full, no_mlm, no_lt, no_kd, "
        "no_mlm_kd, nmt_only, full_layer_kd)"], r.stderr


def test_a_prediction_is_checked_for_its_arm_bound_and_date_and_follows_the_arms_a_sweep_runs():
    """A study's predictions name one of its arms, a measure the report computes, a bound and when they were written;
    anything else is refused up front. A sweep of some arms (``--arms``) keeps those arms' predictions only."""
    from dataclasses import replace

    from nmtcore.sweep.space import Prediction

    for bad in (dict(measure="bleu:"), dict(measure="chrf:test"), dict(at_least=None), dict(written=""),
                dict(at_least=1.0, at_most=0.0), dict(against="M0_full")):
        with pytest.raises(SpaceError):
            Prediction(**{**dict(arm="M0_full", measure="bleu:test", at_least=-0.3, written="2026-12-06 00:05"), **bad})
    space = search_spaces.get_space("ablations:bert_jam")
    held = Prediction("M0_full", "fit:train_nll", at_least=0.0, written="2026-12-06 00:05")
    other = Prediction("M1_weighted_sum", "bleu:test_2016_flickr", at_most=0.5, written="2026-12-06 00:05")
    with pytest.raises(SpaceError, match="not an arm"):
        replace(space, predictions=(replace(held, arm="M9"),))
    with pytest.raises(SpaceError, match="has none"):
        replace(space, protocol=None, predictions=(held,))
    # against another arm, of this study or of a sweep the report pools: no control needed
    assert replace(space, protocol=None, predictions=(replace(other, against="no_kd"),)).predictions
    both = replace(space, predictions=(held, other))
    assert both.with_arms(["M0_full"]).predictions == (held,)
    assert [Prediction.from_description(d) for d in both.describe()["predictions"]] == [held, other]
    assert "predictions" not in space.describe()  # none: the recorded space stays as it was
    assert held.holds(0.0) and not held.holds(-0.001) and other.holds(0.5) and not other.holds(0.51)
    assert (held.bound(), other.bound()) == ("≥ +0.00", "≤ +0.50")
    dropout = search_spaces.get_space("ablations:bert_jam_bert_dropout")
    assert {(p.arm, p.measure) for p in dropout.predictions} == {("M0_bert_dropout", "fit:train_nll"),
                                                                ("M0_bert_dropout", "bleu:test_2016_flickr")}
    (teacher,) = search_spaces.get_space("ablations:plm_kd_teacher").predictions
    assert (teacher.arm, teacher.against) == ("full_teacher_l4", "no_kd")
