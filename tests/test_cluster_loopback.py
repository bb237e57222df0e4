"""A real local Ray cluster, started as a sweep starts it (:func:`nmtcore.sweep.ray_backend.init_ray`), with
token authentication on as a user has it (the test suite turns it off elsewhere): every socket of every
process of the cluster listens on 127.0.0.1, and the dashboard's API refuses a request without the token
(401) or with a wrong one (403) and answers the right one. No browser; ~20 s.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from nmtcore.testing.sweeps import listening_sockets

REPO = Path(__file__).resolve().parents[1]
CLUSTER = """
import sys
from nmtcore.sweep import ray_backend
print("DASHBOARD", ray_backend.init_ray(num_cpus=1, dashboard=True, temp_dir=sys.argv[1], log_to_driver=False),
      flush=True)
sys.stdin.readline()
ray_backend.shutdown_ray()
"""
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


def status(url: str, token: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_local_cluster_listens_on_loopback_only_and_its_dashboard_wants_the_token(tmp_path):
    token_file = tmp_path / "ray_token"  # the cluster's own token: ~/.ray/auth_token is left alone
    token = secrets.token_hex(32)
    token_file.write_text(token)
    token_file.chmod(0o600)
    temp = tempfile.mkdtemp(prefix="rl-", dir="/tmp")  # short: Ray's socket paths are length-limited
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}  # conftest turns auth off; a user has it on
    env.update(RAY_AUTH_TOKEN_PATH=str(token_file), PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", CLUSTER, temp], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO, start_new_session=True)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("DASHBOARD "):
                break
        url = seen[-1].split()[1] if seen and seen[-1].startswith("DASHBOARD ") else ""
        assert url.startswith("http://127.0.0.1:"), "".join(seen)
        sockets = listening_sockets(proc.pid)
        port = int(url.rsplit(":", 1)[1])
        assert ("127.0.0.1", port) in sockets and len(sockets) >= 4, sockets  # the dashboard, the GCS, raylet...
        assert {ip for ip, _ in sockets} <= LOOPBACK, sorted(sockets)
        api = url + "/api/jobs/"
        assert status(api, None) == 401
        assert status(api, "0" * 64) == 403
        assert status(api, token) == 200
    finally:
        with contextlib.suppress(Exception):
            proc.stdin.write("\n")
            proc.stdin.flush()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        shutil.rmtree(temp, ignore_errors=True)
    assert proc.returncode == 0, "".join(seen) + (proc.stdout.read() if proc.stdout else "")
