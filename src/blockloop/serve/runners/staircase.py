"""Serving the staircase family (Staircase, Cached / Global Cached Staircase, Feedback Transformer) as
streams over static per-slot buffers: each new token costs one query per pass, and a chunk boundary is a
few masked copies, so :meth:`StaircaseRunner.decode_step` is one static-shape graph (issue 12).

**Windows at fixed positions.** A chunk's pass k attends to its window (the cache, then the older chunks
in flight, each at a later pass; see :mod:`blockloop.models.staircase`, "Segments and state") and to its
own tokens causally. Every row lays pass k's window out the same way, slot = rotary position: the cache
in ``cache_tokens`` slots, then one C-slot block per older chunk, oldest first, ending at ``n_k =
cache_tokens + (P - 1 - k) C``; the chunk being written sits at ``n_k + phase``. A young stream's missing
chunks and cache entries are invalid slots at the start, so the distances between real tokens, all that
rotary attention sees, are those of the model's forward.

**The boundary is a shift.** Once a chunk is complete, the next chunk's window at pass k is what pass
k + 1 holds: the same cache (the two passes run in the same staircase step), the same older chunks at the
same passes, and the completed chunk's own keys/values at pass k + 1, at the same positions. The last
pass's window is the cache alone: the cache drops its oldest C entries and gains the completed chunk's
finished states, whose keys/values each token's read already computed (its last pass is read at once).
So nothing is recomputed at a boundary: pass buffer k takes pass buffer k + 1, the last pass takes the
rotated cache, the chunk slots empty. Rows of a continuous batch are at their own phases, so every step
computes the boundary for every row and keeps it where the row's chunk is complete (``torch.where``):
copies of the pass buffers, cheap beside recomputing the windows. Prefill stays host-driven: the model's
forward gives the stream state, whose flush steps give the windows (:meth:`StaircaseRunner._load`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from blockloop.models.recurrent_core import rotate_prefix
from blockloop.models.staircase import Staircase, StaircaseState
from blockloop.nn.kv_cache import DecoderCache, StepContext
from blockloop.nn.rope import rope_angles
from blockloop.serve.runners.base import Runner


@dataclass
class StaircaseSlots:
    """Generation state of ``B`` slots, each a stream at its own phase (continuous batching).

    ``passes[k]``: pass k's :class:`~blockloop.nn.kv_cache.DecoderCache` (one layer entry per core layer)
    of ``n_k + C`` slots per row: the window at ``0 .. n_k - 1``, the chunk being written at ``n_k + phase``
    (a per-pass KV cache). ``cache`` (Cached variants, else None): un-rotated keys/values of the last pass's
    window (``cache_tokens`` slots), then the C entries the chunk being written adds to it. ``phase (B,)``:
    how many tokens of its chunk each row has read.
    """

    passes: list[DecoderCache]
    cache: DecoderCache | None
    phase: Tensor


class StaircaseRunner(Runner):
    model: Staircase
    state: StaircaseSlots

    def allocate(self, n_slots: int, max_len: int) -> None:
        """Static decode buffers for ``n_slots`` streams; each starts empty. ``max_len`` is not needed: the
        buffers are bounded by the step size and cache, not the stream length."""
        c, weight = self.model.config, self.model.embed.weight

        def buffer(width: int) -> DecoderCache:
            return DecoderCache(c.n_layer, n_slots, c.n_kv_head, width, c.head_dim, dtype=weight.dtype, device=weight.device)

        self.state = StaircaseSlots(
            [buffer(self._window(k) + c.chunk_size) for k in range(c.passes)],
            buffer(c.cache_tokens + c.chunk_size) if c.cache_tokens else None,
            torch.zeros(n_slots, dtype=torch.long, device=weight.device),
        )

    def _window(self, k: int) -> int:
        """``n_k``: the slots of pass k's window (the cache and the ``P - 1 - k`` older chunks)."""
        c = self.model.config
        return c.cache_tokens + (c.passes - 1 - k) * c.chunk_size

    @torch.no_grad()
    def prefill_slot(self, slot: int, prompt: Tensor) -> Tensor:
        """Read ``prompt (P,)`` as a new stream in row ``slot`` (the other rows keep theirs)."""
        logits, _, state = self.model(prompt[None], return_state=True)
        rows = slice(slot, slot + 1)
        self._load(rows, state)
        start = prompt.numel() - prompt.numel() % self.model.config.chunk_size
        if start < prompt.numel():
            rest = prompt[None, start:]
            self._read(rest, torch.ones_like(rest, dtype=torch.bool), rows)
        return logits[0, -1]

    @torch.no_grad()
    def prefill_batch(self, idx: Tensor, token_valid: Tensor) -> Tensor:
        """Left-padded prompts, chunks counted from the padded start (as the forward does)."""
        logits, _, state = self.model(idx, token_valid=token_valid, return_state=True)
        self._load(slice(None), state)
        start = idx.shape[1] - idx.shape[1] % self.model.config.chunk_size
        if start < idx.shape[1]:
            self._read(idx[:, start:], token_valid[:, start:])
        return logits[:, -1]

    @torch.no_grad()
    def decode_step(self, tokens: Tensor) -> Tensor:
        """Read one token per row through its S / C (or m) passes, each a one-query attention over that
        pass's window and the chunk so far; rows whose chunk is now complete start the next one."""
        m = self.model
        h = self._read(tokens[:, None], torch.ones_like(tokens[:, None], dtype=torch.bool))
        self._advance(self.state.phase == m.config.chunk_size)
        return m.logits(m.norm(h))[:, -1]

    def _read(self, ids: Tensor, valid: Tensor, rows: slice = slice(None)) -> Tensor:
        """Append ``ids (B, T)`` to the chunk each of ``rows`` is writing, through every pass, and (Cached
        variants) write the cache entries of their finished states; their final states ``(B, T, d)``."""
        m, slots = self.model, self.state
        c, T = m.config, ids.shape[1]
        chunk = slots.phase[rows][:, None] + torch.arange(T, device=ids.device)
        states = [m.embed(ids)]
        for k, cache in enumerate(slots.passes):
            at = self._window(k) + chunk
            cos, sin = rope_angles(at, c.rotary_dim, c.rope_base)
            states = m.read_pass(states[-1], cos, sin, StepContext(_rows(cache, rows), at, token_valid=valid))
        if slots.cache is not None:
            cache, at = _rows(slots.cache, rows), c.cache_tokens + chunk
            for layer, (k, v) in zip(cache.layers, m.cache_entries(states, T)):
                layer.write(at, k, v)
            cache.mark(at, valid)
        slots.phase[rows] += T
        return states[-1]

    def _advance(self, done: Tensor) -> None:
        """Rows ``done (B,)`` (their chunk is complete) start the next chunk: pass k's buffer takes pass
        k + 1's, the cache drops its oldest C entries for the chunk's, and the last pass's window becomes the
        rotated cache; the chunk slots empty. Computed for every row, kept where ``done``."""
        c, slots, C = self.model.config, self.state, self.model.config.chunk_size
        row, kv_row = done[:, None], done[:, None, None, None]
        for into, source in zip(slots.passes, slots.passes[1:]):
            window = torch.arange(source.max_len, device=done.device)  # pass k's window: pass k + 1's slots
            for layer, new in zip(into.layers, source.layers):
                layer.write(window, torch.where(kv_row, new.k, layer.k[:, :, : source.max_len]),
                            torch.where(kv_row, new.v, layer.v[:, :, : source.max_len]))
            into.mark(_all(into), torch.where(row, _then_empty(source.key_valid, C), into.key_valid))
        last, window_valid = slots.passes[-1], row.new_zeros(len(done), 0)
        if slots.cache is not None:
            cache, window = slots.cache, torch.arange(c.cache_tokens, device=done.device)
            for layer in cache.layers:
                layer.write(_all(cache), torch.where(kv_row, layer.k.roll(-C, 2), layer.k),
                            torch.where(kv_row, layer.v.roll(-C, 2), layer.v))
            cache.mark(_all(cache), torch.where(row, _then_empty(cache.key_valid[:, C:], C), cache.key_valid))
            cos, sin = rope_angles(window, c.rotary_dim, c.rope_base)
            for layer, new in zip(last.layers, cache.layers):
                k, v = rotate_prefix((new.k[:, :, : c.cache_tokens], new.v[:, :, : c.cache_tokens]), cos, sin)
                layer.write(window, torch.where(kv_row, k, layer.k[:, :, : c.cache_tokens]),
                            torch.where(kv_row, v, layer.v[:, :, : c.cache_tokens]))
            window_valid = cache.key_valid[:, : c.cache_tokens]
        last.mark(_all(last), torch.where(row, _then_empty(window_valid, C), last.key_valid))
        slots.phase.masked_fill_(done, 0)

    def _load(self, rows: slice, state: StaircaseState) -> None:
        """Start ``rows`` at the stream state ``state`` (its last complete chunk; batch row i for the i-th of
        ``rows``): each pass's window for the next chunk, found by running the state's flush steps (the
        cache and the older chunks of pass k are those of the state after k of them), at the window's last
        slots, and the cache the last pass reads. Empties the chunks being written."""
        m, slots = self.model, self.state
        c, current = m.config, state
        for k, cache in enumerate(slots.passes):
            last = current  # after the loop: the state the last pass reads (its window is its cache)
            older, older_valid, following = [], current.cache_valid[:, :0], current
            if current.chunks:
                empty = torch.zeros(older_valid.shape[0], 0, c.d_model, dtype=m.embed.weight.dtype, device=older_valid.device)
                following, _, layer_states = m.traced_step(current, empty, older_valid)
                older = m.window_keys(layer_states)
                older_valid = torch.cat(current.valid, dim=1)
            valid = torch.cat((current.cache_valid, older_valid), dim=1)
            window = torch.arange(self._window(k) - valid.shape[1], self._window(k), device=valid.device)
            cos, sin = rope_angles(window, c.rotary_dim, c.rope_base)
            view = _rows(cache, rows)
            view.reset()
            view.mark(window, valid)
            for layer, kv in enumerate(view.layers):
                parts = [*current.cache[layer : layer + 1], *older[layer : layer + 1]]
                if parts and window.numel():
                    kv.write(window, *rotate_prefix((torch.cat([p[0] for p in parts], 2), torch.cat([p[1] for p in parts], 2)), cos, sin))
            current = following
        if slots.cache is not None:
            view = _rows(slots.cache, rows)
            view.reset()
            window = torch.arange(c.cache_tokens - last.cache_valid.shape[1], c.cache_tokens, device=last.cache_valid.device)
            view.mark(window, last.cache_valid)
            for layer, (k, v) in zip(view.layers, last.cache):
                layer.write(window, k, v)
        slots.phase[rows] = 0


def _rows(cache: DecoderCache, rows: slice) -> DecoderCache:
    return cache if rows == slice(None) else cache.rows(rows.start, rows.stop)


def _all(cache: DecoderCache) -> Tensor:
    return torch.arange(cache.max_len, device=cache.key_valid.device)


def _then_empty(valid: Tensor, n: int) -> Tensor:
    """``valid (B, W)`` followed by ``n`` empty slots."""
    return torch.cat((valid, valid.new_zeros(valid.shape[0], n)), dim=1)
