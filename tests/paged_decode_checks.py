"""Run by ``tests/test_paged_decode_kernel.py`` in a process of its own: on CPU under ``TRITON_INTERPRET=1`` (Triton
reads that when it is first imported, and the test process imports it early through ``torch.compile``), or with
``--device cuda`` on a GPU, compiled.

Prints one JSON object:

* ``"attention"``: a real :class:`~blockloop.nn.paged_cache.PagedKVCache` filled the way the engine does (rows
  reserving pages of different lengths, a row released and its pages reused, holes in ``key_valid``); for each
  case the largest difference of the Triton kernel from the eager attention under the mask FlexAttention gets for
  the same step (:meth:`~blockloop.nn.paged_cache.KVPages.pool_mask`);
* ``"edges"``: the largest difference the kernel's output takes when every byte it must not read turns NaN or
  infinite, and ``"pool past 2^31 elements"``: whether the heads of such a pool are told apart;
* ``"engine"``: for each family whose decode reads a pool, whether an engine whose pages are read by the kernel
  (``Paging(..., read="kernel")``) serves the same greedy tokens as the static cache, through a pool small enough
  that requests wait for pages.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import Tensor

from blockloop.config import DecoderConfig
from blockloop.families import build_model, from_name
from blockloop.families.recursive import RecursiveConfig
from blockloop.nn.attention import attention
from blockloop.nn.paged_cache import KVPages, PagedKVCache
from blockloop.nn.paged_decode import paged_decode_attention
from blockloop.serve.engine import Engine
from blockloop.serve.requests import SamplingParams
from blockloop.serve.runners import ExitRule, Paging, runner_for

DEVICE = torch.device("cpu")  # where the kernel runs: the CPU (in Triton's interpreter) or, with --device cuda, a GPU


def case(kv_heads: int, groups: int, page_size: int, tile: int, dtype: torch.dtype, window: int = 0,
         splits: int | None = None) -> float:
    torch.manual_seed(page_size * 10 + groups)
    rows, max_len, dim = 4, 40, 16
    lengths = [1, 17, 40, 9]
    pages = KVPages.for_tokens(rows, max_len, sum(lengths) + rows * page_size, page_size, device="cpu", read="pages")
    cache = PagedKVCache(pages, kv_heads, dim, dtype=dtype)
    pages.reserve(0, 30)
    pages.release(0)  # its pages go back to the pool and are taken by the rows below, out of order
    for row, n in enumerate(lengths):
        assert pages.reserve(row, n)
    for row, n in enumerate(lengths):  # each row's keys and values through the cache's own write
        k, v = torch.randn(2, 1, kv_heads, n, dim, dtype=dtype)
        cache.rows(row, row + 1).write(torch.arange(n), k, v)
    key_valid = torch.zeros(rows, max_len, dtype=torch.bool)
    for row, n in enumerate(lengths):
        key_valid[row, :n] = torch.rand(n) > 0.25  # holes: padding a prompt left, or a block model's
    query = torch.tensor([n - 1 for n in lengths])
    q = torch.randn(rows, kv_heads * groups, 1, dim, dtype=dtype)
    local = torch.tensor([False, True, True, False]) if window else None
    mask = pages.pool_mask(key_valid, query[:, None], local=local, window=window)
    expected = attention(q.double(), cache.k.double(), cache.v.double(), block_mask=mask, backend="eager")
    on = {name: t.to(DEVICE) if t is not None else None
          for name, t in dict(q=q, k=cache.k, v=cache.v, table=pages.table, reserved=pages.reserved, query=query,
                              valid=key_valid, local=local).items()}
    got = paged_decode_attention(on["q"], on["k"], on["v"], on["table"], on["reserved"], on["query"], on["valid"],
                                 page_size=page_size, tile=tile, local=on["local"], window=window, splits=splits)
    return float((got.cpu().double() - expected).abs().max())


def stale_bytes_unread(splits: int) -> float:
    """The kernel's largest difference from itself once every byte no query may see is NaN or infinite: the scratch
    page (where idle rows write), a reused page's slots past a row's reservation, a hole in ``key_valid``. Cross
    attention's query (past every key) included: it reads each row's reserved pages, never the scratch page."""
    torch.manual_seed(5)
    rows, max_len, dim, size = 3, 32, 16, 4
    pages = KVPages.for_tokens(rows, max_len, 2 * max_len, size, device="cpu", read="pages")
    cache = PagedKVCache(pages, 2, dim, dtype=torch.float32)
    cache.k.normal_(), cache.v.normal_()
    lengths = [6, 13, 1]
    for row, n in enumerate(lengths):
        assert pages.reserve(row, n)
    key_valid = torch.zeros(rows, max_len, dtype=torch.bool)
    for row, n in enumerate(lengths):
        key_valid[row, :n] = True
    key_valid[1, 4] = False  # a hole
    q = torch.randn(rows, 4, 1, dim)
    query = torch.tensor([5, max_len, 0])  # the middle row's query after every key: cross attention's

    def read() -> Tensor:
        on = [t.to(DEVICE) for t in (q, cache.k, cache.v, pages.table, pages.reserved, query, key_valid)]
        return paged_decode_attention(*on, page_size=size, splits=splits).cpu()

    clean = read()
    unseen = torch.ones(cache.k.shape[2], dtype=torch.bool)
    for row, n in enumerate(lengths):
        unseen[pages.positions(torch.arange(n))[row]] = False
    unseen[pages.positions(torch.tensor([4]))[1]] = True
    cache.k[:, :, unseen], cache.v[:, :, unseen] = float("nan"), float("inf")
    return float((read() - clean).abs().max())


def pool_past_int32_offsets() -> bool:
    """Whether a pool of more than 2^31 elements is read at the right head: with 32-bit offsets the third head's
    start, 2^31 elements in, wraps negative. The pool is allocated and never filled but for one page per head
    (6.4 GB of address space, a few kilobytes of memory)."""
    heads, dim, size = 3, 16, 16
    k = torch.empty(1, heads, 2**30 // dim, dim, dtype=torch.float16, device=DEVICE)
    v = torch.empty_like(k)
    k[0, :, size: 2 * size] = 0  # page 1 of each head: equal scores, and values naming the head
    for head in range(heads):
        v[0, head, size: 2 * size] = head
    on = dict(device=DEVICE)
    out = paged_decode_attention(torch.randn(1, heads, 1, dim, dtype=torch.float16, **on), k, v,
                                 torch.ones(1, 1, dtype=torch.long, **on), torch.ones(1, dtype=torch.long, **on),
                                 torch.tensor([size - 1], **on), torch.ones(1, size, dtype=torch.bool, **on),
                                 page_size=size)
    return out[0, :, 0, 0].float().cpu().tolist() == list(range(heads))


def same_greedy_tokens(model: torch.nn.Module, tokens: int, page_size: int, **options: object) -> bool:
    """Whether the kernel's paged read serves the static cache's greedy tokens (float64 weights: the kernel
    accumulates in float32, far below any margin between two tokens' logits here)."""
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 60, (n,), generator=generator).tolist() for n in (5, 17, 2, 11, 9)]
    outputs = []
    model = model.to(DEVICE)
    for paging in (None, Paging(tokens, page_size, "kernel")):
        engine = Engine(runner_for(model, paging=paging, **options), n_slots=3, max_len=40, sync_every=4)
        requests = [engine.submit(p, 9, sampling=SamplingParams(temperature=0.0)) for p in prompts]
        engine.run()
        outputs.append([r.output for r in requests])
    return outputs[0] == outputs[1]


