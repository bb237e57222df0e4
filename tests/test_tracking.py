"""nmtcore.tracking against a real sqlite MLflow store (one per module: creating its schema takes seconds)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from nmtcore.config import ExperimentConfig, TrainConfig
from nmtcore.tracking import (
    FAILURE_REASON_TAG,
    Tracker,
    TrackingError,
    default_tracking_uri,
    get_run,
    get_run_metrics,
    list_artifacts,
    load_runs,
    provenance_tags,
    read_artifact_text,
    resolve_tracking_uri,
)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Absolute sqlite URI of a store whose schema is already created."""
    uri = "sqlite:///" + str(tmp_path_factory.mktemp("mlflow") / "mlflow.db")
    Tracker(uri, experiment="warmup").end()
    return uri


def _cfg() -> ExperimentConfig:
    # Built directly (not from a dict) so the test does not import the model registry (torch).
    return ExperimentConfig(name="t", train=TrainConfig(lr=1e-3, adam_betas=(0.9, 0.997)))


# ------------------------------------------------------------------------------------ locations
def test_default_tracking_uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("NMTCORE_HOME", str(tmp_path / "home"))
    assert default_tracking_uri() == f"sqlite:///{tmp_path}/home/mlflow.db"
    monkeypatch.delenv("NMTCORE_HOME")
    monkeypatch.chdir(tmp_path)
    assert default_tracking_uri() == f"sqlite:///{tmp_path}/mlruns-nmtcore/mlflow.db"
    # MLflow's own relative default is made absolute, so a worker's other CWD cannot fork the store.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///rel/mlflow.db?timeout=5")
    assert default_tracking_uri() == f"sqlite:///{tmp_path}/rel/mlflow.db?timeout=5"
    assert resolve_tracking_uri("x.db") == f"sqlite:///{tmp_path}/x.db"
    assert resolve_tracking_uri("sqlite:////abs/m.db") == "sqlite:////abs/m.db"
    assert resolve_tracking_uri("http://host:5000") == "http://host:5000"


# ---------------------------------------------------------------------------------------- runs
def test_run_params_metrics_artifacts_tags(store: str, tmp_path: Path) -> None:
    cfg = _cfg()
    ckpt = tmp_path / "model.pt"
    ckpt.write_bytes(b"\x00weights")
    tags = provenance_tags({"nmtcore.data_sha256": "abc123"})
    with Tracker(store, experiment="basic", run_name="baseline", tags=tags) as t:
        t.log_config(cfg)
        for step, loss in enumerate([3.0, 2.5, 2.0], start=1):
            t.log_metrics({"train.loss": loss, "lr": loss / 1000}, step=step)
        t.log_metrics({"valid.bleu": 12.5}, step=3)
        t.log_text("ein Hund .\nzwei Katzen .\n", "hyps/test.de")
        t.log_dict({"bleu": 12.5, "signature": "nrefs:1"}, "scores.json")
        t.log_artifact(ckpt, artifact_path="checkpoints")
        t.set_tags({"nmtcore.phase": "baseline"})
        run_id = t.run_id
    run = get_run(run_id, store)
    assert run.status == "FINISHED" and run.run_name == "baseline"
    p = run.params
    assert len(p) == len(cfg.flat())
    assert p["train.lr"] == "0.001"
    assert p["train.adam_betas"] == "[0.9, 0.997]"  # tuples readable, and parse back as YAML
    assert yaml.safe_load(p["train.adam_betas"]) == [0.9, 0.997]
    assert p["data.test_splits"] == "[test_2016_flickr]"
    assert p["model.d_model"] == "512" and p["name"] == "t" and p["data.data_dir"] == ""
    assert get_run_metrics(run_id, store) == {
        "lr": [(1, 0.003), (2, 0.0025), (3, 0.002)],
        "train.loss": [(1, 3.0), (2, 2.5), (3, 2.0)],
        "valid.bleu": [(3, 12.5)],
    }
    assert run.metrics["train.loss"] == 2.0  # latest value
    assert list_artifacts(run_id, store) == ["checkpoints/model.pt", "config.yaml", "hyps/test.de", "scores.json"]
    assert yaml.safe_load(read_artifact_text(run_id, "config.yaml", store)) == cfg.to_dict()
    assert read_artifact_text(run_id, "hyps/test.de", store) == "ein Hund .\nzwei Katzen .\n"
    assert run.tags["nmtcore.phase"] == "baseline" and run.tags["nmtcore.data_sha256"] == "abc123"
    assert run.tags["nmtcore.python_version"] and run.tags["nmtcore.hostname"] == socket.gethostname()
    assert FAILURE_REASON_TAG not in run.tags
    # Artifacts live next to the sqlite file, not in ./mlruns of the current directory.
    db_dir = store[len("sqlite:///"):].rsplit("/", 1)[0]
    assert run.artifact_uri.startswith(db_dir + "/artifacts/")


