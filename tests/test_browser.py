"""A sweep as a first-time user watches it, checked in a real browser (slow).

* **MLflow UI**: after a smoke sweep, ``mlflow ui`` on its store; the page the sweep printed opens on the
  sweep's arms (a model-training runs table, not the GenAI overview) with the varied key and test BLEU as
  columns, best BLEU first; its charts hold the parallel-coordinates plot; the compare view of the child
  runs shows the varied key and BLEU; the parent run's description renders the report's table and figures.
* **Ray dashboard**: during a sweep started as a user would (its own local cluster, token auth on), the
  dashboard at the printed URL asks for the token, takes it from where the sweep said it is, and then lists
  the sweep's pre-sweep tasks ("prepare data ...", "prepare BERT ...", "train baseline ...") and its trials;
  every port of that cluster listens on 127.0.0.1 only.

Needs Debian's chromium (``apt-get install -y chromium``) and Playwright for Python (``pip install
playwright``; no browser download: it drives ``/usr/bin/chromium``, or ``$NMTCORE_CHROMIUM``); skips
with the reason otherwise (fails instead where ``$NMTCORE_REQUIRE_BROWSER`` is set, as in CI). Screenshots go
to ``$NMTCORE_SCREENSHOTS`` when it is set.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from nmtcore.sweep import driver
from nmtcore.testing.sweeps import listening_sockets, runs_of, tiny_base, tiny_settings
from search_spaces import SearchSpace, grid

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("NMTCORE_CHROMIUM", "/usr/bin/chromium")
CHROME_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run"]
VIEWPORT = {"width": 1400, "height": 900}
SHOTS = os.environ.get("NMTCORE_SCREENSHOTS", "")


@pytest.fixture(scope="module")
def browser():
    """Headless Debian chromium driven by Playwright. If either is missing the tests skip, saying what to
    install, or fail where ``$NMTCORE_REQUIRE_BROWSER`` is set (CI, where they gate)."""
    missing = pytest.fail if os.environ.get("NMTCORE_REQUIRE_BROWSER") else pytest.skip
    if not Path(CHROMIUM).exists():
        missing(f"no chromium at {CHROMIUM}: apt-get install -y chromium (or set NMTCORE_CHROMIUM)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("playwright is not installed: pip install playwright (no browser download needed)")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS)
        try:
            yield b
        finally:
            b.close()


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 120.0) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        with contextlib.suppress(Exception), urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer in {timeout:.0f} s")


def shot(page, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SHOTS) / name))


def stop(proc: subprocess.Popen) -> None:
    """End a process this test started, and its process group."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def mlflow_ui(uri: str, log: Path):
    """``mlflow ui`` on ``uri`` (the sweep's printed command, on a free port); yields its address."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri,
                             "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    try:
        wait_http(f"http://127.0.0.1:{port}/health")
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def goto(page, url: str, text: str, timeout_ms: int = 60_000) -> None:
    """Open ``url`` and wait for ``text`` (the MLflow UI polls, so the network never goes idle)."""
    page.goto(url)
    page.get_by_text(text).first.wait_for(timeout=timeout_ms)
    page.wait_for_timeout(1000)


def column_headers(page) -> list[str]:
    return page.evaluate("() => [...new Set(Array.from(document.querySelectorAll('[role=columnheader]'))"
                         ".map(e => e.innerText.trim()).filter(Boolean))]")


def row_names(page, names: list[str]) -> list[str]:
    """The runs in ``names``, in the order the runs table shows them."""
    rows = page.evaluate("() => Array.from(document.querySelectorAll('[role=row][row-index]')).map(r => "
                         "[Number(r.getAttribute('row-index')), r.innerText])")
    shown: dict[int, str] = {}
    for index, text in rows:
        for name in names:
            if name in text.splitlines():
                shown[index] = name
    return [shown[i] for i in sorted(shown)]


def scrolled_text(page, needle: str, steps: int = 60) -> str:
    """The page's text once ``needle`` shows, scrolling every scrollable box a step at a time (tables that
    render only their visible rows); the last text seen if it never does."""
    text = page.inner_text("body")
    for _ in range(steps):
        if needle in text:
            break
        moved = page.evaluate("() => { let moved = false; for (const e of document.querySelectorAll('*')) {"
                              " if (e.scrollHeight > e.clientHeight + 4 && getComputedStyle(e).overflowY !== 'visible'"
                              " && e.scrollTop + e.clientHeight < e.scrollHeight - 1) {"
                              " e.scrollTop += Math.max(40, e.clientHeight / 2); moved = true; } } return moved; }")
        page.wait_for_timeout(150)
        text = page.inner_text("body")
        if not moved:
            break
    return text


# ------------------------------------------------------------------------------------------- MLflow UI
def test_mlflow_ui_opens_on_the_sweeps_arms_and_compares_them(browser, ray_cluster, store, tmp_path, capsys):
    t0 = time.perf_counter()
    space = SearchSpace("browser", "tiny", "transformer", params={"model.d_model": grid((32, 64))})
    result = driver.run_sweep(space, tiny_base(tmp_path), tiny_settings(tmp_path, "browser-ui", store),
                              log_to_driver=False)
    printed = capsys.readouterr().out
    sweep_s = time.perf_counter() - t0
    assert not result.interrupted
    parents, children = runs_of("browser-ui", store)
    names = sorted(c.run_name for c in children)
    assert names == ["d_model=32 seed 1", "d_model=64 seed 1"]
    assert {c.params["arm"] for c in children} == {"d_model=32", "d_model=64"}
    assert {c.params["control"] for c in children} == {"false"}
    bleu = {c.run_name: c.metrics["test/test/bleu"] for c in children}
    best_first = sorted(bleu, key=bleu.get, reverse=True)
    # The sweep printed the page to open: its arms, as a model-training experiment.
    link = re.search(r"then open:\s+(http://127\.0\.0\.1:5000/(\S+))", printed)
    assert link, printed
    route = link.group(2)
    assert "viewStateShareKey=sweep-browser-ui" in route and "workflowType=machine_learning" in route
    sweep_page = re.search(r"the sweep's page: http://127\.0\.0\.1:5000/(\S+)", printed).group(1)

    t1 = time.perf_counter()
    with mlflow_ui(store, tmp_path / "mlflow_ui.log") as ui:
        ctx = browser.new_context(viewport=VIEWPORT)
        page = ctx.new_page()
        goto(page, f"{ui}/{route}", best_first[0])
        assert "/runs" in page.url and "genai" not in page.url.lower()
        headers = column_headers(page)
        assert "model.d_model" in headers and "test/test/bleu" in headers, headers
        assert row_names(page, names) == best_first  # flat (not folded under the parent), best BLEU first
        shot(page, "mlflow_arms.png")
        goto(page, f"{ui}/{route}&compareRunsMode=CHART", "Parallel Coordinates")
        shot(page, "mlflow_charts.png")

        # The compare view of the child runs: the varied key and BLEU, per arm.
        ids = json.dumps([c.run_id for c in children], separators=(",", ":"))
        page.set_viewport_size({"width": 1400, "height": 1800})
        goto(page, f"{ui}/#/compare-runs?runs={ids}&experiments=[\"{children[0].experiment_id}\"]",
             "Parallel Coordinates Plot")
        text = page.inner_text("body")
        for needle in ("model.d_model", *names):
            assert needle in text, needle
        # The parameter and metric tables render only the rows in view (a trial logs some 50 metrics):
        # scroll them as a user would until BLEU's row and both arms' values show.
        text = scrolled_text(page, "test/test/bleu")
        assert "test/test/bleu" in text
        assert all(f"{v:.4g}"[:4] in text for v in bleu.values()), bleu
        shot(page, "mlflow_compare.png")

        # The parent run's page: the report's table and figures in its description, with links to the views.
        page.set_viewport_size(VIEWPORT)
        goto(page, f"{ui}/{sweep_page}", "Compare the arms")
        assert parents[0].run_id in sweep_page
        with contextlib.suppress(Exception):  # a long description starts folded
            page.get_by_text("Show more", exact=True).first.click(timeout=3000)
        page.wait_for_function("() => Array.from(document.images).some(i => i.naturalWidth > 300 && "
                               "i.getAttribute('src').includes('report%2Fbleu_vs_cost.png'))", timeout=30_000)
        text = page.inner_text("body")
        assert "The arms, best test BLEU first" in text and "d_model=64" in text
        shot(page, "mlflow_sweep_page.png")
        ctx.close()
    print(f"\nMLflow browser check: sweep {sweep_s:.0f} s, UI + browser {time.perf_counter() - t1:.0f} s")


# ---------------------------------------------------------------------------------------- Ray dashboard
SWEEP_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from nmtcore.engine import Callback
    from nmtcore.sweep import driver
    from nmtcore.sweep.space import Protocol, SearchSpace, grid
    from nmtcore.testing.sweeps import tiny_base, tiny_settings
    from nmtcore.testing.tiny_bert import tiny_bert_dir

    tmp, gate = Path(sys.argv[1]), Path(sys.argv[2])

    class Gate(Callback):
        # Holds each trial at its end until the test has looked at the dashboard (at most 3 minutes).
        def on_train_end(self, trainer, summary):
            t0 = time.time()
            while not gate.exists() and time.time() - t0 < 180:
                time.sleep(0.5)

    space = SearchSpace("browser", "dash", "bert_fused", params={"model.p_net": grid((0.0, 1.0))},
                        protocol=Protocol(control=False))
    base = tiny_base(tmp, **{"model.bert.name": tiny_bert_dir()})
    settings = tiny_settings(tmp, "browser-dash", f"sqlite:///{tmp / 'mlflow.db'}", dashboard=True,
                             num_cpus=2, ray_temp_dir=sys.argv[3], baseline_store=str(tmp / "baselines"))
    result = driver.run_sweep(space, base, settings, trial_callbacks=[Gate()])
    sys.exit(1 if result.interrupted else 0)
""")


