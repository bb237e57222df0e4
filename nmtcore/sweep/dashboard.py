"""How a user reaches a sweep's Ray dashboard: where it listens and how to sign in (Ray's token
authentication, on by default for a cluster ``ray.init`` starts; ``RAY_AUTH_MODE=disabled`` turns it off). The
token is never printed: consoles end up in logs and issues. No Ray import: the dashboard is asked over HTTP.
"""

from __future__ import annotations

import contextlib
import json
import os
import urllib.request
from pathlib import Path


def token_source() -> tuple[str, Path | None]:
    """Where Ray takes its auth token from, as Ray looks (``$RAY_AUTH_TOKEN``, the file in
    ``$RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``): (a phrase for people, the file or None)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "$RAY_AUTH_TOKEN of the sweep's environment", None
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        path = Path(os.environ["RAY_AUTH_TOKEN_PATH"]).expanduser()
        return f"the file {path} ($RAY_AUTH_TOKEN_PATH)", path
    path = Path.home() / ".ray" / "auth_token"
    return f"the file {path}", path


def private_token_file() -> None:
    """Ray writes a token it generates world-readable (0644); the token opens the dashboard, so 0600."""
    if os.environ.get("RAY_AUTH_MODE") == "disabled":
        return
    _, path = token_source()
    with contextlib.suppress(OSError):
        if path is not None and path.is_file() and path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o077:
            path.chmod(0o600)


def dashboard_auth_mode(url: str, timeout_s: float = 3.0) -> str:
    """``token`` or ``disabled`` as the dashboard at ``url`` says (its public ``/api/authentication_mode``),
    or ``unknown``."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/api/authentication_mode", timeout=timeout_s) as r:
            return str(json.loads(r.read()).get("authentication_mode", "unknown"))
    except Exception:
        return "unknown"


def dashboard_access(url: str | None, local: bool) -> list[str]:
    """Lines telling a user how to open the Ray dashboard at ``url``: where it listens and how to sign in
    (the command and the token's file; never the token itself)."""
    if not url:
        return ["Ray dashboard:   (not started)"]
    where = "local cluster, every Ray port on 127.0.0.1 only" if local else "the joined cluster's"
    lines = [f"Ray dashboard:   {url}  ({where})"]
    mode = dashboard_auth_mode(url)
    source, _ = token_source()
    if mode == "token":
        lines += ["  sign in once:  the dashboard asks for Ray's auth token: paste what `ray get-auth-token` prints",
                  f"                 (run where the sweep runs; the token is {source}); the browser keeps it 30 days"]
    elif mode == "disabled":
        lines.append("  no sign-in:    token auth is off (RAY_AUTH_MODE=disabled): anyone who reaches "
                     f"{url.split('://', 1)[-1]} can use it" + (" (this machine only)" if local else ""))
    else:
        lines.append(f"  sign in:       if asked for a token, paste what `ray get-auth-token` prints ({source})")
    return lines