def test_many_and_long_params(store: str) -> None:
    with Tracker(store, experiment="limits") as t:
        t.log_params({f"p{i:03d}": i for i in range(250)})  # > 100: several batches
        t.log_params({"long": "x" * 7000})  # MLflow's limit is 6000 characters
        with pytest.raises(ValueError, match="key"):
            t.log_params({"k" * 251: 1})
        run_id = t.run_id
    params = get_run(run_id, store).params
    assert len(params) == 251 and params["p249"] == "249"
    assert len(params["long"]) == 6000 and params["long"].endswith("...[truncated]")


def test_nested_runs(store: str) -> None:
    with Tracker(store, experiment="sweep", run_name="sweep") as parent:
        with parent.child("trial-0") as c0:
            # Two open runs in one process log independently (no global active-run stack).
            c0.log_metrics({"valid.bleu": 10.0}, step=1)
            parent.log_metrics({"best.bleu": 10.0}, step=0)
        c1 = Tracker(store, run_name="trial-1", parent_run_id=parent.run_id)
        c1.log_metrics({"valid.bleu": 11.0}, step=1)
        c1.end()
        assert c1.experiment_id == parent.experiment_id
    children = load_runs("sweep", store, parent_run_id=parent.run_id)
    assert [r.run_name for r in children] == ["trial-0", "trial-1"]
    assert all(r.parent_run_id == parent.run_id and r.status == "FINISHED" for r in children)
    assert len(load_runs("sweep", store)) == 3
    assert load_runs("no-such-experiment", store) == []


def test_exception_ends_failed_with_reason(store: str) -> None:
    with pytest.raises(RuntimeError, match="out of memory"):
        with Tracker(store, experiment="failures") as t:
            t.log_metrics({"loss": 1.0}, step=1)
            raise RuntimeError("CUDA out of memory.\nTried to allocate 2.00 GiB")
    run = get_run(t.run_id, store)
    assert run.status == "FAILED"
    assert run.tags[FAILURE_REASON_TAG] == "RuntimeError: CUDA out of memory."
    with pytest.raises(KeyboardInterrupt):
        with Tracker(store, experiment="failures") as k:
            raise KeyboardInterrupt
    assert get_run(k.run_id, store).status == "KILLED"
    with pytest.raises(SystemExit):
        with Tracker(store, experiment="failures") as ok:
            raise SystemExit(0)
    assert get_run(ok.run_id, store).status == "FINISHED"
    with pytest.raises(ValueError, match="status"):
        Tracker(store, experiment="failures").end("DONE")


def test_reattach_resumes_same_run(store: str) -> None:
    cfg = _cfg()
    first = Tracker(store, experiment="resume", run_name="r")
    first.log_config(cfg)
    first.log_metrics({"loss": 3.0}, step=1)
    first.set_tags({FAILURE_REASON_TAG: "RuntimeError: node lost"})
    first.end("FAILED")  # the crashed attempt
    with Tracker(store, run_id=first.run_id, tags={"nmtcore.resumed": "true"}) as again:
        assert again.run_id == first.run_id and again.resumed
        assert get_run(first.run_id, store).status == "RUNNING"
        again.log_config(cfg)  # identical params re-logged: allowed
        again.log_metrics({"loss": 2.0}, step=2)
        # A resume with a different config is a real error, not a hiccup: it raises, naming the key.
        with pytest.raises(TrackingError, match="train.lr"):
            again.log_config(ExperimentConfig(name="t", train=TrainConfig(lr=5e-3, adam_betas=(0.9, 0.997))))
        # A setting that changes no result (activation checkpointing: speed and memory) may change on a resume:
        # the run keeps the value it started with and records the change.
        from nmtcore.config import SPEED_ONLY_KEYS

        faster = cfg.with_overrides({"model.bert.activation_checkpointing": False, "train.log_interval": 7})
        again.log_config(faster, changeable=SPEED_ONLY_KEYS)
        with pytest.raises(TrackingError, match="model.bert.activation_checkpointing"):
            again.log_config(faster)  # not declared changeable: refused as any other
    runs = load_runs("resume", store)
    assert len(runs) == 1
    run = runs[0]
    assert run.params["model.bert.activation_checkpointing"] == "True" and run.params["train.log_interval"] == "50"
    assert run.tags["nmtcore.changed_on_resume"] == ("model.bert.activation_checkpointing: True -> False; "
                                                     "train.log_interval: 50 -> 7")
    assert run.status == "FINISHED" and FAILURE_REASON_TAG not in run.tags
    assert run.tags["nmtcore.attach_count"] == "1" and run.tags["nmtcore.resumed"] == "true"
    assert get_run_metrics(run.run_id, store)["loss"] == [(1, 3.0), (2, 2.0)]
    with pytest.raises(TrackingError, match="run 0123abcd not found"):
        Tracker(store, run_id="0123abcd")
    with pytest.raises(TrackingError, match="cannot read from"):
        get_run("0123abcd", store)


