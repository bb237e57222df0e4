"""A trial's memory, estimated from its config before it runs, so that a sweep packs trials by memory as well
as by CPUs (:func:`nmtcore.sweep.ray_backend.trials_that_fit`) and Ray reserves it for the trial's workers:
on a small machine a sweep then runs fewer trials at once instead of running out of memory.

The estimate adds four parts, each from the config alone (and, for a BERT, its files on disk):

- ``process``: a Train worker's interpreter with torch, Ray and nmtcore imported and the prepared data;
- ``weights``: the NMT parameters in fp32 with, for the trainable ones, their gradients and Adam's two
  moments (16 bytes a parameter), plus the BERT's weights (fp32; ×4 while it is fine-tuned);
- ``activations``: what one batch of ``data.max_tokens`` padded tokens keeps for the backward pass in every
  encoder and decoder layer (widths counted per layer below), the BERT-attention branches, a fine-tuned
  BERT's own layers, and the output layer's (tokens × vocabulary) logits and log-probabilities. The budget
  counts NMT tokens only (a BERT arm trains on its control's batches), so a batch's BERT stream can hold more
  padded WordPieces than ``data.max_tokens``: its parts are scaled by ``BERT_STREAM_*`` (the largest ratio
  measured on Multi30k's training batches, rounded up, and more per context sentence), except where the stream
  is the model's source and counted in the budget (``NMTModel.source_is_bert_stream``);
- nothing for the frozen-feature cache: it is memory-mapped, file-backed and reclaimable.

The constants were fitted to peak RSS measured on 2026-11-24 (2-core Xeon, fp32; see ``tests/test_memory.py``
for the bounds they are held to) and err on the high side: an estimate that is too low is the failure that
matters (a trial killed for memory), one too high only runs trials one at a time sooner.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from nmtcore.config import ExperimentConfig
from nmtcore.models import model_class

GIB = 1024**3
MIB = 1024**2
PROCESS_BYTES = 650 * MIB  # measured: python + torch + ray + nmtcore imported, Multi30k prepared (~600 MiB)
FLOAT = 4  # activations are counted in fp32 (bf16 autocast keeps fp32 copies of many of them)
# Floats one token keeps for the backward pass, per layer, in units of d_model and ffn_dim: attention input,
# q/k/v, attention output, projections, residual sums, layer-norm outputs, dropout masks (encoder), plus a
# second attention block (decoder); the FFN keeps its input, fc1 output, ReLU output and mask.
ENCODER_FLOATS = (14, 3)  # (× d_model, × ffn_dim)
DECODER_FLOATS = (22, 3)
BERT_ATTENTION_FLOATS = 8  # × d_model per NMT layer that attends to BERT (projections of BERT's states too)
BERT_LAYER_FLOATS = (14, 3)  # a fine-tuned BERT layer, (× hidden, × intermediate), per WordPiece
LOGIT_COPIES = 2  # the logits and the loss's log-probabilities (its gradient is written in place)
# Padded WordPieces of a batch's BERT stream per unit of the NMT budget, at most: measured over Multi30k's training
# batches (multi30k_small, MiniLM's WordPieces) 1.47 for the sentence alone, 2.11 with the previous sentence as
# context ([CLS] context [SEP] sentence [SEP]: the document model, model.bert.context=previous). Each context
# sentence is counted at what the first one added (not measured beyond one).
BERT_STREAM_SENTENCE, BERT_STREAM_PER_CONTEXT = 1.5, 0.7


@dataclass(frozen=True)
class BertFootprint:
    """What a BERT adds to a trial's memory: its weights on disk (fp32) and its shape."""

    weight_bytes: int
    layers: int
    hidden: int
    intermediate: int

    @classmethod
    def of_directory(cls, path: str | Path) -> "BertFootprint":
        """Read a BERT directory: the size of its weight files and its ``config.json``."""
        path = Path(path)
        conf = json.loads((path / "config.json").read_text(encoding="utf-8"))
        weights = sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin", "*.pt")
                      for f in path.glob(pattern) if f.is_file())
        hidden = int(conf.get("hidden_size", 0))
        return cls(weight_bytes=weights, layers=int(conf.get("num_hidden_layers", 0)), hidden=hidden,
                   intermediate=int(conf.get("intermediate_size", 4 * hidden)))


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one trial worker is expected to need at its peak, by part."""

    process: int
    weights: int
    activations: int

    @property
    def total(self) -> int:
        return self.process + self.weights + self.activations

    def describe(self) -> str:
        return (f"{self.total / GIB:.2f} GiB (process {self.process / GIB:.2f}, weights and optimizer "
                f"{self.weights / GIB:.2f}, activations {self.activations / GIB:.2f})")


def nmt_parameters(cfg: ExperimentConfig) -> int:
    """The Transformer's parameter count from its config (embeddings shared as configured, biases and layer
    norms included); BERT-attention branches are counted by :func:`trial_memory`."""
    m = cfg.model
    d, f, vocab = m.d_model, m.ffn_dim, cfg.data.vocab_size
    attention = 4 * d * d + 4 * d  # q, k, v, out with biases
    ffn = 2 * d * f + f + d
    norm = 2 * d
    encoder = m.encoder_layers * (attention + ffn + 2 * norm)
    decoder = m.decoder_layers * (2 * attention + ffn + 3 * norm)
    embeddings = vocab * d * (1 if m.share_embeddings else 2)
    return embeddings + encoder + decoder + (2 * norm if m.pre_norm else 0)


def trial_memory(cfg: ExperimentConfig, bert: BertFootprint | None = None) -> MemoryEstimate:
    """The peak memory of one trial worker training ``cfg`` (see the module docstring for the parts).
    ``bert``: the footprint of the trial's BERT when its model reads one (``model.bert`` enabled)."""
    m, tokens = cfg.model, cfg.data.max_tokens
    d, f = m.d_model, m.ffn_dim
    params = nmt_parameters(cfg)
    acts = tokens * FLOAT * (m.encoder_layers * (ENCODER_FLOATS[0] * d + ENCODER_FLOATS[1] * f)
                             + m.decoder_layers * (DECODER_FLOATS[0] * d + DECODER_FLOATS[1] * f))
    acts += LOGIT_COPIES * tokens * cfg.data.vocab_size * FLOAT
    bert_weights = 0
    cls = model_class(m)
    traits = cls.memory_traits(cfg)  # what the model declares: how many BERTs, its stream's context, fine-tuning
    if bert is not None and traits.berts:
        if cls.source_is_bert_stream:  # the budget counts the stream (PLM-sponsored's source)
            wordpieces = tokens
        else:  # a batch's BERT stream, sized by its NMT tokens, with the context sentences the model declares
            wordpieces = int(tokens * (BERT_STREAM_SENTENCE + BERT_STREAM_PER_CONTEXT * traits.context_sentences))
        fused = m.encoder_layers + m.decoder_layers  # an upper bound: every NMT layer attends to BERT
        params += fused * (2 * d * d + 2 * d * bert.hidden + 4 * d)
        acts += wordpieces * FLOAT * fused * BERT_ATTENTION_FLOATS * d
        # A second, fine-tuned BERT (PLM-sponsored's target side) is counted at the source BERT's size.
        bert_weights = traits.berts * bert.weight_bytes * (4 if traits.bert_fine_tuned else 1)
        if traits.bert_fine_tuned:
            acts += traits.berts * wordpieces * FLOAT * bert.layers * (BERT_LAYER_FLOATS[0] * bert.hidden
                                                                        + BERT_LAYER_FLOATS[1] * bert.intermediate)
    return MemoryEstimate(process=PROCESS_BYTES, weights=params * 16 + bert_weights, activations=acts)

