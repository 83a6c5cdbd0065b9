"""Every attention backend against a float64 softmax written out in the test, masks and LSE included."""

from __future__ import annotations

import math

import pytest
import torch

import blockloop.nn.attention as attention_module
from blockloop.nn.attention import attention

BACKENDS = ["sdpa", "flex", "eager"]


def reference(q, k, v, mask):
    """softmax(q k^T / sqrt(d) + mask) v in float64 with explicit head repetition; empty rows -> 0."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k = torch.cat([k[:, i // groups : i // groups + 1] for i in range(q.shape[1])], dim=1)
    v = torch.cat([v[:, i // groups : i // groups + 1] for i in range(q.shape[1])], dim=1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return weights @ v, lse


def inputs(b=2, hq=4, hkv=2, tq=9, tk=9, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, hq, tq, d, generator=g, dtype=dtype),
        torch.randn(b, hkv, tk, d, generator=g, dtype=dtype),
        torch.randn(b, hkv, tk, d, generator=g, dtype=dtype),
    )


def causal_dense(tq, tk):
    return torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)


def check(backend, q, k, v, expected_mask, **mask_kwargs):
    want, want_lse = reference(q, k, v, expected_mask)
    tol = 1e-10 if q.dtype == torch.float64 else 2e-5
    if backend == "sdpa":
        got = attention(q, k, v, backend="sdpa", **mask_kwargs)
    else:
        got, lse = attention(q, k, v, backend=backend, return_lse=True, **mask_kwargs)
        finite = torch.isfinite(want_lse)
        assert torch.equal(torch.isfinite(lse), finite)
        # FlexAttention keeps its log-sum-exp in float32 whatever the input dtype.
        lse_tol = max(tol, 1e-6) if backend == "flex" else tol
        torch.testing.assert_close(lse.double()[finite], want_lse[finite], atol=lse_tol, rtol=lse_tol)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hkv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_causal_matches_reference(backend, hkv):
    q, k, v = inputs(hkv=hkv, dtype=torch.float64)
    check(backend, q, k, v, causal_dense(9, 9), causal=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_with_fewer_queries_than_keys_is_bottom_right_aligned(backend):
    # Chunked prefill over a cache: 3 new queries are the last 3 of 10 keys.
    q, k, v = inputs(tq=3, tk=10, dtype=torch.float64)
    check(backend, q, k, v, causal_dense(3, 10), causal=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_mask_and_mask_mod_agree_with_reference(backend):
    q, k, v = inputs(tq=12, tk=12, dtype=torch.float64)
    doc = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2])

    def document_causal(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (qi >= ki)

    dense = (doc[:, None] == doc[None, :]) & causal_dense(12, 12)
    check(backend, q, k, v, dense, mask=dense)
    check(backend, q, k, v, dense, mask_mod=document_causal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # on CPU, SDPA's math and flash kernels
def test_per_batch_mask_and_empty_rows(backend, dtype):
    q, k, v = inputs(tq=5, tk=7, dtype=dtype)
    mask = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(3)) > 0.5
    mask[0, 0, 2] = False  # a query that sees nothing: zeros, lse = -inf
    out = attention(q, k, v, mask=mask, backend=backend)
    assert torch.all(out[0, :, 2] == 0)
    check(backend, q, k, v, mask, mask=mask)


@pytest.mark.parametrize("backend", ["flex", "eager"])
def test_lse_merge_of_disjoint_key_sets_equals_joint_softmax(backend):
    """The identity double decoders rely on: two attentions merged by their LSEs = one softmax."""
    q, k, v = inputs(tq=8, tk=8, dtype=torch.float64, seed=5)
    blocks = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])
    within = (blocks[:, None] == blocks[None, :]) & causal_dense(8, 8)
    earlier = blocks[None, :] < blocks[:, None]
    out_a, lse_a = attention(q, k, v, mask=within, backend=backend, return_lse=True)
    out_b, lse_b = attention(q, k, v, mask=earlier, backend=backend, return_lse=True)
    weight = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)  # first block has lse_b = -inf -> weight 1
    merged = weight * out_a + (1 - weight) * out_b
    want, _ = reference(q, k, v, within | earlier)
    torch.testing.assert_close(merged, want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("backend", ["sdpa", "flex", "eager"])
def test_a_block_mask_built_once_serves_every_backend(backend):
    """A BlockMask built by the caller: FlexAttention takes it as it is, SDPA and eager evaluate its mask_mod."""
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v = inputs(tq=9, tk=9, dtype=torch.float64, seed=2)
    block_mask = create_block_mask(lambda b, h, qi, ki: ki <= qi, 1, 1, 9, 9, device="cpu", BLOCK_SIZE=4)
    want, _ = reference(q, k, v, causal_dense(9, 9))
    torch.testing.assert_close(attention(q, k, v, block_mask=block_mask, backend=backend), want, atol=1e-10, rtol=1e-10)
    with pytest.raises(ValueError, match="at most one"):
        attention(q, k, v, mask=causal_dense(9, 9), block_mask=block_mask, backend=backend)


def test_float32_backends_agree():
    q, k, v = inputs(b=3, hq=8, hkv=2, tq=33, tk=33, d=32)
    out = {b: attention(q, k, v, causal=True, backend=b) for b in BACKENDS}
    torch.testing.assert_close(out["sdpa"], out["eager"], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out["flex"], out["eager"], atol=2e-5, rtol=2e-5)


def test_bad_arguments_raise():
    q, k, v = inputs()
    with pytest.raises(ValueError, match="at most one"):
        attention(q, k, v, causal=True, mask=causal_dense(9, 9))
    with pytest.raises(ValueError, match="log-sum-exp"):
        attention(q, k, v, causal=True, backend="sdpa", return_lse=True)
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention(q, k, v, causal=True, backend="cudnn-magic")
    with pytest.raises(ValueError, match="do not divide"):
        attention(q, k[:, :1].expand(-1, 3, -1, -1), v[:, :1].expand(-1, 3, -1, -1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_backends_match_float64_reference():
    q, k, v = (t.cuda().bfloat16() for t in inputs(b=2, hq=8, hkv=2, tq=256, tk=256, d=64))
    want, want_lse = reference(q, k, v, causal_dense(256, 256).cuda())
    for backend in BACKENDS:
        got = attention(q, k, v, causal=True, backend=backend)
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    _, lse = attention(q, k, v, causal=True, backend="flex", return_lse=True)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_rows_with_no_visible_key_are_zeros(backend):
    """Without the log-sum-exp (every decode step) FlexAttention's compiled CUDA kernel alone keeps an empty row at
    zeros; SDPA's GPU kernels need the entry point's fix-up."""
    q, k, v = (t.cuda() for t in inputs(tq=5, tk=7))
    mask = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(3)) > 0.5
    mask[0, 0, 2] = False
    out = attention(q, k, v, mask=mask.cuda(), backend=backend)
    assert torch.all(out[0, :, 2] == 0)
    torch.testing.assert_close(out.double(), reference(q, k, v, mask.cuda())[0], atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tq", [1, 5], ids=["decode", "chunk"])
def test_cuda_grouped_query_attention_under_a_mask_runs_a_fused_kernel(tq):
    """With SDPA's math kernel ruled out, grouped K/V under a mask still run in bf16 (the memory-efficient kernel
    over the folded query rows), rows that see no key included."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.cuda().bfloat16() for t in inputs(b=4, hq=9, hkv=3, tq=tq, tk=300, d=64, seed=5))
    mask = torch.rand(4, 1, tq, 300, generator=torch.Generator().manual_seed(6)) > 0.3
    mask[1] = False
    mask = mask.cuda()
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel(fused):
        got = attention(q, k, v, mask=mask, backend="sdpa")
    assert torch.all(got[1] == 0)
    torch.testing.assert_close(got.double(), reference(q, k, v, mask)[0], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hkv", [2, 1], ids=["gqa", "mqa"])
def test_grouped_decode_over_a_cache_matches_reference(backend, hkv):
    """A decode step: one query per row over a cache, each row seeing its own live slots (some none)."""
    q, k, v = inputs(b=3, hq=4, hkv=hkv, tq=1, tk=11, dtype=torch.float64, seed=7)
    live = torch.rand(3, 1, 1, 11, generator=torch.Generator().manual_seed(1)) > 0.4
    live[2] = False
    check(backend, q, k, v, live, mask=live)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_query_with_a_per_head_mask_matches_reference(backend):
    q, k, v = inputs(b=2, hq=6, hkv=2, tq=4, tk=9, dtype=torch.float64, seed=2)
    mask = torch.rand(2, 6, 4, 9, generator=torch.Generator().manual_seed(4)) > 0.5
    check(backend, q, k, v, mask, mask=mask)


@pytest.fixture
def gpu_sdpa_grouping(monkeypatch):
    """SDPA over grouped K/V under a mask as a GPU runs it (each key/value head's query heads folded into query
    rows, since SDPA's GPU kernels take no mask with ``enable_gqa``), here on CPU."""
    monkeypatch.setattr(attention_module, "_sdpa_takes_grouped_keys_with_a_mask", lambda q: False)


@pytest.fixture
def sdpa_calls(monkeypatch):
    """What each SDPA call got: its query heads, ``enable_gqa`` and the mask's shape."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recorded(q, k, v, **kwargs):
        calls.append((q.shape[1], kwargs["enable_gqa"], tuple(kwargs["attn_mask"].shape)))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", recorded)
    return calls


GROUPED_MASKS = {  # name -> (tq, mask for b=3, hq=6, tk=10)
    "decode, per row": (1, lambda g: torch.rand(3, 1, 1, 10, generator=g) > 0.4),
    "decode, per head": (1, lambda g: torch.rand(3, 6, 1, 10, generator=g) > 0.4),
    "chunk, per row": (4, lambda g: torch.rand(3, 1, 4, 10, generator=g) > 0.4),
    "per head and row": (4, lambda g: torch.rand(3, 6, 4, 10, generator=g) > 0.4),
    "one for the batch": (4, lambda g: torch.rand(1, 1, 4, 10, generator=g) > 0.4),
    "two-dimensional": (4, lambda g: torch.rand(4, 10, generator=g) > 0.4),
}


@pytest.mark.parametrize("name", GROUPED_MASKS)
@pytest.mark.parametrize("hkv", [2, 1], ids=["gqa", "mqa"])
def test_grouped_query_heads_folded_into_rows_match_reference(gpu_sdpa_grouping, sdpa_calls, name, hkv):
    """The GPU form of SDPA over grouped K/V with a mask: one SDPA call with the key/value heads' own head count and
    no ``enable_gqa``, equal to the float64 reference for every mask shape, rows with no visible key included."""
    tq, make = GROUPED_MASKS[name]
    q, k, v = inputs(b=3, hq=6, hkv=hkv, tq=tq, tk=10, dtype=torch.float64, seed=11)
    mask = make(torch.Generator().manual_seed(12))
    if mask.shape[0] == 3:
        mask[0] = False  # a batch row that sees no key: zeros
    check("sdpa", q, k, v, mask.expand(3, 6, tq, 10), mask=mask)
    assert [call[:2] for call in sdpa_calls] == [(hkv, False)]
    if name == "decode, per row":  # a decode step's mask goes through as it is, uncopied
        assert sdpa_calls[0][2] == (3, 1, 1, 10)


def test_grouped_query_heads_folded_into_rows_compile_into_one_graph(gpu_sdpa_grouping):
    """The fold is in every compiled GPU decode step over a grouped-query cache: a graph break would fail there."""
    q, k, v = inputs(b=3, hq=6, hkv=2, tq=1, tk=10, seed=14)
    live = torch.rand(3, 1, 1, 10, generator=torch.Generator().manual_seed(15)) > 0.4
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, m: attention(q, k, v, mask=m, backend="sdpa"), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, live), reference(q, k, v, live.expand(3, 6, 1, 10))[0].float(),
                               atol=2e-5, rtol=2e-5)


def test_grouped_query_heads_folded_into_rows_under_a_causal_chunk(gpu_sdpa_grouping, sdpa_calls):
    """A chunk's causal mask, the same for every row and head, reaches SDPA as one ``(1, 1, G*Tq, Tk)`` mask, not
    copied per batch row and key/value head."""
    q, k, v = inputs(b=2, hq=6, hkv=2, tq=3, tk=8, dtype=torch.float64, seed=13)
    check("sdpa", q, k, v, causal_dense(3, 8), causal=True)
    check("sdpa", q, k, v, causal_dense(3, 8), mask_mod=lambda b, h, qi, ki: ki <= qi + 5)
    assert sdpa_calls == [(2, False, (1, 1, 9, 8))] * 2


ON_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize(("backend", "device"), [("sdpa", "cpu"), ("sdpa as on a GPU", "cpu"), ("eager", "cpu"),
                                                 pytest.param("sdpa", "cuda", marks=ON_CUDA)])
@pytest.mark.parametrize("masking", ["cache", "causal"])
def test_grouped_query_attention_never_expands_keys_and_values(backend, device, masking, request):
    """No tensor the size of K/V repeated per query head is ever made (the per-step copy issue 12 removes); on CUDA
    SDPA's math kernel would make one (it takes grouped K/V under a mask, its fused kernels do not)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    if backend == "sdpa as on a GPU":
        request.getfixturevalue("gpu_sdpa_grouping")
        backend = "sdpa"
    b, hq, hkv, tk, d = 2, 8, 1, 64, 32
    q, k, v = (t.to(device) for t in inputs(b=b, hq=hq, hkv=hkv, tq=1 if masking == "cache" else 4, tk=tk, d=d))
    largest = []

    class Largest(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            largest.extend(t.numel() for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor))
            return out

    kwargs = {"mask": torch.ones(b, 1, 1, tk, dtype=torch.bool, device=device)} if masking == "cache" else {"causal": True}
    with Largest():
        attention(q, k, v, backend=backend, **kwargs)
    assert max(largest) <= k.numel() < b * hq * tk * d


@pytest.mark.parametrize("backend", BACKENDS)
def test_keys_past_a_narrower_mask_are_seen_by_no_query(backend):
    """A dense mask over the leading keys only (an eager CPU decode step over a long static cache) attends as the
    same mask padded with False over every key would, whatever the keys past it hold."""
    q, k, v = inputs(tq=3, tk=11, dtype=torch.float64)
    narrow = torch.rand(2, 1, 3, 7, generator=torch.Generator().manual_seed(5)) > 0.4
    narrow[..., 0] = True
    full = torch.nn.functional.pad(narrow, (0, 4))
    k[:, :, 7:], v[:, :, 7:] = 1e6, float("nan")  # what no query may read
    torch.testing.assert_close(attention(q, k, v, mask=narrow, backend=backend),
                               reference(q, k[:, :, :7], v[:, :, :7], narrow)[0], atol=1e-10, rtol=1e-10)
    k[:, :, 7:], v[:, :, 7:] = 0.0, 0.0
    torch.testing.assert_close(attention(q, k, v, mask=narrow, backend=backend),
                               attention(q, k, v, mask=full, backend=backend), atol=1e-10, rtol=1e-10)
