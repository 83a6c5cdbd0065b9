"""T5-style span corruption (Raffel et al. 2020, section 3.1.4), the encoder-decoder's pretraining objective.

A fraction ``rate`` of each window's tokens is "noise", grouped into spans of mean length ``mean_span``.
The encoder sees the window with each noise span replaced by one sentinel id; the decoder reconstructs
the spans, each introduced by its sentinel, and ends with one more sentinel:

    window   a b c d e f g h            (noise: c d, g h; spans alternate kept, noise, ..., ending in noise)
    encoder  a b <0> e f <1>
    decoder  <0> c d <1> g h            (input)
    targets  c d <1> g h <2>            (the decoder input shifted left)

Every row of a batch gets its own spans but the same counts, so all rows have the same encoder and
decoder lengths (T - noise + spans and noise + spans): no padding. The number of spans is capped so the
sentinels fit in ``n_sentinels`` ids (fewer, longer spans for long windows).
"""

from __future__ import annotations

import torch
from torch import Tensor

from blockloop.errors import BlockloopError


def _composition(total: int, parts: int, generator: torch.Generator) -> list[int]:
    """A uniformly random split of ``total`` into ``parts`` positive integers."""
    cuts = (torch.randperm(total - 1, generator=generator)[: parts - 1] + 1).sort().values.tolist()
    edges = [0, *cuts, total]
    return [b - a for a, b in zip(edges, edges[1:])]


def span_counts(length: int, rate: float, mean_span: float, n_sentinels: int) -> tuple[int, int]:
    """(noise tokens, spans) for a window of ``length`` tokens."""
    if length < 2:
        raise BlockloopError(f"span corruption keeps some tokens of a window and masks others, so it needs windows "
                             f"of at least 2 tokens; got {length}: raise --seq-len")
    n_noise = min(max(1, round(length * rate)), length - 1)
    n_spans = max(1, round(n_noise / mean_span))
    return n_noise, min(n_spans, n_noise, length - n_noise, n_sentinels - 1)


def span_corrupt(
    tokens: Tensor, *, rate: float, mean_span: float, first_sentinel: int, n_sentinels: int, generator: torch.Generator
) -> dict[str, Tensor]:
    """Encoder ids, decoder ids and targets for ``tokens (B, T)``; sentinel i is ``first_sentinel + i``."""
    n_noise, n_spans = span_counts(tokens.shape[1], rate, mean_span, n_sentinels)
    encoder, decoder = [], []
    for row in tokens.tolist():
        keep = _composition(len(row) - n_noise, n_spans, generator)
        noise = _composition(n_noise, n_spans, generator)
        enc, dec, start = [], [], 0
        for i, (k, n) in enumerate(zip(keep, noise)):
            enc += row[start : start + k] + [first_sentinel + i]
            dec += [first_sentinel + i] + row[start + k : start + k + n]
            start += k + n
        encoder.append(enc)
        decoder.append(dec + [first_sentinel + n_spans])
    encoder_idx, decoder_all = torch.tensor(encoder), torch.tensor(decoder)
    return {"idx": encoder_idx, "decoder_idx": decoder_all[:, :-1], "targets": decoder_all[:, 1:]}
