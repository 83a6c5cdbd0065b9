"""Serving the staircase family (Staircase, Cached / Global Cached Staircase, Feedback Transformer) as
streams: each slot keeps its stream state at the last complete chunk, and each new token costs one query
per pass over static per-slot buffers (see :mod:`blockloop.models.staircase`, "Segments and state").
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
    """Generation state of ``B`` slots, each a stream at its own point (continuous batching).

    ``states[b]``: slot b's stream state at its last complete chunk (a batch of one; it changes once per
    chunk). What the chunk being written reads is static: ``passes[k]`` is a
    :class:`~blockloop.nn.kv_cache.DecoderCache` (one layer entry per core layer) of ``W + C`` slots per
    row, where ``W = cache_tokens + (passes - 1) C`` bounds the window of pass k (the cache and the older
    chunks in flight, rotated keys at slots ``0..n-1``, computed once per chunk) and the chunk's own tokens
    are written at slot ``W + phase`` as they are read: a per-pass KV cache. ``offset[k, b]`` is the window
    length n, the rotary position of the chunk's first token; ``phase[b]`` how many chunk tokens slot b
    has read (mirrored on the host, so finding the rows whose chunk is complete needs no device sync).
    """

    states: list[StaircaseState]
    passes: list[DecoderCache]
    offset: Tensor
    pending: Tensor
    pending_valid: Tensor
    phase: Tensor
    host_phase: list[int]

    @property
    def window(self) -> int:
        return self.passes[0].max_len - self.pending.shape[1]


class StaircaseRunner(Runner):
    model: Staircase
    state: StaircaseSlots

    def allocate(self, n_slots: int, max_len: int) -> None:
        """Static decode buffers for ``n_slots`` streams; each starts empty. ``max_len`` is not needed: the
        buffers are bounded by the step size and cache, not the stream length."""
        c, weight = self.model.config, self.model.embed.weight
        width = c.cache_tokens + (c.passes - 1) * c.chunk_size + c.chunk_size
        passes = [DecoderCache(c.n_layer, n_slots, c.n_kv_head, width, c.head_dim, dtype=weight.dtype, device=weight.device)
                  for _ in range(c.passes)]
        ids = torch.zeros(n_slots, c.chunk_size, dtype=torch.long, device=weight.device)
        self.state = StaircaseSlots(
            [None] * n_slots, passes,  # type: ignore[list-item]  # every row's state is set just below
            torch.zeros(c.passes, n_slots, dtype=torch.long, device=weight.device), ids, ids.bool(),
            torch.zeros(n_slots, dtype=torch.long, device=weight.device), [0] * n_slots,
        )
        self._begin_chunks(list(range(n_slots)), self.model.initial_state(n_slots))

    @torch.no_grad()
    def prefill_slot(self, slot: int, prompt: Tensor) -> Tensor:
        """Read ``prompt (P,)`` as a new stream in row ``slot`` (the other rows keep theirs)."""
        logits, _, state = self.model(prompt[None], return_state=True)
        self._begin_chunks([slot], state)
        start = prompt.numel() - prompt.numel() % self.model.config.chunk_size
        if start < prompt.numel():
            rest = prompt[None, start:]
            self._read(rest, torch.ones_like(rest, dtype=torch.bool), rows=slice(slot, slot + 1))
        return logits[0, -1]

    @torch.no_grad()
    def prefill_batch(self, idx: Tensor, token_valid: Tensor) -> Tensor:
        """Left-padded prompts, chunks counted from the padded start (as the forward does)."""
        logits, _, state = self.model(idx, token_valid=token_valid, return_state=True)
        self._begin_chunks(list(range(idx.shape[0])), state)
        start = idx.shape[1] - idx.shape[1] % self.model.config.chunk_size
        if start < idx.shape[1]:
            self._read(idx[:, start:], token_valid[:, start:])
        return logits[:, -1]

    @torch.no_grad()
    def decode_step(self, tokens: Tensor) -> Tensor:
        """Read one token per row through its S / C (or m) passes, each a one-query attention over that
        pass's static window and the chunk so far. Rows whose chunk is now complete advance the recurrence
        one step (their state is replaced) and get the windows of their next chunk, batched over rows whose
        states have one layout (all of them in lock-step generation)."""
        m, slots = self.model, self.state
        h = self._read(tokens[:, None], torch.ones_like(tokens[:, None], dtype=torch.bool))
        groups: dict[tuple[object, ...], list[int]] = {}
        for row, phase in enumerate(slots.host_phase):
            if phase == m.config.chunk_size:
                groups.setdefault(slots.states[row].layout, []).append(row)
        for rows in groups.values():
            index = torch.tensor(rows, device=tokens.device)
            state = StaircaseState.batch([slots.states[row] for row in rows])
            state, _ = m.step(state, m.embed(slots.pending[index]), slots.pending_valid[index])
            self._begin_chunks(rows, state)
        return m.logits(m.norm(h))[:, -1]

    def _begin_chunks(self, rows: list[int], state: StaircaseState) -> None:
        """Give ``rows`` the stream state ``state`` (batch row i for ``rows[i]``) and load their windows for the
        next chunk: what it attends to at each pass besides itself, found by running the flush steps of the
        state. Empties the chunks being written."""
        m, slots = self.model, self.state
        c, current, batch = m.config, state, len(rows)
        for i, row in enumerate(rows):
            slots.states[row] = state.row(i)
        for k, cache in enumerate(slots.passes):
            n_cache = current.cache_valid.shape[1]
            older, older_valid, following = [], current.cache_valid[:, :0], current
            if current.chunks:
                empty = torch.zeros(batch, 0, c.d_model, dtype=m.embed.weight.dtype, device=older_valid.device)
                following, _, layer_states = m.traced_step(current, empty, older_valid)
                older = m.window_keys(layer_states)
                older_valid = torch.cat(current.valid, dim=1)
            n = n_cache + older_valid.shape[1]
            cos, sin = rope_angles(torch.arange(n, device=older_valid.device), c.rotary_dim, c.rope_base)
            cached = [rotate_prefix(kv, cos[:n_cache], sin[:n_cache]) for kv in current.cache] if n_cache else []
            chunks = [rotate_prefix(kv, cos[n_cache:], sin[n_cache:]) for kv in older]
            cache_slots = torch.arange(n_cache, device=older_valid.device)
            chunk_slots = torch.arange(n_cache, n, device=older_valid.device)
            for i, row in enumerate(rows):
                view = cache.row(row)
                view.reset()
                view.mark(cache_slots, current.cache_valid[i : i + 1])
                view.mark(chunk_slots, older_valid[i : i + 1])
                for layer, kv in enumerate(view.layers):
                    if n_cache:
                        kv.write(cache_slots, cached[layer][0][i : i + 1], cached[layer][1][i : i + 1])
                    if older:
                        kv.write(chunk_slots, chunks[layer][0][i : i + 1], chunks[layer][1][i : i + 1])
                slots.offset[k, row] = n
            current = following
        for row in rows:
            slots.pending_valid[row] = False
            slots.phase[row] = slots.host_phase[row] = 0

    def _read(self, ids: Tensor, valid: Tensor, rows: slice = slice(None)) -> Tensor:
        """Append ``ids (B, T)`` to the chunk each of ``rows`` is writing; their final states ``(B, T, d)``."""
        m, slots = self.model, self.state
        c, T = m.config, ids.shape[1]
        phase = slots.phase[rows]
        chunk_slots = phase[:, None] + torch.arange(T, device=ids.device)
        h = m.embed(ids)
        for k, cache in enumerate(slots.passes):
            view = cache if rows == slice(None) else cache.row(rows.start)
            cos, sin = rope_angles(slots.offset[k, rows][:, None] + chunk_slots, c.rotary_dim, c.rope_base)
            h = m.read_pass(h, cos, sin, StepContext(view, slots.window + chunk_slots, token_valid=valid))
        slots.pending[rows].scatter_(1, chunk_slots, ids)
        slots.pending_valid[rows].scatter_(1, chunk_slots, valid)
        slots.phase[rows] += T
        for row in range(len(slots.host_phase))[rows]:
            slots.host_phase[row] += T
        return h
