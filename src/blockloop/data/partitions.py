"""Block partitions for double-decoder training (Alexander et al. 2026, section 3.1).

A partition is a strictly increasing sequence 0 = b_0 < b_1 < ... < b_K = T that cuts a window into K
contiguous blocks; one is drawn per batch and shared by its rows, so it only changes the generation
decoder's attention masks (:func:`blockloop.nn.masks.dual_block_mask`). Every position lies in exactly one block,
so every token is scored exactly once whatever the partition.

The paper says only that the blocks "are sampled randomly per batch" (section 6); these strategies are
blockloop's own (``DoubleDecoderConfig.partition``):

* ``uniform`` - K uniform on 1..max_blocks, the K-1 inner boundaries uniform among distinct positions;
* ``logspace`` - K uniform as above, inner boundaries at round(T^(i/K)): short blocks first, long ones
  last (many short contexts early in the window, long responses late);
* ``histogram`` - block lengths drawn with replacement from ``partition_lengths`` (e.g. the prompt
  lengths seen in deployment) until the window is covered; the last block is cut at T.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from blockloop.errors import ConfigError

PARTITIONS = ("uniform", "logspace", "histogram")


def sample_partition(
    length: int,
    strategy: str,
    generator: torch.Generator,
    *,
    max_blocks: int = 16,
    lengths: Sequence[int] = (),
) -> Tensor:
    """Boundaries ``(K + 1,)`` (int64, first 0, last ``length``) drawn by ``strategy``."""
    if strategy not in PARTITIONS:
        raise ConfigError(f"partition strategy {strategy!r} is unknown; choose one of {PARTITIONS}")
    if strategy == "histogram":
        if not lengths:
            raise ConfigError("the histogram partition needs a non-empty list of block lengths")
        table = torch.as_tensor(list(lengths), dtype=torch.long)
        cuts, end = [], 0
        while end < length:
            end += int(table[torch.randint(len(table), (1,), generator=generator)])
            cuts.append(min(end, length))
        return torch.tensor([0, *cuts], dtype=torch.long)
    n_blocks = int(torch.randint(1, min(max_blocks, length) + 1, (1,), generator=generator))
    if strategy == "uniform":
        inner = (torch.randperm(length - 1, generator=generator)[: n_blocks - 1] + 1).sort().values
    else:
        inner = torch.tensor(sorted({round(math.exp(i / n_blocks * math.log(length))) for i in range(1, n_blocks)}))
        inner = inner[(inner > 0) & (inner < length)].long()
    return torch.cat([torch.zeros(1, dtype=torch.long), inner, torch.full((1,), length, dtype=torch.long)])


def prefix_partition(length: int, breakpoint: int) -> Tensor:
    """The two-block partition of the PrefixLM phase: a context block [0, breakpoint), then the response."""
    return torch.tensor([0, breakpoint, length], dtype=torch.long)
