"""The frozen-feature cache: each sentence's BERT hidden states computed once, read memory-mapped after.

The original BERT-fused code re-ran BERT on every step, so a BERT-enhanced epoch cost 20 minutes against
30 seconds for a plain Transformer (bert-nmt issue #18). While BERT is frozen its output is a pure function
of (weights, input), so :class:`FeatureCache` stores it on disk, fp16, for the layers the model needs:

    <root>/<digest>/features.npy   (n_tokens, K, H) float16, sentence i at rows offsets[i]:offsets[i+1]
    <root>/<digest>/offsets.npy    (N + 1,) int64
    <root>/<digest>/meta.json      the key, shapes, provenance; written last

``digest`` hashes a :class:`FeatureKey`: the SHA-256 of the BERT's weights as loaded, the SHA-256 of the
split's BERT token stream (so the corpus, the split, the length filter, the tokenizer, the max length and
the document context are all in it), the layer indices and the max length. Any change is a new digest,
i.e. a miss; the same key in another epoch, phase or trial of a sweep is a hit.

An entry is built under ``.tmp-<digest>-<pid>-*`` and renamed into place only once complete, so a run
killed mid-write leaves a temporary directory that is never read (and is removed by the next build once
its process is gone). Builders of the same key serialise on ``<digest>.lock``; the second one finds the
first one's entry. A present entry whose files do not match its ``meta.json`` is treated as a miss.
:meth:`FeatureCache.get_or_build_shared` writes several entries of one split from one pass: a BERT and its
bottom truncations (the size grid's L2 and L4 of one encoder), each under its own key. A key whose layers an
entry of the same BERT, inputs and maximum length holds among more is read from that entry (BERT-JAM's M2, which
reads the top layer, from the states M0 cached for every layer): no second pass, nothing written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from nmtcore.data import BertInputs
from nmtcore.files import atomic_directory, file_lock, fsync_path, remove_stale_temporaries

log = logging.getLogger("nmtcore.bert")

CACHE_FORMAT = 1  # bump when the meaning of stored files changes
BUILD_TOKENS = 8192  # padded WordPieces per BERT batch while building
PROGRESS_S = 15.0  # a build logs how far it is at most this often ("sentences 8000/29000")


def weights_fingerprint(module: nn.Module) -> str:
    """SHA-256 over a module's state dict (names, dtypes, shapes and bytes, in name order)."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def inputs_checksum(inputs: BertInputs) -> str:
    """SHA-256 of a split's BERT token stream (ids and segment ids, sentence by sentence)."""
    h = hashlib.sha256()
    h.update(inputs.lens.astype(np.int64).tobytes())
    if len(inputs):
        h.update(np.concatenate(inputs.ids).astype(np.int32).tobytes())
        h.update(np.concatenate(inputs.segments).astype(np.int8).tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class FeatureKey:
    """What cached features depend on (see the module docstring)."""

    bert: str  # weights fingerprint
    inputs: str  # token-stream checksum
    layers: tuple[int, ...]
    max_length: int

    def digest(self) -> str:
        blob = json.dumps({"format": CACHE_FORMAT, **asdict(self)}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:32]


class FeatureStore:
    """Memory-mapped features of one split (see the module docstring for the layout); ``index`` maps
    positions after :meth:`select` to rows of the stored split."""

    def __init__(self, features: np.ndarray, offsets: np.ndarray, layers: tuple[int, ...],
                 index: np.ndarray | None = None, path: Path | None = None,
                 picks: tuple[int, ...] | None = None) -> None:
        self.features, self.offsets, self.layers, self.index, self.path = features, offsets, layers, index, path
        # positions of ``layers`` among the stored ones (an entry that holds more layers: read as this subset)
        self.picks = picks
        self.build_s: float | None = None  # seconds this process spent computing it (None: read from the cache)

    def __len__(self) -> int:
        return len(self.index) if self.index is not None else len(self.offsets) - 1

    def rows(self, i: int) -> np.ndarray:
        """(len_i, K, H) float16 states of sentence ``i``."""
        r = int(self.index[i]) if self.index is not None else int(i)
        rows = self.features[self.offsets[r]: self.offsets[r + 1]]
        return rows if self.picks is None else rows[:, list(self.picks)]

    def gather(self, indices: np.ndarray, length: int) -> Tensor:
        """(B, length, K, H) float16 states of sentences ``indices``, right-padded with zeros."""
        H = self.features.shape[2]
        out = np.zeros((len(indices), length, len(self.layers), H), dtype=np.float16)
        for b, i in enumerate(indices):
            rows = self.rows(int(i))[:length]
            out[b, : len(rows)] = rows
        return torch.from_numpy(out)

    def select(self, indices: np.ndarray) -> "FeatureStore":
        idx = np.asarray(indices, dtype=np.int64)
        return FeatureStore(self.features, self.offsets, self.layers,
                            self.index[idx] if self.index is not None else idx, self.path, self.picks)


@dataclass(frozen=True)
class SharedEntry:
    """One entry of a shared build (:meth:`FeatureCache.get_or_build_shared`): its key, which of the pass's
    layers it keeps (positions in what ``compute`` returns) and what its meta.json says of it."""

    key: FeatureKey
    picks: tuple[int, ...]
    describe: Mapping[str, Any]


ComputeFn = Callable[[Tensor, Tensor, Tensor], Tensor]  # (ids, mask, segments) (B, T) → (B, T, K, H)


class FeatureCache:
    """Frozen BERT features on disk under ``root``, one directory per :class:`FeatureKey`."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def entry(self, key: FeatureKey) -> Path:
        return self.root / key.digest()

    def load(self, key: FeatureKey, n_sentences: int | None = None) -> FeatureStore | None:
        """The complete entry of ``key`` memory-mapped, else the layers of ``key`` read from a complete entry that
        holds them among more layers of the same BERT and inputs (BERT-JAM's M2 reads the top layer of the
        states M0 and M1 cached: the same pass's values), or None."""
        store = self._load(key, n_sentences)
        if store is not None:
            return store
        for other in self._wider(key):
            store = self._load(other, n_sentences)
            if store is not None:
                return FeatureStore(store.features, store.offsets, key.layers, path=store.path,
                                    picks=tuple(other.layers.index(layer) for layer in key.layers))
        return None

    def _wider(self, key: FeatureKey) -> list[FeatureKey]:
        """The keys of the entries under the root with ``key``'s BERT, inputs and maximum length and a superset of
        its layers, fewest layers first."""
        found = []
        for meta_path in self.root.glob("*/meta.json"):
            try:
                k = json.loads(meta_path.read_text(encoding="utf-8"))["key"]
                other = FeatureKey(bert=k["bert"], inputs=k["inputs"], layers=tuple(k["layers"]),
                                   max_length=int(k["max_length"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if (k.get("format") == CACHE_FORMAT and other != key
                    and (other.bert, other.inputs, other.max_length) == (key.bert, key.inputs, key.max_length)
                    and set(key.layers) <= set(other.layers)):
                found.append(other)
        return sorted(found, key=lambda o: (len(o.layers), o.digest()))

    def _load(self, key: FeatureKey, n_sentences: int | None = None) -> FeatureStore | None:
        """The complete entry of ``key`` memory-mapped, or None (absent, or not matching its meta.json)."""
        path = self.entry(key)
        try:
            meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
            if meta.get("key") != {"format": CACHE_FORMAT, **_plain(asdict(key))}:
                return None
            features = np.load(path / "features.npy", mmap_mode="r")
            offsets = np.load(path / "offsets.npy")
        except (OSError, ValueError, json.JSONDecodeError):
            return None
        shape = tuple(meta["shape"])
        if (features.shape != shape or features.dtype != np.float16 or len(offsets) != meta["sentences"] + 1
                or int(offsets[-1]) != shape[0] or (n_sentences is not None and meta["sentences"] != n_sentences)):
            return None
        return FeatureStore(features, offsets, tuple(meta["key"]["layers"]), path=path)

    def get_or_build(self, key: FeatureKey, inputs: BertInputs, compute: ComputeFn,
                     describe: Mapping[str, Any] | None = None, batch_tokens: int = BUILD_TOKENS) -> FeatureStore:
        """The features of ``inputs`` under ``key``: loaded if cached, else computed with ``compute`` (a
        frozen BERT in eval mode) and written atomically first."""
        entry = SharedEntry(key, tuple(range(len(key.layers))), describe or {})
        return self.get_or_build_shared([entry], inputs, compute, batch_tokens)[0]

    def get_or_build_shared(self, entries: Sequence[SharedEntry], inputs: BertInputs, compute: ComputeFn,
                            batch_tokens: int = BUILD_TOKENS) -> list[FeatureStore]:
        """Several entries over the same ``inputs`` from one pass of ``compute``: each loaded if cached, the
        missing ones computed together, entry j keeping the layers ``entries[j].picks`` of what ``compute``
        returns. One pass of a BERT thus serves its bottom truncations (their hidden states are its own).
        The missing entries' locks are taken in digest order, so two shared builds never wait on each other.
        Entries with one key (two streams that read the same features) share one store, built once."""
        first = {e.key: e for e in reversed(entries)}  # each key's first entry
        if len(first) < len(entries):
            distinct = [e for e in entries if first[e.key] is e]
            by_key = dict(zip((e.key for e in distinct),
                              self.get_or_build_shared(distinct, inputs, compute, batch_tokens)))
            return [by_key[e.key] for e in entries]
        stores: list[FeatureStore | None] = [self.load(e.key, len(inputs)) for e in entries]
        for e, store in zip(entries, stores):
            if store is not None:
                log.info("BERT features %s: cache hit (%s%s)", e.describe.get("split", ""),
                         "" if store.picks is None else f"layers {list(e.key.layers)} of ", store.path)
        missing = [j for j, s in enumerate(stores) if s is None]
        if not missing:
            return [s for s in stores if s is not None]
        digests = sorted({entries[j].key.digest() for j in missing})
        with contextlib.ExitStack() as locks:
            for digest in digests:  # one builder per key; the others wait, then load its entry
                locks.enter_context(file_lock(self.root / f"{digest}.lock"))
            for j in missing:
                stores[j] = self.load(entries[j].key, len(inputs))
            build = [j for j in missing if stores[j] is None]
            if build:
                for digest in digests:
                    for _ in range(remove_stale_temporaries(self.root, digest)):
                        log.info("removed a directory left by an interrupted feature-cache write under %s", self.root)
                t0 = time.perf_counter()
                # A present but unusable entry (see load) is replaced.
                with contextlib.ExitStack() as dirs:
                    tmps = [dirs.enter_context(atomic_directory(self.entry(entries[j].key), keep_existing=False))
                            for j in build]
                    _build(tmps, [entries[j] for j in build], inputs, compute, batch_tokens)
                build_s = time.perf_counter() - t0
                for j in build:
                    log.info("BERT features %s: computed %d sentences in %.1f s -> %s",
                             entries[j].describe.get("split", ""), len(inputs), build_s, self.entry(entries[j].key))
                    store = self.load(entries[j].key, len(inputs))
                    if store is None:  # pragma: no cover - would be a bug in _build
                        raise RuntimeError(f"feature cache entry {self.entry(entries[j].key)} unreadable right after "
                                           "writing it")
                    store.build_s = build_s
                    stores[j] = store
        return [s for s in stores if s is not None]


def _plain(d: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(d))  # tuples → lists, as meta.json stores them


def _build(tmps: Sequence[Path], entries: Sequence[SharedEntry], inputs: BertInputs, compute: ComputeFn,
           batch_tokens: int) -> None:
    lens = inputs.lens  # (N,)
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    n_tokens = int(offsets[-1])
    order = np.argsort(lens, kind="stable")  # length-sorted batches waste little padding
    features: list[np.ndarray] | None = None
    split = entries[0].describe.get("split", "")
    start = 0
    t_line = time.monotonic()
    while start < len(order):
        end = start + 1
        while end < len(order) and int(lens[order[end]]) * (end - start + 1) <= batch_tokens:
            end += 1
        idx = order[start:end]
        T = int(lens[idx].max())
        ids = np.full((len(idx), T), inputs.pad_id, dtype=np.int64)
        seg = np.zeros((len(idx), T), dtype=np.int64)
        for b, i in enumerate(idx):
            ids[b, : lens[i]] = inputs.ids[i]
            seg[b, : lens[i]] = inputs.segments[i]
        mask = np.arange(T)[None, :] >= lens[idx][:, None]  # (b, T) True = padding
        out = compute(torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(seg))  # (b, T, K, H)
        if features is None:
            features = []
            for tmp, e in zip(tmps, entries):
                if len(e.picks) != len(e.key.layers) or max(e.picks) >= out.shape[2]:
                    raise ValueError(f"compute returned {out.shape[2]} layers; an entry keeps positions {e.picks} "
                                     f"for its key's {len(e.key.layers)} layers")
                features.append(np.lib.format.open_memmap(tmp / "features.npy", mode="w+", dtype=np.float16,
                                                          shape=(n_tokens, len(e.picks), out.shape[3])))
        out16 = out.to(torch.float16).numpy()
        for e, feats in zip(entries, features):
            kept = out16[:, :, list(e.picks)]
            for b, i in enumerate(idx):
                feats[offsets[i]: offsets[i + 1]] = kept[b, : lens[i]]
        start = end
        if time.monotonic() - t_line >= PROGRESS_S and start < len(order):
            t_line = time.monotonic()
            log.info("BERT features %s: sentences %d/%d", split, start, len(order))
    if features is None:  # an empty split: nothing to compute, but the entries must still exist
        features = [np.lib.format.open_memmap(tmp / "features.npy", mode="w+", dtype=np.float16,
                                              shape=(0, len(e.key.layers), 0)) for tmp, e in zip(tmps, entries)]
    for tmp, e, feats in zip(tmps, entries, features):
        feats.flush()
        shape = list(feats.shape)
        np.save(tmp / "offsets.npy", offsets)
        for name in ("features.npy", "offsets.npy"):
            fsync_path(tmp / name)
        meta = {"key": {"format": CACHE_FORMAT, **_plain(asdict(e.key))}, "shape": shape, "sentences": len(lens),
                "dtype": "float16", "created": time.strftime("%Y-%m-%dT%H:%M:%S"), **dict(e.describe)}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
        fsync_path(tmp / "meta.json")
    del features
