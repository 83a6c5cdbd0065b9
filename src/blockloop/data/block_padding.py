"""Random-length padding for block models (Block Transformer, appendix H).

A block embedding reads all ``L_B`` tokens of its block, padding included, so at inference a prompt
whose length is not a multiple of ``L_B`` puts pads in its first block. Training sees the same thing:
each document starts after a random 0..L_B-1 pads and is padded up to the next block boundary, so no
block ever holds two documents.
"""

from __future__ import annotations

import torch
from torch import Tensor


def random_length_padding(
    window: Tensor, block_len: int, *, eos_id: int, pad_id: int, length: int, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Re-pack each row of ``window (B, W)`` (documents ending in ``eos_id``) into ``length`` tokens.

    Returns the padded ids ``(B, length)`` and a mask of the positions that hold real tokens. Text
    beyond ``length`` after padding is dropped; the row is filled with pads if it runs short.
    """
    rows, masks = [], []
    for row in window:
        ends = (row == eos_id).nonzero().flatten().add(1).tolist()
        bounds = [0, *[e for e in ends if e < len(row)], len(row)]
        pieces, real, size = [], [], 0
        for start, stop in zip(bounds[:-1], bounds[1:]):
            lead = int(torch.randint(0, block_len, (1,), generator=generator))
            tail = -(lead + stop - start) % block_len
            pieces += [row.new_full((lead,), pad_id), row[start:stop], row.new_full((tail,), pad_id)]
            real += [torch.zeros(lead, dtype=torch.bool), torch.ones(stop - start, dtype=torch.bool),
                     torch.zeros(tail, dtype=torch.bool)]
            size += lead + stop - start + tail
            if size >= length:
                break
        short = max(0, length - size)
        rows.append(torch.cat([*pieces, row.new_full((short,), pad_id)])[:length])
        masks.append(torch.cat([*real, torch.zeros(short, dtype=torch.bool)])[:length])
    return torch.stack(rows), torch.stack(masks).to(window.device)
