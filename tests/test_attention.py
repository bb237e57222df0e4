"""``nmtcore.nn.layers.attend``: the explicit CPU path (two matmuls, fp32 softmax) computes what SDPA computes; CUDA
attention leaves cuDNN out."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nmtcore.nn.cache import LayerCache
from nmtcore.nn.layers import attend


def _qkv(b: int, t_q: int, t_k: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(t_q * 100 + t_k)
    return tuple(torch.randn(b, 4, t, 16, generator=g).to(dtype).requires_grad_() for t in (t_q, t_k, t_k))


def _padding_mask(b: int, t_k: int) -> torch.Tensor:
    mask = torch.ones(b, 1, 1, t_k, dtype=torch.bool)  # True = may attend
    mask[0, ..., t_k - 3 :] = False
    return mask


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("t", [1, 9, 40])
def test_the_cpu_path_equals_sdpa_in_value_and_gradient(dtype: torch.dtype, tol: float, causal: bool, t: int) -> None:
    t_k = t if causal else t + 5  # causal: self-attention; else a memory of other length with padded keys
    q, k, v = _qkv(3, t, t_k, dtype)
    mask = None if causal else _padding_mask(3, t_k)
    got = attend(q, k, v, mask, causal, 0.0)
    grads = torch.autograd.grad(got.float().square().sum(), (q, k, v))
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, is_causal=causal)
    want_grads = torch.autograd.grad(want.square().sum(), (qd, kd, vd))
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol * max(1.0, w.abs().max().item()))


def test_causal_queries_of_an_incremental_step_see_the_whole_prefix() -> None:
    # Two new positions after a prefix of 5: query i sees keys 0 … 5 + i (the last query the last key),
    # exactly the last two rows of full causal attention over all 7 positions.
    q, k, v = _qkv(2, 7, 7, torch.float32)
    full = attend(q, k, v, None, True, 0.0)
    step = attend(q[:, :, 5:], k, v, None, True, 0.0)
    torch.testing.assert_close(step, full[:, :, 5:])
    assert not torch.allclose(step[:, :, 0], attend(q[:, :, 5:6], k, v, None, False, 0.0)[:, :, 0])


def test_attention_dropout_zeroes_probabilities_and_keeps_the_expectation() -> None:
    torch.manual_seed(0)
    q, k, v = (x.detach() for x in _qkv(64, 8, 8, torch.float32))
    v = torch.ones_like(v)  # every output = Σ of the kept probabilities (1 without dropout)
    out = attend(q, k, v, None, False, 0.25)[..., 0]  # (B, H, Tq)
    assert out.mean().item() == pytest.approx(1.0, abs=0.02)
    assert (out - 1.0).abs().max() > 0.1  # some probabilities were dropped, others scaled by 4/3
    torch.testing.assert_close(attend(q, k, v, None, False, 0.0)[..., 0], torch.ones_like(out))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("t_q,t_mem", [(1, 7), (6, 7), (6, 70)])  # a step (per part); training; fp32: SDPA
def test_attention_over_parts_equals_attention_over_their_concatenation(
    dtype: torch.dtype, tol: float, t_q: int, t_mem: int
) -> None:
    """``attend_parts`` (BERT-JAM's joint attention, the coordinator's r_all) is ``attend`` over the concatenated
    keys, values and masks, in value and gradient, with a padded memory, a causal part and an unmasked part."""
    from nmtcore.nn.layers import attend_parts, causal_mask

    g = torch.Generator().manual_seed(t_q * 1000 + t_mem)
    b, h, dh = 3, 4, 16

    def rand(t: int) -> torch.Tensor:
        return torch.randn(b, h, t, dh, generator=g).to(dtype).requires_grad_()

    q = rand(t_q)
    k_m, v_m, k_c, v_c, k_f, v_f = rand(t_mem), rand(t_mem), rand(t_q), rand(t_q), rand(5), rand(5)
    pad = torch.ones(b, 1, 1, t_mem, dtype=torch.bool)
    pad[1, ..., t_mem - 2:] = False  # sentence 1: its last two memory positions are padding
    causal = causal_mask(t_q, t_q, "cpu")  # (Tq, Tq)
    got = attend_parts(q, [(k_m, v_m, pad), (k_c, v_c, causal), (k_f, v_f, None)], 0.0)
    inputs = (q, k_m, v_m, k_c, v_c, k_f, v_f)
    grads = torch.autograd.grad(got.float().square().sum(), inputs)

    mask = torch.cat([pad.expand(b, 1, t_q, t_mem), causal.expand(b, 1, t_q, t_q),
                      torch.ones(b, 1, t_q, 5, dtype=torch.bool)], dim=-1)
    want = attend(q, torch.cat([k_m, k_c, k_f], dim=2), torch.cat([v_m, v_c, v_f], dim=2), mask, False, 0.0)
    want_grads = torch.autograd.grad(want.float().square().sum(), inputs)
    assert got.dtype == dtype and got.shape == (b, h, t_q, dh)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    for gi, wi in zip(grads, want_grads):
        torch.testing.assert_close(gi.float(), wi.float(), rtol=tol, atol=tol * max(1.0, wi.abs().max().item()))
    # The padding is really masked: moving a padded key of sentence 1 changes nothing there, a real one does.
    k_moved = k_m.detach().clone()
    k_moved[1, :, t_mem - 1] += 5.0
    moved = attend_parts(q, [(k_moved, v_m, pad), (k_c, v_c, causal), (k_f, v_f, None)], 0.0)
    torch.testing.assert_close(moved, got)
    k_moved[1, :, 0] += 5.0
    assert not torch.allclose(attend_parts(q, [(k_moved, v_m, pad), (k_c, v_c, causal), (k_f, v_f, None)], 0.0), got)


@pytest.mark.parametrize("env, kept", [("", False), ("1", True)])
def test_cuda_attention_leaves_out_cudnn_unless_asked(monkeypatch, env, kept):
    """cuDNN's SDPA builds a plan per new shape (every batch and beam step here): taken out once per process,
    unless NMTCORE_CUDNN_SDPA=1."""
    from nmtcore import devices

    before = torch.backends.cuda.cudnn_sdp_enabled()
    monkeypatch.setenv("NMTCORE_CUDNN_SDPA", env)
    monkeypatch.setattr(devices, "_CUDNN_SDPA_CHECKED", False)
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        devices.shape_free_cuda_attention()
        assert torch.backends.cuda.cudnn_sdp_enabled() is kept
        torch.backends.cuda.enable_cudnn_sdp(True)
        devices.shape_free_cuda_attention()  # once per process: a second call changes nothing
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.parametrize("grad", [False, True])
def test_layer_cache_grows_and_reorders_like_concatenation(grad: bool) -> None:
    """In-place buffers (no autograd) or concatenation (autograd): the prefix a step reads is the concatenation
    of every step's keys/values, rows reordered, dropped and duplicated as the search asks, past the buffers'
    first capacity (16 steps)."""
    g = torch.Generator().manual_seed(0)
    cache, ref_k, ref_v = LayerCache(), None, None
    rows = 6
    with torch.set_grad_enabled(grad):
        for step in range(40):
            k, v = (torch.randn(rows, 2, 1 + (step == 5), 8, generator=g).requires_grad_(grad) for _ in range(2))
            got_k, got_v = cache.grow(k, v)
            ref_k = k if ref_k is None else torch.cat([ref_k, k], dim=2)
            ref_v = v if ref_v is None else torch.cat([ref_v, v], dim=2)
            assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)
            assert got_k.requires_grad == grad
            if step % 3 == 2:  # drop one row, duplicate another
                index = torch.cat([torch.randperm(rows, generator=g)[1:], torch.tensor([0])])
            else:  # beams permuted within the same rows
                index = torch.randperm(rows, generator=g)
            cache.select_rows(index)
            ref_k, ref_v = ref_k.index_select(0, index), ref_v.index_select(0, index)
            assert torch.equal(cache.self_k, ref_k) and torch.equal(cache.self_v, ref_v)
    if grad:  # gradients reach every step's keys
        cache.self_k.sum().backward()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("t_q,t_mem", [(1, 7), (1, 90), (3, 70)])  # decoding steps; fp32 at 3 × 70 → SDPA
@pytest.mark.parametrize("beams", [1, 3])
def test_beams_sharing_a_memory_row_attend_as_if_it_were_copied(
    dtype: torch.dtype, tol: float, t_q: int, t_mem: int, beams: int
) -> None:
    """Beam search keeps a fixed memory's keys/values once per sentence (n rows) for n·beams query rows: ``attend``
    and ``attend_parts`` give what they give over the memory copied to every beam (``repeat_interleave``), with
    a padded memory row, beside a part with a row per beam; and a row count that is no multiple is refused."""
    from nmtcore.nn.layers import attend_parts

    g = torch.Generator().manual_seed(t_q * 1000 + t_mem + beams)
    n, h, dh = 2, 4, 16

    def rand(rows: int, t: int) -> torch.Tensor:
        return torch.randn(rows, h, t, dh, generator=g).to(dtype)

    q, k, v = rand(n * beams, t_q), rand(n, t_mem), rand(n, t_mem)
    k_r, v_r = rand(n * beams, 4), rand(n * beams, 4)  # a per-beam part (a decoder prefix)
    pad = torch.ones(n, 1, 1, t_mem, dtype=torch.bool)
    pad[1, ..., t_mem - 3:] = False  # sentence 1's last three memory positions are padding

    def copied(x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(beams, 0)

    got = attend(q, k, v, pad, False, 0.0)
    want = attend(q, copied(k), copied(v), copied(pad), False, 0.0)
    assert got.shape == (n * beams, h, t_q, dh)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    got = attend_parts(q, [(k_r, v_r, None), (k, v, pad)], 0.0)
    want = attend_parts(q, [(k_r, v_r, None), (copied(k), copied(v), copied(pad))], 0.0)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    # Each beam reads its own sentence's row: a change to sentence 1's keys moves only its beams' outputs.
    k2 = k.clone()
    k2[1, :, 0] += 5.0
    moved = attend(q, k2, v, pad, False, 0.0)
    torch.testing.assert_close(moved[:beams], attend(q, k, v, pad, False, 0.0)[:beams])
    assert not torch.allclose(moved[beams:].float(), attend(q, k, v, pad, False, 0.0)[beams:].float())
    if beams > 1:
        with pytest.raises(ValueError, match="cannot share"):
            attend(q[:-1], k, v, pad, False, 0.0)
        with pytest.raises(ValueError, match="causal"):
            attend(q, k, v, None, True, 0.0)


def test_a_cached_memory_is_projected_once_and_stored_contiguous() -> None:
    """``LayerCache.memory``: the first call projects, later ones return the stored keys/values, contiguous (a
    head split of a projection is a strided view, which attention would copy at every decoding step)."""
    from nmtcore.nn.layers import CrossAttention

    layer = CrossAttention(32, 4, 0.0, kdim=24).eval()
    memory = torch.randn(3, 7, 24)
    assert not layer.project_memory(memory)[0].is_contiguous()
    cache, calls = LayerCache(), []

    def project():
        calls.append(1)
        return layer.project_memory(memory)

    k, v = cache.memory("bert", project)
    assert k.is_contiguous() and v.is_contiguous() and len(calls) == 1
    assert cache.memory("bert", project)[0] is k and len(calls) == 1
    torch.testing.assert_close((k, v), layer.project_memory(memory))
    x = torch.randn(3, 1, 32)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, memory, None, cache=cache, name="bert"), layer(x, memory, None))


def test_fp32_decoding_caches_only_for_bf16_cpu_steps_outside_autograd_with_wide_heads() -> None:
    """:func:`~nmtcore.nn.layers.wide_decoding_cache`: beam search's bf16 autocast on the CPU, no autograd, heads of
    at least 64 dimensions (where fp32 single-query products pay for the wider cache); a SelfAttention step then
    stores its keys/values in fp32."""
    from nmtcore.nn import SelfAttention
    from nmtcore.nn.layers import wide_decoding_cache

    wide, narrow = torch.zeros(2, 4, 1, 64), torch.zeros(2, 4, 1, 32)
    with torch.no_grad():
        assert not wide_decoding_cache(wide)  # fp32: nothing to widen
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert wide_decoding_cache(wide) and not wide_decoding_cache(narrow)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not wide_decoding_cache(wide)  # autograd (training): the cache stays in the graph's dtype

    attn = SelfAttention(128, 2, 0.0).eval()  # 2 heads of 64
    x = torch.randn(3, 1, 128)
    for grad, x_dtype, dtype in ((False, torch.float32, torch.float32), (False, torch.bfloat16, torch.float32),
                                 (True, torch.float32, torch.bfloat16)):
        cache = LayerCache()
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
            for _ in range(2):
                y = attn(x.to(x_dtype), causal=True, cache=cache)
        assert cache.self_k.dtype == cache.self_v.dtype == dtype and cache.self_k.shape == (3, 2, 2, 64)
        assert y.shape == (3, 1, 128) and y.dtype == torch.bfloat16  # the output projection under autocast
    # A prefix reordered at every step (beam search) stays in the compute dtype: the fp32 copy costs more there.
    cache = LayerCache(reordered_each_step=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(2):
            y = attn(x, causal=True, cache=cache)
    assert cache.self_k.dtype == cache.self_v.dtype == torch.bfloat16 and cache.self_k.shape == (3, 2, 2, 64)


@pytest.mark.parametrize("width", [1, 5, 15, 16, 40])
def test_softmax_equals_torch_in_value_gradient_and_masked_rows(width: int) -> None:
    """:func:`~nmtcore.nn.layers.softmax` (elementwise ops for rows shorter than the CPU kernel's vector): torch's
    values and gradients, −inf entries at 0, a row of only −inf NaN as in ``torch.softmax``; rows of at least
    one vector stay with torch's kernel."""
    from nmtcore.nn.layers import cpu_softmax_vector_width, softmax

    g = torch.Generator().manual_seed(width)
    x = torch.randn(6, 3, 2, width, generator=g) * 4
    x[0, 0, 0, 0] = float("-inf")
    x[1, 1, 1, :] = float("-inf")
    upstream = torch.randn(x.shape, generator=g)
    mine, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = softmax(mine), torch.softmax(ref, dim=-1)
    assert torch.equal(got.isnan(), want.isnan()) and bool(got[1, 1, 1].isnan().all())
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=1e-6, atol=1e-6)
    if width > 1:
        assert got[0, 0, 0, 0] == 0
    got.nan_to_num().backward(upstream)
    want.nan_to_num().backward(upstream)
    torch.testing.assert_close(mine.grad.nan_to_num(), ref.grad.nan_to_num(), rtol=1e-5, atol=1e-6)
    short = width < cpu_softmax_vector_width()
    assert ("ShortRowSoftmax" in type(got.grad_fn).__name__) == short
    assert torch.autograd.gradcheck(softmax, (torch.randn(2, 3, width, dtype=torch.float64, requires_grad=True),))


