"""Joint subword vocabulary: one SentencePiece BPE model learned on the training text of both languages.

The model is trained with ``normalization_rule_name="identity"`` so no character is rewritten: for a line
whose whitespace is single spaces with no leading or trailing space (the form :mod:`nmtcore.data`
produces), ``decode(encode(line)) == line`` exactly, as long as every character of the line occurred in
the training text (``character_coverage=1.0`` keeps all of those). A character never seen in training
(an emoji, a rare script) is encoded as ``unk_id`` and decodes to SentencePiece's `` ⁇ `` (U+2047 with a
space on each side); the rest of the line still round-trips. We do not enable byte fallback: it would
spend 256 vocabulary entries on bytes that Multi30k-sized corpora never need.

Special ids are fixed for every vocabulary: pad=0, unk=1, bos=2, eos=3.

Trained models are cached under ``<cache_dir>/vocab/<key>/spm.model`` where ``<key>`` hashes the training
text, the vocabulary size and the training options, so the same data never retrains and a change of any
of them never reuses a stale model. The directory is written under a temporary name and renamed into
place, so a run killed mid-training never leaves a half vocabulary that a later run would pick up.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

import numpy as np
import sentencepiece as spm
import torch
from torch import Tensor

from nmtcore.files import atomic_directory, sha256_file

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

# Every option that changes the learned model; hashed into the cache key. Bump VOCAB_FORMAT when the
# meaning of a cached model changes without any of these options changing.
VOCAB_FORMAT = 1
TRAINER_OPTIONS: dict[str, object] = {
    "model_type": "bpe",
    "character_coverage": 1.0,
    "input_sentence_size": 0,  # 0 = learn from every line, not a sample
    "shuffle_input_sentence": False,
    "normalization_rule_name": "identity",  # no NFKC: detokenization must give back the exact text
    "max_sentence_length": 1 << 16,  # bytes; longer lines are skipped by the trainer
    "pad_id": PAD_ID,
    "unk_id": UNK_ID,
    "bos_id": BOS_ID,
    "eos_id": EOS_ID,
}


class VocabError(ValueError):
    """The vocabulary cannot be trained or loaded (one-line message saying what to change)."""


class SubwordVocab:
    """A loaded SentencePiece model with nmtcore's fixed special ids.

    Build one with :meth:`train_or_load` (training text + size, cached) or :meth:`load` (a model file).
    """

    pad_id: int = PAD_ID
    unk_id: int = UNK_ID
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID

    def __init__(self, blob: bytes, model_path: Path | None = None) -> None:
        """Wrap a serialized SentencePiece model; prefer :meth:`load`, :meth:`train_or_load` or
        :meth:`from_tensor_payload`. ``model_path`` is where it came from (None: from a checkpoint)."""
        self.model_path = model_path
        where = model_path or "vocabulary payload"
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.load_from_serialized_proto(blob)
        except RuntimeError:
            raise VocabError(f"{where} is not a SentencePiece model") from None
        specials = (self.sp.pad_id(), self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id())
        if specials != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise VocabError(
                f"{where}: special ids (pad, unk, bos, eos) are {specials}, nmtcore needs "
                f"{(PAD_ID, UNK_ID, BOS_ID, EOS_ID)}; retrain it with SubwordVocab.train_or_load"
            )
        self._blob = blob
        # Identifies the vocabulary itself (not how it was made): a checkpoint records it so it is never
        # decoded with another vocabulary.
        self.checksum: str = hashlib.sha256(blob).hexdigest()

    # ------------------------------------------------------------------ construction
    @classmethod
    def load(cls, path: str | os.PathLike) -> "SubwordVocab":
        """Load a SentencePiece model file (``spm.model``) trained with nmtcore's special ids."""
        model_path = Path(path).resolve()
        try:
            blob = model_path.read_bytes()
        except OSError as e:
            raise VocabError(f"cannot read SentencePiece model {model_path}: {e.strerror}") from None
        return cls(blob, model_path)

    def to_tensor_payload(self) -> dict[str, Tensor | str]:
        """The vocabulary as checkpoint content ``torch.load(weights_only=True)`` accepts:
        ``{"model": uint8 tensor of the serialized model, "checksum": str}``."""
        model = torch.from_numpy(np.frombuffer(self._blob, dtype=np.uint8).copy())  # (n_bytes,)
        return {"model": model, "checksum": self.checksum}

    @classmethod
    def from_tensor_payload(cls, payload: Mapping[str, Tensor | str]) -> "SubwordVocab":
        """Rebuild a vocabulary saved with :meth:`to_tensor_payload`; the checksum must match."""
        model = payload.get("model")
        if not isinstance(model, Tensor) or model.dtype != torch.uint8:
            raise VocabError("vocabulary payload has no uint8 'model' tensor")
        vocab = cls(model.cpu().numpy().tobytes())
        if vocab.checksum != payload["checksum"]:
            raise VocabError(f"vocabulary payload is corrupt: checksum {vocab.checksum[:12]}, "
                             f"expected {str(payload['checksum'])[:12]}")
        return vocab

    @classmethod
    def train_or_load(cls, texts: Sequence[Path], vocab_size: int, cache_dir: Path) -> "SubwordVocab":
        """Return the joint BPE vocabulary of ``texts``, training it only on a cache miss.

        ``texts`` are plain-text files, one sentence per line (the cleaned training split of both
        languages). The cache key is a SHA-256 of their contents, ``vocab_size`` and
        :data:`TRAINER_OPTIONS`; the model lands in ``cache_dir/vocab/<key>/spm.model``, written
        atomically. Raises :class:`VocabError` if ``vocab_size`` cannot be learned from the text (too
        large: SentencePiece runs out of merges; too small: fewer entries than distinct characters).
        We fail rather than use ``hard_vocab_limit=False``, so ``data.vocab_size`` always means the
        real size of the vocabulary.
        """
        key = training_key(texts, vocab_size)
        root = Path(cache_dir) / "vocab"
        final = root / key
        if (final / "spm.model").is_file():
            return cls.load(final / "spm.model")
        # A concurrent run that finishes the same vocabulary first wins; theirs is identical by construction.
        with atomic_directory(final) as tmp:
            _train(texts, vocab_size, tmp / "spm.model")
            meta = {"vocab_size": vocab_size, "format": VOCAB_FORMAT, "options": TRAINER_OPTIONS,
                    "sentencepiece": spm.__version__, "texts": [str(Path(t).resolve()) for t in texts]}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
        return cls.load(final / "spm.model")

    # ------------------------------------------------------------------ use
    def __len__(self) -> int:
        return self.sp.get_piece_size()

    def __repr__(self) -> str:
        return f"SubwordVocab(size={len(self)}, model_path={self.model_path}, checksum={self.checksum[:12]})"

    def encode(self, line: str) -> list[int]:
        """Subword ids of one line, without bos/eos."""
        return self.sp.encode(line, out_type=int)

    def encode_many(self, lines: Sequence[str]) -> list[np.ndarray]:
        """Subword ids of many lines (SentencePiece's multi-threaded batch API), one int32 array each,
        without bos/eos."""
        return [np.asarray(ids, dtype=np.int32) for ids in self.sp.encode(list(lines), out_type=int)]

    def pieces(self, line: str) -> list[str]:
        """Subword strings of one line (for inspection and logs)."""
        return self.sp.encode(line, out_type=str)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Text of a model output: everything from the first eos on is cut, pad and bos are dropped.

        Accepts a list, a numpy array or a 1-D tensor of ids. ``unk_id`` decodes to `` ⁇ ``.
        """
        return self.sp.decode(self._strip(ids))

    def decode_many(self, seqs: Iterable[Iterable[int] | np.ndarray]) -> list[str]:
        """:meth:`decode` of many sequences with the batch API."""
        return self.sp.decode([self._strip(s) for s in seqs])

    def _strip(self, ids: Iterable[int] | np.ndarray) -> list[int]:
        if hasattr(ids, "tolist"):  # numpy array or torch tensor
            ids = ids.tolist()
        out: list[int] = []
        for i in ids:
            i = int(i)
            if i == EOS_ID:
                break
            if i != PAD_ID and i != BOS_ID:
                out.append(i)
        return out


def training_key(texts: Sequence[Path], vocab_size: int) -> str:
    """Cache key of a vocabulary: SHA-256 of the text contents, the size and the trainer options.

    File names are not part of it: the same text under another name reuses the cached model.
    """
    h = hashlib.sha256()
    h.update(json.dumps({"format": VOCAB_FORMAT, "vocab_size": vocab_size, "options": TRAINER_OPTIONS},
                        sort_keys=True).encode())
    for t in texts:
        h.update(bytes.fromhex(sha256_file(t, memo=False)))  # per-file digests keep ("ab", "c") distinct from ("a", "bc")
    return h.hexdigest()[:32]


def _read_lines(texts: Sequence[Path]) -> Iterator[str]:
    for t in texts:
        with open(t, encoding="utf-8") as f:
            for line in f:
                yield line.rstrip("\n")


def _train(texts: Sequence[Path], vocab_size: int, model_file: Path) -> None:
    """Run the SentencePiece trainer, write ``model_file`` and a readable ``.vocab`` beside it (piece, score);
    turn the trainer's multi-line C++ errors into one-line VocabErrors.

    The model is written from memory (``model_writer``), not through ``model_prefix``: the trainer records its
    options in the model, and a prefix (here a temporary directory under the cache, with a process id and a
    random suffix) made every build's bytes, and so the vocabulary's checksum, differ for the same pieces."""
    # A sentence iterator instead of ``input=a,b``: file names with commas would be split by the trainer.
    buffer = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_read_lines(texts),
            model_writer=buffer,
            vocab_size=vocab_size,
            minloglevel=2,  # the trainer logs hundreds of lines to stderr otherwise
            **TRAINER_OPTIONS,
        )
    except RuntimeError as e:
        msg = str(e)
        if m := re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", msg):
            raise VocabError(
                f"data.vocab_size={m[1]} is too large for this training text: SentencePiece BPE can learn "
                f"at most {m[2]} pieces from it; lower data.vocab_size"
            ) from None
        if m := re.search(r"smaller than required_chars\. (\d+) vs (\d+)", msg):
            raise VocabError(
                f"data.vocab_size={m[1]} is too small: every distinct character of the training text plus "
                f"the 4 special ids needs an entry, so it must be >= {m[2]}"
            ) from None
        raise VocabError(f"SentencePiece training failed: {msg.splitlines()[-1] if msg else e!r}") from None
    blob = buffer.getvalue()
    model_file.write_bytes(blob)
    sp = spm.SentencePieceProcessor()
    sp.load_from_serialized_proto(blob)
    lines = (f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))
    model_file.with_suffix(".vocab").write_text("".join(lines), encoding="utf-8")