def test_transient_midrun_failure_does_not_kill_training(store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    t = Tracker(store, experiment="hiccups")
    strict = Tracker(store, experiment="hiccups", strict=True)

    def flaky(*args: object, **kwargs: object) -> None:
        raise ConnectionResetError("connection reset by peer")

    for tracker in (t, strict):
        monkeypatch.setattr(tracker._client, "log_batch", flaky)
    t.log_metrics({"loss": 1.0}, step=1)  # warns, does not raise
    assert t.failed_calls == 1
    with pytest.raises(TrackingError, match="connection reset"):
        strict.log_metrics({"loss": 1.0}, step=1)
    monkeypatch.undo()
    t.end()
    strict.end()


# ------------------------------------------------------------------------------ failing at start
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    # MLflow's defaults would retry 7 times with back-off; the user's setting must not apply at start.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "7")
    uri = f"http://127.0.0.1:{_closed_port()}"
    start = time.perf_counter()
    with pytest.raises(TrackingError) as err:
        Tracker(uri, experiment="x")
    assert time.perf_counter() - start < 5.0
    msg = str(err.value)
    assert "\n" not in msg and uri in msg and msg.startswith("cannot start MLflow run at")
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "7"  # restored after the probe


def test_unwritable_store_fails_fast(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(TrackingError) as err:
        Tracker(f"sqlite:///{blocker}/store/mlflow.db")
    msg = str(err.value)
    assert "\n" not in msg and f"{blocker}/store" in msg


def test_read_only_store_dir_fails_fast(tmp_path: Path) -> None:
    """A directory the process really cannot write into: a 0500 one for a user; for root (who writes there
    anyway) /proc, which refuses even root. Nothing is faked: the check must probe, not read mode bits."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    store = Path("/proc") if os.geteuid() == 0 else ro
    try:
        with pytest.raises(TrackingError, match=f"{store} is not writable"):
            Tracker(f"sqlite:///{store}/mlflow.db")
    finally:
        ro.chmod(0o700)
    assert not (store / "mlflow.db").exists() and not list(ro.iterdir())


def test_reading_a_missing_store_does_not_create_it(tmp_path: Path) -> None:
    db = tmp_path / "missing" / "mlflow.db"
    with pytest.raises(TrackingError, match="no tracking store"):
        load_runs(tracking_uri=f"sqlite:///{db}")
    assert not db.parent.exists()


# ------------------------------------------------------------------------------------ provenance
@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_provenance_tags(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "a.txt").write_text("a")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "init"], check=True)
    sha = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()

    tags = provenance_tags({"nmtcore.vocab_sha256": "v1"}, repo_dir=repo)
    assert tags["nmtcore.git_sha"] == sha and tags["mlflow.source.git.commit"] == sha
    assert tags["nmtcore.git_dirty"] == "false"
    assert tags["nmtcore.vocab_sha256"] == "v1"
    for pkg in ("python", "torch", "nmtcore", "sacrebleu", "mlflow"):
        assert tags[f"nmtcore.{pkg}_version"]
    assert tags["nmtcore.hostname"] == socket.gethostname()
    assert tags["nmtcore.cpu"].endswith((f", {os.cpu_count()} CPUs, AMX-BF16", f", {os.cpu_count()} CPUs, AVX512-BF16",
                                         f", {os.cpu_count()} CPUs, AVX512", f", {os.cpu_count()} CPUs, AVX2",
                                         f", {os.cpu_count()} CPUs, no AVX2"))
    (repo / "a.txt").write_text("changed")
    assert provenance_tags(repo_dir=repo)["nmtcore.git_dirty"] == "true"
    outside = provenance_tags(repo_dir=tmp_path)  # not a repository: no git tags, no error
    assert "nmtcore.git_sha" not in outside and "nmtcore.git_dirty" not in outside


def test_a_resume_logs_the_epochs_its_checkpoint_has_and_its_run_lacks(store: str) -> None:
    """A process killed after epoch 3's checkpoint was written but before epoch 3 was logged resumes at epoch 3:
    the callback logs what the restored history holds and the run does not, once."""
    from nmtcore.tracking.callback import TrackingCallback

    history = [{"epoch": float(e), "valid_loss": 5.0 - e, "train_loss": 6.0 - e} for e in (1, 2, 3)]
    with Tracker(store, experiment="relog", run_name="r") as t:
        for h in history[:2]:
            t.log_metrics(h, step=int(h["epoch"]))
        TrackingCallback(t, _cfg()).relog_missing_epochs(history)
        TrackingCallback(t, _cfg()).relog_missing_epochs(history)  # a second resume adds nothing
        run_id = t.run_id
    metrics = get_run_metrics(run_id, store)
    assert metrics["valid_loss"] == [(1, 4.0), (2, 3.0), (3, 2.0)]
    assert metrics["train_loss"] == [(1, 5.0), (2, 4.0), (3, 3.0)]


def test_a_store_killed_while_its_schema_is_made_leaves_no_half_made_database(tmp_path: Path) -> None:
    """SIGKILL while MLflow creates a new store's tables (a sweep stopped in its first seconds): before, the
    database kept part of its tables and every later run failed on it (``table _alembic_tmp_trace_tags already
    exists``); now the schema is built under another name and linked into place only when complete, so the
    next run simply creates the store."""
    import signal
    import sys

    db = tmp_path / "store" / "mlflow.db"
    code = f"from nmtcore.tracking import Tracker; Tracker('sqlite:///{db}').end()"
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.time() + 120
    seen: list[str] = []
    while time.time() < deadline and proc.poll() is None:
        seen = [p.name for p in db.parent.glob("*")] if db.parent.exists() else []
        if any(name.startswith((".mlflow.db.creating-", "mlflow.db")) for name in seen):
            time.sleep(0.3)  # well inside the seconds the migrations take
            break
        time.sleep(0.005)
    assert proc.poll() is None, f"the process ended before it was killed: {seen}"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not db.exists(), "a killed creation left a database behind"
    with Tracker(f"sqlite:///{db}", run_name="after") as tracker:
        tracker.log_metrics({"m": 1.0}, step=0)
    assert [r.run_name for r in load_runs(tracking_uri=f"sqlite:///{db}")] == ["after"]
    assert sorted(p.name for p in db.parent.iterdir() if p.name.startswith(".mlflow.db.creating-")) == []


def test_two_processes_creating_one_store_at_once_both_run(tmp_path: Path) -> None:
    import sys

    db = tmp_path / "mlflow.db"
    code = ("import sys; from nmtcore.tracking import Tracker; "
            f"Tracker('sqlite:///{db}', run_name=sys.argv[1]).end()")
    procs = [subprocess.Popen([sys.executable, "-c", code, name]) for name in ("a", "b")]
    assert [p.wait(timeout=180) for p in procs] == [0, 0]
    assert sorted(r.run_name for r in load_runs(tracking_uri=f"sqlite:///{db}")) == ["a", "b"]
    assert [p.name for p in tmp_path.iterdir()] == ["mlflow.db"]


def test_a_half_made_store_is_named_in_one_line(tmp_path: Path) -> None:
    """A database an interrupted creation left half-made (as before the schema was built aside): one line that
    says so and what it holds, not MLflow's migration traceback."""
    import sqlite3

    db = tmp_path / "mlflow.db"
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE experiments (experiment_id INTEGER PRIMARY KEY)")
        con.execute("CREATE TABLE runs (run_uuid TEXT PRIMARY KEY)")
        con.execute("CREATE TABLE alembic_version (version_num TEXT)")
        con.execute("CREATE TABLE _alembic_tmp_trace_tags (key TEXT)")
    con.close()
    with pytest.raises(TrackingError) as err:
        Tracker(f"sqlite:///{db}")
    message = str(err.value)
    assert "\n" not in message and str(db) in message
    assert "half-made" in message and "_alembic_tmp_trace_tags" in message and "holds no runs" in message
    with pytest.raises(TrackingError, match="half-made"):
        load_runs(tracking_uri=f"sqlite:///{db}")  # reading does not start MLflow's migrations on it either


CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile

processor\t: 1
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse avx2
"""


def test_the_cpu_is_named_with_its_widest_kernels() -> None:
    """The first processor's model and flags; the widest kernels named as every figure names them."""
    from nmtcore.host import isa_class, parse_cpuinfo

    model, flags = parse_cpuinfo(CPUINFO)
    assert model == "Intel(R) Xeon(R) Processor" and {"avx512_bf16", "amx_bf16"} <= flags and "fpu" in flags
    assert isa_class(flags) == "AMX-BF16"
    assert isa_class(flags - {"amx_bf16"}) == "AVX512-BF16"
    assert isa_class(frozenset({"avx2", "avx512f"})) == "AVX512"
    assert isa_class(frozenset({"avx2"})) == "AVX2" and isa_class(frozenset()) == "no AVX2"
    assert parse_cpuinfo("") == ("", frozenset())