def test_decoding_step_scores_are_fp32_products_of_the_bf16_operands() -> None:
    """:func:`~nmtcore.nn.layers.attention_scores`: a decoding step's bf16 query rows (at most FEW_QUERIES) on the
    CPU outside autograd are scored as exact fp32 products of the bf16 values; a sequence of queries, or a query
    under autograd, keeps the bf16 product (rounded to bf16)."""
    from nmtcore.nn.layers import FEW_QUERIES, attention_scores

    g = torch.Generator().manual_seed(3)
    k = torch.randn(8, 12, 15, 32, generator=g).bfloat16()
    for t_q in (1, 5, FEW_QUERIES):
        q = torch.randn(8, 12, t_q, 32, generator=g).bfloat16()
        wide = q.float() @ k.float().transpose(-1, -2)
        got = attention_scores(q, k)
        assert got.dtype == torch.float32 and torch.equal(got, wide)
        assert not torch.equal(got, wide.bfloat16().float())  # not rounded to bf16 (some entries differ)
    q = torch.randn(8, 12, FEW_QUERIES + 1, 32, generator=g).bfloat16()
    assert torch.equal(attention_scores(q, k), (q @ k.transpose(-1, -2)).float())
    q1 = torch.randn(8, 12, 1, 32, generator=g).bfloat16().requires_grad_()
    assert torch.equal(attention_scores(q1, k), (q1 @ k.transpose(-1, -2)).float())
