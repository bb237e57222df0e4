"""Bottom-k truncations of a pretrained encoder: the L axis of the size grid with real knowledge.

``minilm:L2`` is all-MiniLM-L6-v2 with only its embeddings and its first two layers: the tensors are copied
byte for byte from the source's ``model.safetensors`` (``embeddings.*``, ``encoder.layer.{i}.*`` for
``i < k``, and what every layer shares, e.g. MPNet's ``encoder.relative_attention_bias``), the config says
``num_hidden_layers = k``, and the tokenizer files are copied. The truncated model's hidden states 0..k are
therefore exactly the source's (the tests check ``torch.equal``). The legacy ``embeddings.position_ids``
buffer and the pooler (trained on the source's top layer; no fusion reads it) are left out.

The result lives in the cache, keyed by the source's weights checksum::

    <cache_dir>/bert/truncated/<source>/L<k>/<source weights sha256[:16]>/

with ``meta.json``: source name and path, source weights SHA-256, k, the kept tensors, the output's SHA-256.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from pathlib import Path

from nmtcore.bert.errors import BertError
from nmtcore.files import build_directory_once, sha256_file

log = logging.getLogger("nmtcore.bert")

FORMAT = 1  # bump when the files written change for the same source and k
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                   "sentencepiece.bpe.model")
_LAYER_RE = re.compile(r"^(?:[\w.]*\.)?encoder\.layer\.(\d+)\.")
_DROP = ("embeddings.position_ids", "pooler.")
BASE_CLASSES = {"bert": "BertModel", "mpnet": "MPNetModel", "roberta": "RobertaModel", "xlm-roberta": "XLMRobertaModel"}


def slug(name: str) -> str:
    """A file-system-safe form of a BERT name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "bert"


def kept_tensors(names: list[str], k: int) -> list[str]:
    """The tensors of a bottom-k truncation: everything but layers >= k, the pooler and position_ids."""
    kept = []
    for name in names:
        if any(name.startswith(d) or f".{d}" in name for d in _DROP):
            continue
        m = _LAYER_RE.match(name)
        if m and int(m[1]) >= k:
            continue
        kept.append(name)
    return kept


def truncated_dir(cache_dir: Path, source: str, k: int, source_dir: Path) -> Path:
    """Where the bottom-``k`` truncation of ``source`` is kept (see the module docstring)."""
    return Path(cache_dir) / "bert" / "truncated" / slug(source) / f"L{k}" / sha256_file(source_dir / "model.safetensors")[:16]


def truncate(source: str, source_dir: Path, k: int, cache_dir: Path) -> Path:
    """The bottom-``k`` truncation of the encoder in ``source_dir`` (named ``source``), built once.

    Raises :class:`BertError` if the source has no ``model.safetensors`` or fewer than ``k`` layers.
    """
    source_dir = Path(source_dir)
    weights = source_dir / "model.safetensors"
    if not weights.is_file():
        raise BertError(f"cannot truncate BERT {source}: {source_dir} has no model.safetensors")
    config = json.loads((source_dir / "config.json").read_text(encoding="utf-8"))
    n_layers = int(config.get("num_hidden_layers", 0))
    if not 1 <= k <= n_layers:
        raise BertError(f"BERT {source}:L{k}: {source} has {n_layers} layers, so k must be in 1..{n_layers}")
    final = truncated_dir(cache_dir, source, k, source_dir)
    started: list[float] = []

    def write(tmp: Path) -> None:
        started.append(time.perf_counter())
        _write(source, source_dir, config, k, n_layers, tmp)

    if build_directory_once(final, write):
        log.info("BERT %s:L%d: bottom %d of %d layers copied in %.1f s -> %s", source, k, k, n_layers,
                 time.perf_counter() - started[0], final)
    return final


def _write(source: str, source_dir: Path, config: dict, k: int, n_layers: int, out: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    weights = source_dir / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        names = kept_tensors(list(f.keys()), k)
        tensors = {name: f.get_tensor(name).contiguous() for name in names}
        metadata = f.metadata() or {"format": "pt"}
    save_file(tensors, str(out / "model.safetensors"), metadata=metadata)
    new_config = {**config, "num_hidden_layers": k}
    base_class = BASE_CLASSES.get(config.get("model_type", ""))
    if base_class:  # the bare encoder: the source's pretraining heads are not copied
        new_config["architectures"] = [base_class]
    (out / "config.json").write_text(json.dumps(new_config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for name in TOKENIZER_FILES:
        if (source_dir / name).is_file():
            shutil.copyfile(source_dir / name, out / name)
    meta = {"kind": "truncated", "format": FORMAT, "name": f"{source}:L{k}", "source": source,
            "source_dir": str(source_dir), "source_weights_sha256": sha256_file(weights),
            "source_layers": n_layers, "k": k, "tensors": names,
            "weights_sha256": sha256_file(out / "model.safetensors", memo=False),
            "left_out": "layers >= k, the pooler (trained on the source's top layer), embeddings.position_ids"}
    source_meta = source_dir / "meta.json"
    if source_meta.is_file():
        meta["source_meta"] = {key: value for key, value in json.loads(source_meta.read_text(encoding="utf-8")).items()
                               if key in ("kind", "name", "source", "licence", "weights_sha256")}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
