"""Memory-bandwidth roofline of a decode step: bytes of weights + KV read per generated token.

Decoding is memory bound, so a step cannot beat ``bytes read / bandwidth``. Each family that has a roofline
gives it in its spec (``FamilySpec.decode_bytes_per_step``), averaged over the ``gen_len`` decode steps
after a ``prompt_len`` prompt for ``B`` rows: the vanilla decoder reads all weights and the K/V of every
layer; the Block Transformer its block-level parts once every ``L_B`` tokens and its token decoder every
token; the recursive model its shared layers once per loop; the double decoder only its generation layers
and head. Other families return None (no roofline yet). Embedding rows read by a lookup are not counted.
"""

from __future__ import annotations

from torch import nn

from blockloop.families import spec_of


def bytes_per_step(model: nn.Module, batch: int, prompt_len: int, gen_len: int) -> float | None:
    """Average bytes one decode step must read for ``batch`` rows, or None without a roofline."""
    per_step = spec_of(model.config).decode_bytes_per_step
    return None if per_step is None else per_step(model, batch, prompt_len, gen_len)
