"""Run by ``tests/test_paged_decode_kernel.py`` in a process of its own under ``TRITON_INTERPRET=1`` (Triton reads
that when it is first imported, and the test process imports it early through ``torch.compile``).

Fills a real :class:`~blockloop.nn.paged_cache.PagedKVCache` the way the engine does (rows reserving pages of
different lengths, a row released and its pages reused, holes in ``key_valid``), then prints, as one JSON object,
the largest difference of the Triton kernel from the reference for each case: the eager attention under the mask
FlexAttention gets for the same step (:meth:`~blockloop.nn.paged_cache.KVPages.block_mask`).
"""

from __future__ import annotations

import json

import torch

from blockloop.nn.attention import attention
from blockloop.nn.paged_cache import KVPages, PagedKVCache
from blockloop.nn.paged_decode import paged_decode_attention


def case(kv_heads: int, groups: int, page_size: int, tile: int, dtype: torch.dtype, window: int = 0) -> float:
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
    mask = pages.block_mask(key_valid, query[:, None], local=local, window=window)
    expected = attention(q.double(), cache.k.double(), cache.v.double(), block_mask=mask, backend="eager")
    got = paged_decode_attention(q, cache.k, cache.v, pages.table, query, key_valid, page_size=page_size, tile=tile,
                                 local=local, window=window)
    return float((got.double() - expected).abs().max())


def main() -> None:
    cases = {
        "one head per group, 4-token pages": case(2, 1, 4, 8, torch.float32),
        "3 query heads per key head, 16-token pages": case(1, 3, 16, 16, torch.float32),
        "tile smaller than a page": case(2, 2, 16, 4, torch.float32),
        "1-token pages": case(2, 2, 1, 8, torch.float32),
        "sliding window on two rows": case(2, 2, 4, 8, torch.float32, window=6),
        "float16 pool": case(2, 3, 8, 8, torch.float16),
    }
    print(json.dumps(cases))


if __name__ == "__main__":
    main()
