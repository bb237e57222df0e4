"""The typed records a sweep writes and reads back: its resume state (versioned), the parent and child runs'
tags (nmtcore.tracking.schema) and what a trial is launched with. No Ray, no MLflow server."""

from __future__ import annotations

import json
import pickle

import pytest

from nmtcore.sweep.settings import SweepError
from nmtcore.sweep.state import FORMAT, STATE_FILE, ResumeState
from nmtcore.sweep.trial import TrialLaunch
from nmtcore.testing.synthetic import tiny_experiment
from nmtcore.tracking import schema


@pytest.fixture
def state(tmp_path):
    cfg = tiny_experiment(tmp_path, **{"train.max_epochs": 3, "model.d_model": 48})
    return ResumeState(space="demo", model="bert_fused", parent_run_id="abc123", tracking_uri="sqlite:///x.db",
                       seeds=3, base=cfg)


def test_resume_state_round_trips_with_its_format(state, tmp_path):
    path = state.write(tmp_path / "exp")
    assert path.name == STATE_FILE and json.loads(path.read_text())["format"] == FORMAT
    back = ResumeState.read(path)
    assert back == state
    assert back.base.model.d_model == 48 and back.base.train.max_epochs == 3


def test_a_state_file_from_before_the_format_field_still_resumes(state, tmp_path):
    raw = json.loads(state.to_json())
    del raw["format"], raw["model"]  # the oldest files had neither
    path = tmp_path / STATE_FILE
    path.write_text(json.dumps(raw))
    back = ResumeState.read(path)
    assert back.model == "" and back.parent_run_id == "abc123" and back.base == state.base


@pytest.mark.parametrize("text, says", [
    ('{"format": 99, "space": "demo"}', "state format 99 is newer than this nmtcore reads"),
    ("{not json", "the sweep's state cannot be read (JSONDecodeError"),
    ("[1, 2]", "is not a JSON object"),
    ('{"format": 1, "space": "demo", "seeds": 1}', "lacks parent_run_id, tracking_uri, base"),
    ('{"format": 1, "space": "d", "parent_run_id": "r", "tracking_uri": "u", "seeds": 1, "base": {"train": {"lrr": 1}}}',
     "the sweep's base config no longer loads"),
])
def test_a_damaged_or_newer_state_file_is_refused_in_one_line(text, says, tmp_path):
    path = tmp_path / STATE_FILE
    path.write_text(text)
    with pytest.raises(SweepError) as e:
        ResumeState.read(path)
    assert says in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_sweep_tags_round_trip_and_read_an_older_store():
    rec = schema.SweepTags(name="s", study="bert_benefit", space="bert_fused", model="bert_fused",
                           varied_keys=("model.p_net",), search="grid", space_json='{"metric": "valid_bleu"}',
                           test_splits=("test_2016_flickr", "test_2017_flickr"), experiment_path="/x",
                           protocol="warm start", baseline_key="k" * 24, baseline_run_id="r",
                           baseline_converged=True, baseline_valid_losses=(5.0, 4.5))
    tags = rec.to_tags()
    assert tags[schema.BASELINE_CONVERGED] == "True" and tags[schema.TEST_SPLIT] == "test_2016_flickr"
    assert schema.SweepTags.from_tags(tags) == rec
    assert rec.space_description == {"metric": "valid_bleu"}
    # An older store: one test split, the flag in lower case, no baseline at all.
    old = schema.SweepTags.from_tags({schema.SWEEP: "s", schema.TEST_SPLIT: "test", schema.BASELINE_CONVERGED: "false"})
    assert old.test_splits == ("test",) and old.baseline_converged is False and old.space_description == {}
    assert schema.SweepTags.from_tags({}).baseline_converged is None
    assert schema.BASELINE_KEY not in schema.SweepTags(name="s").to_tags()  # from scratch: no baseline tags


def test_trial_tags_round_trip_as_the_tracker_writes_them():
    rec = schema.TrialTags(sweep="s", study="st", space="sp", model="bert_fused", varied_keys=("model.p_net",),
                           config_key="c" * 12, seed=2, arm="p_net=0.5", control=False, warm_start="none",
                           varied={"model.p_net": 0.5})
    tags = rec.to_tags()
    assert tags["varied.model.p_net"] == 0.5 and tags[schema.CONTROL] == "false"
    as_text = {k: str(v) for k, v in tags.items()}  # MLflow hands tags back as text
    back = schema.TrialTags.from_tags(as_text)
    assert back.seed == 2 and back.control is False and back.varied == {"model.p_net": "0.5"}
    assert back.arm == "p_net=0.5" and back.varied_keys == ("model.p_net",)


def test_a_trial_launch_pickles_and_refuses_what_cannot_run(tmp_path):
    cfg = tiny_experiment(tmp_path)
    launch = TrialLaunch(cfg=cfg, run_id="r1", tracking_uri="sqlite:///x.db", trial_key="k1", trial_id="t1",
                         test_split="test", metric="valid_bleu", threads=1)
    back = pickle.loads(pickle.dumps(launch))  # Ray ships it to every worker
    assert back == launch and back.callbacks == () and not back.in_actor
    with pytest.raises(ValueError, match="its MLflow run and its key"):
        TrialLaunch(cfg=cfg, run_id="", tracking_uri="u", trial_key="k", trial_id="t", test_split="s", metric="m",
                    threads=1)
    with pytest.raises(ValueError, match="must be >= 0"):
        TrialLaunch(cfg=cfg, run_id="r", tracking_uri="u", trial_key="k", trial_id="t", test_split="s", metric="m",
                    threads=-1)


def test_resume_before_the_trials_starts_the_sweep_again_and_a_never_begun_one_is_refused(tmp_path, capsys):
    """A sweep stopped while its shared work ran (the baseline: tens of minutes) has no state file yet; its
    ``--resume`` starts it again (once it said "no sweep to resume"). A name that never began, or began another
    space, is still refused in one line."""
    from dataclasses import replace

    from nmtcore.sweep import driver
    from nmtcore.sweep.space import SearchSpace, grid
    from nmtcore.sweep.state import STARTED_FILE, mark_started
    from nmtcore.testing.sweeps import tiny_base, tiny_settings

    space = SearchSpace("resume", "t", "transformer", params={"model.d_model": grid((32, 48))})
    base = tiny_base(tmp_path)
    settings = tiny_settings(tmp_path, "early", "sqlite:///unused.db", resume=True)
    exp_dir = str(tmp_path / "sweeps" / "early")
    with pytest.raises(SweepError, match="no sweep 'early' to resume") as missing:
        driver._resumed(space, base, settings, exp_dir)
    assert "under a new --name without --resume" in str(missing.value)  # what to do where the checkpoints are not
    mark_started(exp_dir, "other-space")
    with pytest.raises(SweepError, match="no sweep 'early' to resume"):
        driver._resumed(space, base, settings, exp_dir)
    mark_started(exp_dir, space.name)
    assert (tmp_path / "sweeps" / "early" / STARTED_FILE).is_file()
    state, space2, base2, settings2 = driver._resumed(space, base, settings, exp_dir)
    assert state is None and space2 is space and base2 is base and settings2 == replace(settings, resume=False)
    assert "stopped before its trials began" in capsys.readouterr().out
