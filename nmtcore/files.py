"""File primitives every stage shares: content hashes, atomic writes, directories built aside and
renamed into place, and an inter-process lock.

The rule they enforce: a file or cache directory another run may trust is either absent or whole.
Writers work under a temporary name in the destination's own directory (same filesystem, so the final
``os.replace`` is atomic), fsync, then rename; a writer killed midway leaves a dot-named temporary that no
reader looks at.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

_SHA256_MEMO: dict[tuple[str, int, int], str] = {}


def sha256_file(path: str | os.PathLike, memo: bool = True) -> str:
    """SHA-256 of a file's bytes; memoised on (path, size, mtime) so re-checking an unchanged file is free."""
    p = Path(path)
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if memo and key in _SHA256_MEMO:
        return _SHA256_MEMO[key]
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    if memo:
        _SHA256_MEMO[key] = digest
    return digest


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or directory (directories: best effort, some filesystems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - unreadable directory
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - e.g. a directory on a filesystem without directory fsync
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on a clean exit it is fsync'ed and renamed to ``path``,
    on an exception it is removed. The caller writes the temporary path however it likes."""
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=suffix)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)  # no-op once renamed


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """UTF-8 :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike, keep_existing: bool = True) -> Iterator[Path]:
    """Build a directory aside and rename it to ``final`` on a clean exit.

    Yields a fresh temporary directory next to ``final`` (``.tmp-<name>-<pid>-*``). If ``final`` appears
    meanwhile (a concurrent builder of the same content won the race) and ``keep_existing`` is true, the
    existing one is kept and ours dropped; with ``keep_existing=False`` ours replaces it. On an exception
    the temporary directory is removed and nothing is renamed.
    """
    dest = Path(final)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{dest.name}-{os.getpid()}-", dir=dest.parent))
    try:
        yield tmp
        if dest.exists() and not keep_existing:
            shutil.rmtree(dest)
        try:
            os.replace(tmp, dest)
        except OSError:  # renaming onto a non-empty directory fails: somebody else finished first
            if not dest.is_dir():
                raise
        fsync_path(dest.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op once renamed


def build_directory_once(final: str | os.PathLike, make: Callable[[Path], object], marker: str = "meta.json",
                         force: bool = False) -> bool:
    """Make the cache directory ``final`` once: ``make(tmp)`` fills a temporary directory (it must write
    ``marker`` last) that :func:`atomic_directory` renames into place. Returns False without building when
    ``final/marker`` exists, checked before and again under the lock ``<final>.lock`` (a concurrent builder
    of the same directory waits, then reuses what the first made); ``force`` rebuilds and replaces it."""
    dest = Path(final)
    if not force and (dest / marker).is_file():
        return False
    with file_lock(dest.parent / f"{dest.name}.lock"):
        if not force and (dest / marker).is_file():
            return False
        with atomic_directory(dest, keep_existing=not force) as tmp:
            make(tmp)
    return True


def finished_directories(parent: str | os.PathLike, marker: str = "meta.json") -> list[Path]:
    """The directories under ``parent`` that :func:`build_directory_once` finished (they hold ``marker``;
    temporaries and locks are passed over), sorted by name."""
    return sorted(d for d in Path(parent).glob("*") if d.is_dir() and not d.name.startswith(".") and (d / marker).is_file())


def remove_stale_temporaries(parent: str | os.PathLike, name: str) -> int:
    """Delete ``.tmp-<name>-<pid>-*`` directories under ``parent`` whose writer process is gone."""
    removed = 0
    for tmp in Path(parent).glob(f".tmp-{name}-*"):
        try:
            pid = int(tmp.name[len(f".tmp-{name}-"):].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and _alive(pid):
            continue
        shutil.rmtree(tmp, ignore_errors=True)
        removed += 1
    return removed


@contextlib.contextmanager
def file_lock(path: str | os.PathLike) -> Iterator[None]:
    """An exclusive inter-process lock on ``path`` (created if missing) for the duration of the block."""
    lock_path = Path(path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