def test_ray_dashboard_signs_in_with_the_printed_token_and_lists_the_sweep(browser, tmp_path):
    t0 = time.perf_counter()
    token = tmp_path / "ray_token"  # the sweep's own token: ~/.ray/auth_token is left alone
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    gate = tmp_path / "gate"
    temp = tempfile.mkdtemp(prefix="rb-", dir="/tmp")  # short: Ray's socket paths are length-limited
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}  # conftest turns auth off; a user has it on
    env.update(RAY_AUTH_TOKEN_PATH=str(token), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", SWEEP_SCRIPT, str(tmp_path), str(gate), temp], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()

    def wait_line(pattern: str, timeout: float = 300.0) -> re.Match:
        t = time.time()
        while time.time() - t < timeout:
            for line in lines[:]:  # a copy: the reader thread appends
                if m := re.search(pattern, line):
                    return m
            if proc.poll() is not None and not reader.is_alive():
                break
            time.sleep(0.5)
        raise AssertionError(f"no line matching {pattern!r} in:\n" + "".join(lines))

    try:
        url = wait_line(r"Ray dashboard:\s+(http://127\.0\.0\.1:\d+)").group(1)
        token_file = wait_line(r"the token is the file (\S+) \(\$RAY_AUTH_TOKEN_PATH\)").group(1)
        assert Path(token_file) == token
        wait_line(r"then open:")  # the pre-sweep tasks are done; the trials are starting
        t_trials = time.perf_counter()
        # Every port of the sweep's local cluster listens on 127.0.0.1 only.
        addresses = {ip for ip, _ in listening_sockets(proc.pid)}
        assert addresses <= {"127.0.0.1", "::ffff:127.0.0.1"}, addresses

        ctx = browser.new_context(viewport=VIEWPORT)
        page = ctx.new_page()
        page.goto(url + "/")
        page.get_by_text("Authentication Token Required").wait_for(timeout=30_000)
        shot(page, "ray_sign_in.png")
        page.get_by_placeholder("Enter your authentication token").fill(Path(token_file).read_text().strip())
        page.get_by_role("button", name="Submit").click()
        page.wait_for_load_state("load")
        page.wait_for_timeout(1500)
        assert not page.get_by_text("Authentication Token Required").is_visible()

        sweep_trial = "trial of browser-dash"
        page.goto(url + "/#/actors")
        page.get_by_text(sweep_trial).first.wait_for(timeout=60_000)
        # Both trials, each an actor named after the sweep. On 2 busy cores the second trial's actor can start
        # seconds after the first; the list is read again (page reloaded) until both are there, for 2 minutes.
        t_actors = time.time()
        while page.get_by_text(sweep_trial).count() < 2 and time.time() - t_actors < 120:
            page.wait_for_timeout(3000)
            page.reload()
            page.get_by_text(sweep_trial).first.wait_for(timeout=60_000)
        page.wait_for_timeout(1500)
        shot(page, "ray_actors.png")
        assert page.get_by_text(sweep_trial).count() >= 2, page.inner_text("body")

        jobs = page.request.get(url + "/api/jobs/").json()
        job = next(j for j in jobs if j.get("type") == "DRIVER" and j.get("status") == "RUNNING")
        page.goto(f"{url}/#/jobs/{job['job_id']}")
        page.get_by_text("Ray Core Overview").first.wait_for(timeout=60_000)
        # The overview's progress bar unfolds into one row per task name (actor tasks under the actor's name).
        page.locator("[data-testid=progress-bar-segment]").first.click()
        for task in (sweep_trial, "prepare data parallel xx-yy", "prepare BERT nmtcore-tiny-bert",
                     "prepare BERT features nmtcore-tiny-bert", "train baseline "):
            page.get_by_text(task).first.wait_for(timeout=60_000)
        page.wait_for_timeout(1000)
        shot(page, "ray_job_tasks.png")
        ctx.close()
        t_browser = time.perf_counter() - t_trials
    finally:
        gate.touch()
        try:
            proc.wait(300)
        finally:
            stop(proc)
            reader.join(10)
            shutil.rmtree(temp, ignore_errors=True)
    out = "".join(lines)
    assert proc.returncode == 0, out
    # The console said what ran before the trials, with its progress.
    assert re.search(r"train baseline \w+: \[#+\.*\]\s+\d+% baseline \w+: epoch 1/2", out), out
    assert "prepare BERT " in out and "done in" in out
    # The trials' feature cache, made first, by its own task (the BERT's name carries its size: -L2-H48-V40).
    assert re.search(r"prepare BERT features nmtcore-tiny-bert\S*: done in \d+ s", out), out
    print(f"\nRay dashboard check: {time.perf_counter() - t0:.0f} s in all, browser {t_browser:.0f} s")