def model_of(config: object) -> torch.nn.Module:
    torch.manual_seed(0)
    model = (build_model(from_name(config)) if isinstance(config, str) else build_model(config)).double().eval()
    with torch.no_grad():  # unequal weights: attention that differs between positions
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def main() -> None:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="where the kernel runs: cpu (Triton's interpreter) or cuda")
    DEVICE = torch.device(parser.parse_args().device)
    shape = dict(vocab_size=61, context_length=96, n_head=4, n_kv_head=2, d_model=32, d_ff=48, norm="rmsnorm",
                 mlp="swiglu", bias=False, sliding_window=4, local_rope_base=1000.0)
    engine = {
        "decoder": same_greedy_tokens(model_of("tiny"), 56, 4),
        "encoder-decoder (cross attention over pages)": same_greedy_tokens(model_of("tiny-encdec"), 80, 4),
        "Block Transformer (the block decoder's pages)": same_greedy_tokens(model_of("tiny-block"), 64, 2),
        "double decoder (context and generation keys in one pool)": same_greedy_tokens(model_of("tiny-double"), 96, 4),
        "recursive, depth-wise, a layer local at some loops": same_greedy_tokens(
            model_of(RecursiveConfig(**shape, n_layer=3, lora_rank=2, loops=2, local_depths=[0, 1, 2, 3, 4])), 40, 4,
            exit_rule=ExitRule("none")),
        "decoder with sliding-window layers": same_greedy_tokens(
            model_of(DecoderConfig(**shape, n_layer=3, local_layers=[0, 2])), 56, 4),
    }
    attention_cases = {
        "one head per group, 4-token pages": case(2, 1, 4, 16, torch.float32),
        "3 query heads per key head, 16-token pages": case(1, 3, 16, 16, torch.float32),
        "tile smaller than a page": case(2, 2, 32, 16, torch.float32),
        "1-token pages": case(2, 2, 1, 16, torch.float32),
        "sliding window on two rows": case(2, 2, 4, 16, torch.float32, window=6),
        "float16 pool": case(2, 3, 8, 16, torch.float16),
        "bfloat16 pool": case(2, 3, 16, 64, torch.bfloat16),
        "3 splits per row (flash-decoding)": case(2, 2, 4, 16, torch.float32, splits=3),
        "7 splits, more than a short row's tiles, with a window": case(1, 3, 4, 16, torch.float32, window=6, splits=7),
    }
    edges = {
        "stale NaN and inf where no query looks": stale_bytes_unread(1),
        "the same, 3 splits": stale_bytes_unread(3),
    }
    print(json.dumps({"attention": attention_cases, "engine": engine, "edges": edges,
                      "pool past 2^31 elements": pool_past_int32_offsets()}))


if __name__ == "__main__":
    main()
