"""CUDA graphs over a training update's forward and backward passes (``train.cuda_graphs``).

At the studies' size (3+3 layers, d 256, 4k-token batches) a GPU step is bound by the host: the GPU waits on
hundreds of kernel launches, each paid for by Python (``docs/performance.md``, GPUs). A CUDA graph records those
launches once and replays them with one. A graph
needs fixed shapes and fixed memory, so:

- **Buckets.** Every batch is padded to a bucket shape: rows up to a multiple of :data:`ROWS_MULTIPLE`, source
  and target length up to a multiple of :data:`LEN_MULTIPLE` (:func:`bucket_shape`). Extra positions are
  padding (pad ids, masked); extra rows copy row 0's inputs with a target of padding only, so they add
  nothing to the loss or the gradient and no attention row is all padding (:func:`pad_batch`). The padded cells
  cost GPU time a host-bound step has to spare; where the GPU is already busy, graphs can be slower. Padding is
  done on the host, in the trainer's prefetch thread.
- **One graph per bucket**, captured the first time a bucket is seen (two eager warm-up passes on a side
  stream, then the capture), each with its own input tensors, all in one memory pool. A graph's outputs are
  read right after its replay, so graphs replayed in any order may share the pool.
- **Gradients are static tensors** that the backward pass accumulates into (``zero_grad(set_to_none=False)``
  between updates): gradient accumulation over ``train.update_freq`` batches replays into the same buffers.
  The optimizer, clipping and the learning-rate schedule stay eager (a few fused kernels).

What it gains, and its check against eager steps (``bench/gpu.py --sections graphs``): ``docs/performance.md``.

Not bit-identical to eager training: the dropout masks differ (each capture's warm-up passes draw from the
generator), so a run resumed from a checkpoint, which captures its graphs again, does not repeat the
uninterrupted run's updates exactly as an eager run does. That is why it is off by default.

A forward that draws on the host (BERT-fused's drop-net) declares its draws (``NMTModel.graph_draws``): they are
drawn on the host before each batch, as an eager forward would draw them, and copied to a device tensor the
graph reads; the graph computes both branches and weighs them (:mod:`nmtcore.nn.drop_net`). The BERT stream of a
batch (its WordPiece ids, mask and cached features) is padded to a multiple of :data:`LEN_MULTIPLE` too.

What is not graphed runs eagerly as before, with the reason logged once (:func:`why_not`): a CPU, DDP,
``train.compile``, KD (``train.kd_alpha < 1``: its mask is a data-dependent gather), a model family not
declared capture-safe (``NMTModel.cuda_graph_safe``: its forward decides on the host in a way it does not plan,
or was not checked), more buckets than ``train.cuda_graph_max``, or a capture that fails.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from nmtcore.data import Batch

if TYPE_CHECKING:
    from nmtcore.config import ExperimentConfig
    from nmtcore.models import NMTModel
    from nmtcore.nn.drop_net import PlannedDraws

log = logging.getLogger("nmtcore.engine")

LEN_MULTIPLE = 8  # source and target lengths are padded up to a multiple of this
ROWS_MULTIPLE = 16  # and the number of rows
WARMUP_PASSES = 2  # eager passes on a side stream before a capture (lazy CUDA state: cuBLAS handles, workspaces)
# The BERT stream's tensors (nmtcore.data.batching.bert_extras) and what their new positions hold: masked padding.
BERT_STREAM_PAD = {"bert_ids": 0, "bert_mask": True, "bert_segments": 0, "bert_features": 0.0}


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def bucket_shape(batch: Batch) -> tuple[int, int, int]:
    """(rows, source length, target length) that ``batch`` is padded to."""
    b, s = batch.src.shape
    return round_up(b, ROWS_MULTIPLE), round_up(s, LEN_MULTIPLE), round_up(batch.tgt_in.size(1), LEN_MULTIPLE)


def pad_batch(batch: Batch, rows: int, src_len: int, tgt_len: int, pad_id: int) -> Batch:
    """``batch`` padded to ``rows`` sentences of ``src_len`` source and ``tgt_len`` target positions.

    New positions are padding (``pad_id``, mask True). New rows repeat row 0's inputs (source, target input,
    masks, extras) with a target output of ``pad_id`` only: the loss skips every one of their positions, so the
    loss and the gradient are the unpadded batch's, and no attention row sees only padding (an all-masked
    softmax row would be NaN). ``n_tgt_tokens`` stays the real count.
    """
    b, s = batch.src.shape
    t = batch.tgt_in.size(1)
    if rows < b or src_len < s or tgt_len < t:
        raise ValueError(f"pad_batch: cannot pad a ({b}, {s}, {t}) batch to ({rows}, {src_len}, {tgt_len})")
    n = batch.n_tgt_tokens
    if rows > b:
        idx = torch.cat([torch.arange(b), torch.zeros(rows - b, dtype=torch.long)]).to(batch.src.device)
        batch = batch.map(lambda x: x.index_select(0, idx))
        batch.tgt_out[b:] = pad_id

    def longer(x: Tensor, length: int, value) -> Tensor:
        if x.size(1) == length:
            return x
        if x.dim() > 2:  # (B, T, ...): F.pad pads the last dimensions first
            return torch.cat([x, x.new_full((x.size(0), length - x.size(1), *x.shape[2:]), value)], dim=1)
        return F.pad(x, (0, length - x.size(1)), value=value)

    extras = dict(batch.extras)
    if "bert_mask" in extras:  # the BERT stream: its length up to a multiple too, new positions padding
        tb = round_up(extras["bert_mask"].size(1), LEN_MULTIPLE)
        for name, value in BERT_STREAM_PAD.items():
            if name in extras:
                extras[name] = longer(extras[name], tb, value)
    if "bert_align" in extras:  # per source position: new positions get empty WordPiece spans
        extras["bert_align"] = longer(extras["bert_align"], src_len, 0)
    return Batch(src=longer(batch.src, src_len, pad_id), src_mask=longer(batch.src_mask, src_len, True),
                 tgt_in=longer(batch.tgt_in, tgt_len, pad_id), tgt_out=longer(batch.tgt_out, tgt_len, pad_id),
                 tgt_mask=longer(batch.tgt_mask, tgt_len, True), ids=batch.ids, extras=extras,
                 _n_tgt_tokens=n)


def pad_to_bucket(batch: Batch, pad_id: int) -> Batch:
    """``batch`` padded to its :func:`bucket_shape`."""
    return pad_batch(batch, *bucket_shape(batch), pad_id)


def why_not(cfg: "ExperimentConfig", model: "NMTModel", device: torch.device, world_size: int) -> str | None:
    """Why a training step of this run cannot be graphed (None: it can)."""
    if device.type != "cuda":
        return f"the device is {device.type}, not CUDA"
    if world_size > 1:
        return "DDP (several workers) is not graphed"
    if cfg.train.compile:
        return "train.compile is on"
    if cfg.train.kd_alpha < 1.0:
        return "KD (train.kd_alpha < 1) gathers its positions by a data-dependent mask"
    if not vars(type(model)).get("cuda_graph_safe", False):
        return (f"{type(model).__name__} is not declared capture-safe (its forward decides or draws on the host, "
                "or was not checked)")
    return None


def _key(batch: Batch) -> tuple:
    return (tuple(batch.src.shape), tuple(batch.tgt_in.shape),
            tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(batch.extras.items())))


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: Batch  # the tensors the graph reads; each replay copies a batch into them
    loss: Tensor  # what the graph writes: Σ loss, Σ nll
    nll: Tensor


@dataclass
class GraphStats:
    captures: int = 0
    capture_s: float = 0.0
    replays: int = 0
    eager: int = 0  # batches run eagerly (over train.cuda_graph_max buckets, or after a failed capture)
    failed: str = ""  # the first capture error; graphs are off from then on


class StepGraphs:
    """Replays a CUDA graph of ``forward_backward`` for every bucket shape (capturing it the first time).

    ``forward_backward(batch) -> (loss, nll)`` runs the forward pass under autocast (with its weight cache off:
    autocast's cached casts cannot outlive a capture), computes the summed losses and calls ``backward``;
    :meth:`run` returns its two losses for ``batch`` (already padded to its bucket, on the device), with the
    gradients accumulated into ``params``' ``.grad``.
    """

    def __init__(self, forward_backward: Callable[[Batch], tuple[Tensor, Tensor]], params: list[Tensor],
                 max_graphs: int, draws: "PlannedDraws | None" = None) -> None:
        self.forward_backward = forward_backward
        self.draws = draws  # the forward's host draws (drop-net), planned before each batch
        self.params = [p for p in params if p.requires_grad]
        self.max_graphs = max_graphs
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.stats = GraphStats()

    def ensure_grads(self) -> list[Tensor]:
        """The static gradient buffers, allocated (zero) where a parameter has none yet."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self.params]

    def run(self, batch: Batch) -> tuple[Tensor, Tensor]:
        if self.draws is not None:
            self.draws.plan()
        key = _key(batch)
        g = self.graphs.get(key)
        if g is None and not self.stats.failed and len(self.graphs) < self.max_graphs:
            g = self.capture(batch, key)
        if g is None:
            self.stats.eager += 1
            return self.forward_backward(batch)
        for dst, src in zip(g.inputs.tensors(), batch.tensors()):
            dst.copy_(src, non_blocking=True)
        g.graph.replay()
        self.stats.replays += 1
        return g.loss, g.nll

    def capture(self, batch: Batch, key: tuple) -> _Graph | None:
        t0 = time.perf_counter()
        grads = self.ensure_grads()
        saved = [x.clone() for x in grads]  # the warm-up passes accumulate; the update must not see them
        inputs = batch.map(Tensor.clone)
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_PASSES):
                    self._restart()
                    self.forward_backward(inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            self._restart()
            # thread_local: the prefetch thread may pin host memory (a CUDA call) while this thread captures.
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                loss, nll = self.forward_backward(inputs)
            if any(p.grad is not g for p, g in zip(self.params, grads)):
                # The backward must add into the buffers it found; one it replaced would be written, not added to,
                # at each replay (gradient accumulation silently lost).
                raise RuntimeError("the captured backward replaced a gradient tensor instead of adding into it")
        except RuntimeError as e:  # a host sync or an uncapturable op in the forward: eager from here on
            self.stats.failed = f"{type(e).__name__}: {e}".splitlines()[0]
            log.warning("CUDA graphs off for the rest of this run: capturing a %s batch failed (%s)",
                        "x".join(map(str, batch.src.shape)), self.stats.failed, exc_info=True)
            torch.cuda.synchronize()
            for p, g in zip(self.params, grads):
                p.grad = g
            torch._foreach_copy_(grads, saved)
            self._restart()  # the batch runs eagerly on the plan drawn for it
            return None
        torch._foreach_copy_(grads, saved)
        self._restart()
        g = _Graph(graph=graph, inputs=inputs, loss=loss, nll=nll)
        self.graphs[key] = g
        self.stats.captures += 1
        self.stats.capture_s += time.perf_counter() - t0
        if len(self.graphs) == self.max_graphs:
            log.info("CUDA graphs: %d buckets captured (train.cuda_graph_max); batches of other shapes run eagerly",
                     self.max_graphs)
        return g


    def _restart(self) -> None:
        if self.draws is not None:
            self.draws.restart()


__all__ = ["LEN_MULTIPLE", "ROWS_MULTIPLE", "GraphStats", "StepGraphs", "bucket_shape", "pad_batch", "pad_to_bucket",
           "why_not"]
