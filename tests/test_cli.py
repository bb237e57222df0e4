"""The command line end to end on the synthetic corpus: train (tracked in MLflow), translate, evaluate,
and SIGTERM. Bad input (one-line errors, exit status 2, nothing half-written): tests/test_bad_inputs.py."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nmtcore import tracking
from nmtcore.allocator import find_library
from nmtcore.checkpoint import epoch_checkpoints
from nmtcore.testing.synthetic import translate as gold
from nmtcore.testing.synthetic import write_corpus


def nmtcore(*args, stdin=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "nmtcore.cli", *args], input=stdin, capture_output=True,
                          text=True, cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    data = write_corpus(tmp / "data")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    r = nmtcore("train", "--data-dir", str(data), "--output-dir", str(tmp / "run"), "--tracking-uri", uri,
                "--experiment", "cli-test", "--set", "data.corpus=parallel", "data.src_lang=xx", "data.tgt_lang=yy",
                "data.valid_split=valid", "data.test_splits=test", "data.vocab_size=96", "data.max_tokens=300",
                f"data.cache_dir={tmp / 'cache'}", "model.encoder_layers=2", "model.decoder_layers=2",
                "model.d_model=64", "model.ffn_dim=128", "model.dropout=0.0", "train.lr=5e-3",
                "train.warmup_updates=100", "train.max_epochs=6", "train.num_threads=1", "decode.beam=3")
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp, uri, json.loads(r.stdout)


def test_train_logs_params_metrics_and_hypotheses_to_mlflow(trained):
    tmp, uri, summary = trained
    run = tracking.get_run(summary["mlflow_run_id"], tracking_uri=uri)
    assert run.status == "FINISHED"
    assert run.params["model.d_model"] == "64" and run.params["data.corpus"] == "parallel"
    assert run.tags["nmtcore.model"] == "transformer" and "nmtcore.checksum.vocab" in run.tags
    # The console command trained on tcmalloc where it is installed (it re-executed itself on it: nmtcore.allocator).
    assert run.tags["nmtcore.allocator"] == ("tcmalloc" if find_library("tcmalloc") else "system")
    epochs = tracking.get_run_metrics(summary["mlflow_run_id"], tracking_uri=uri)
    assert [step for step, _ in epochs["valid_loss"]] == list(range(1, 7))
    assert "valid_bleu" in epochs and "test/test/bleu" in epochs
    arts = tracking.list_artifacts(summary["mlflow_run_id"], tracking_uri=uri)
    assert "hypotheses/test.yy" in arts and "config.yaml" in arts and "summary.json" in arts


def test_translate_from_checkpoint_and_evaluate(trained, tmp_path):
    tmp, _, summary = trained
    ckpt = epoch_checkpoints(tmp / "run" / "checkpoints")[-1]
    src = ["ka lo mi nu", "pe ra si"]
    r = nmtcore("translate", "--checkpoint", str(ckpt), "--set", "decode.beam=2", stdin="\n".join(src) + "\n")
    assert r.returncode == 0, r.stderr[-2000:]
    hyps = r.stdout.splitlines()
    assert len(hyps) == 2
    refs = [" ".join(gold(s.split())) for s in src]
    (tmp_path / "h").write_text("\n".join(hyps) + "\n")
    (tmp_path / "r").write_text("\n".join(refs) + "\n")
    r = nmtcore("evaluate", "--hyp", str(tmp_path / "h"), "--ref", str(tmp_path / "r"))
    assert r.returncode == 0, r.stderr[-2000:]
    # evaluate prints sacreBLEU's figure for these very lines (computed here with sacrebleu itself)
    import sacrebleu

    assert json.loads(r.stdout)["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=1e-6)
    # Against another system (the references themselves): ΔBLEU is this one's minus 100, every resample agrees.
    r = nmtcore("evaluate", "--hyp", str(tmp_path / "h"), "--ref", str(tmp_path / "r"), "--against",
                str(tmp_path / "r"), "--bootstrap", "50")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["against"]["bleu"] == pytest.approx(100.0)
    assert out["against"]["delta"] == pytest.approx(out["bleu"] - 100.0) and out["against"]["n_samples"] == 50
    # The hypotheses the run wrote for its test split score what the summary says.
    r = nmtcore("evaluate", "--hyp", summary["test"]["test"]["hyp_path"], "--ref", str(tmp / "data" / "test.yy"))
    assert json.loads(r.stdout)["bleu"] == pytest.approx(summary["test"]["test"]["bleu"])


def test_sigterm_ends_the_mlflow_run_killed_and_keeps_checkpoints(tmp_path):
    import signal
    import time

    data = write_corpus(tmp_path / "data", n_train=1500)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "nmtcore.cli", "train", "--data-dir", str(data), "--output-dir", str(tmp_path / "run"),
         "--tracking-uri", uri, "--experiment", "sigterm", "--set", "data.corpus=parallel", "data.src_lang=xx",
         "data.tgt_lang=yy", "data.valid_split=valid", "data.test_splits=test", "data.vocab_size=96",
         f"data.cache_dir={tmp_path / 'cache'}", "model.encoder_layers=1", "model.decoder_layers=1",
         "model.d_model=32", "model.ffn_dim=64", "train.max_epochs=1000", "train.num_threads=1",
         "train.valid_bleu=false"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ckpt = tmp_path / "run" / "checkpoints" / "epoch1.pt.sha256"
    deadline = time.time() + 300
    while not ckpt.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert ckpt.exists(), proc.communicate()[1][-2000:]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("nmtcore: stopped by SIGTERM; the checkpoints written so far are kept"), err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    runs = tracking.load_runs(experiment="sigterm", tracking_uri=uri)
    assert [r.status for r in runs] == ["KILLED"], err[-2000:]
    saved = epoch_checkpoints(tmp_path / "run" / "checkpoints")
    assert saved  # the resume point survived

    # The same command again resumes from the last checkpoint; Ctrl-C (SIGINT) stops it the same way.
    proc = subprocess.Popen(proc.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    newer = tmp_path / "run" / "checkpoints" / f"epoch{len(saved) + 1}.pt.sha256"
    while not newer.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err[-2000:]
    assert "resumed from" in err and err.strip().splitlines()[-1].startswith("nmtcore: stopped by SIGINT"), err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    assert len(epoch_checkpoints(tmp_path / "run" / "checkpoints")) > len(saved)


@pytest.mark.slow  # ~1 min each: a local Ray cluster and the smoke test's BERT
@pytest.mark.parametrize("phase", ["prepare BERT ", "prepare BERT features "])
def test_ctrl_c_during_a_sweep_s_shared_work_ends_it_with_one_line_and_status_130(tmp_path, phase):
    """SIGINT while the work the trials share runs as Ray tasks (making the BERT, or building its feature
    cache: a task whose work runs in a thread of its own): the sweep stops within a minute, says what it kept in
    one line, exits 130, and leaves no Ray process behind."""
    import signal
    import time

    import psutil

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "sweeps/bert_size_grid.py", "--smoke-test"], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "NMTCORE_NO_PROGRESS": "1"})
    lines: list[str] = []
    deadline = time.time() + 300
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if f" {phase}" in line and "started" in line:
            break
    assert proc.poll() is None, "".join(lines)[-3000:]
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGINT)
    t0 = time.time()
    out, err = proc.communicate(timeout=120)
    assert time.time() - t0 < 60, err[-2000:]
    assert proc.returncode == 130, (out + err)[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("bert_size_grid.py: stopped by SIGINT; what was finished is kept"), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert not _left_running(children), _left_running(children)



@pytest.mark.slow  # ~2 min: a local Ray cluster, the smoke test stopped and resumed
@pytest.mark.parametrize("phase", ["train baseline", "% epoch 1/2 valid_bleu"], ids=["baseline-task", "trials"])
def test_sigterm_stops_a_sweep_with_one_line_and_143_then_resume_finishes_it(tmp_path, phase):
    """SIGTERM (a scheduler's stop) while the shared baseline trains as a Ray task, or while the trials run: the
    sweep ends with one line naming SIGTERM, exit 143, no traceback, no Ray process left (before, Ray's crash
    handler aborted the driver with a stack dump); the same command with --resume then finishes every trial."""
    import signal
    import time

    import psutil

    root = Path(__file__).resolve().parents[1]
    where = ["--storage", str(tmp_path / "sweeps"), "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
             "--baseline-store", str(tmp_path / "baselines"), "--name", "stopped"]
    cmd = [sys.executable, "sweeps/bert_size_grid.py", "--smoke-test", *where]
    env = {**os.environ, "NMTCORE_NO_PROGRESS": "1"}
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    deadline = time.time() + 300
    while time.time() < deadline and not (lines and phase in lines[-1]):
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
    assert proc.poll() is None, "".join(lines)[-3000:]
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert out.strip().splitlines()[-1].startswith("bert_size_grid.py: stopped by SIGTERM; "), out[-3000:]
    assert "Traceback" not in out and "SIGTERM received" not in out, out[-3000:]
    assert not _left_running(children), _left_running(children)
    # Stopped in its trials, it says how to keep them for a machine that is not this one.
    assert ("nmtcore export --sweep stopped --tracking-uri " in out) == ("epoch" in phase), out[-3000:]
    again = [*cmd, "--resume", "--estimate"]  # before its trials a sweep has no state yet: --resume starts it again
    done = subprocess.run(again, cwd=root, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    # Resumed in its trials, its estimate is of what is left of them; started again, of all of it.
    assert ("left of this sweep, estimated cost" in done.stdout) == ("epoch" in phase), done.stdout[-3000:]
    assert "estimated cost on this machine" in done.stdout, done.stdout[-3000:]
    assert "sweep stopped finished" in done.stdout and "TERMINATED" in done.stdout, done.stdout[-3000:]
    assert ("stopped before its trials began" in done.stdout) == ("epoch" not in phase), done.stdout[-3000:]
    # Stopped in its trials, the sweep kept that session's time split: the resumed one reports both sessions.
    assert ("  session 2 (started " in done.stdout) == ("epoch" in phase), done.stdout[-3000:]
    assert not [t for t in ("PENDING", "ERROR", "RUNNING") if f" {t} " in done.stdout], done.stdout[-3000:]


LONG_TASK = """
import signal, sys, time
from nmtcore.sweep.ray_backend import init_ray, run_pre_sweep_task, shutdown_ray

def long_build(seconds, progress=None):  # Python between native calls, as a feature build's batch loop
    t0, n = time.time(), 0
    while time.time() - t0 < seconds:
        sum(i * i for i in range(20000))
        n += 1
        if n % 200 == 0:
            progress(f"batch {n}")
    return "finished"

signal.signal(signal.SIGINT, signal.default_int_handler)  # as the sweep CLI: Ctrl-C unwinds
init_ray(num_cpus=2, dashboard=False)
try:
    print(run_pre_sweep_task("long build", long_build, 600.0, progress_kw="progress"), flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
finally:
    shutdown_ray()
"""


@pytest.mark.slow  # ~30 s: a local Ray cluster
def test_ctrl_c_during_a_long_pre_sweep_task_stops_it_at_once(tmp_path):
    """A pre-sweep task whose work would run 10 minutes (a feature build of a large BERT): SIGINT to the
    driver ends the driver within 45 s, which the work's 600 s would far exceed and the cluster's shutdown leaves
    room for on a loaded machine, and leaves no process of the task running; the work did not finish."""
    import signal
    import time

    import psutil

    script = tmp_path / "long_task.py"
    script.write_text(LONG_TASK, encoding="utf-8")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "NMTCORE_NO_PROGRESS": "1"})
    lines: list[str] = []
    deadline = time.time() + 180
    while time.time() < deadline and not any("long build: batch" in line for line in lines[-1:]):
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
    assert proc.poll() is None, "".join(lines)[-3000:]
    children = psutil.Process(proc.pid).children(recursive=True)  # the cluster's processes, the task's worker too
    proc.send_signal(signal.SIGINT)
    t0 = time.time()
    out, _ = proc.communicate(timeout=120)
    assert time.time() - t0 < 45, out[-2000:]
    assert "interrupted" in out and "finished" not in out, out[-3000:]
    assert not _left_running(children), _left_running(children)


def _left_running(procs: list, within_s: float = 30.0) -> list:
    """The processes of ``procs`` still running (not zombies) after waiting up to ``within_s`` for them to end
    (a loaded 2-core host takes seconds to end a cluster's processes; one left for good is what fails)."""
    import time

    import psutil

    deadline = time.time() + within_s
    while True:
        alive = []
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
        if not alive or time.time() > deadline:
            return alive
        time.sleep(1)
