"""Staircase attention (Ju et al. 2022, section 3.2): Staircase, Cached, Global Cached, and Feedback Transformer.

One step of the staircase (section 3.2.1, Figure 1a) runs the shared core over the chunks in flight,
oldest first: the backward tokens (chunks read in earlier steps, each carrying the state its last pass
left) and the C new forward tokens. A chunk that has now had all its passes (S / C, or m with a cache)
leaves the window: its state is the token's output, h^N -> final norm -> LM head. Chunks are causal
within the window, so a token's state never depends on a later token: the output of a token is a function
of the tokens up to it, whether the stream continues or not.

Cached Staircase (3.2.2, Figure 1b): a finished state joins a cache of the most recent ``S - m C``
finished tokens; every layer of every later step attends to it through its own key/value projection, and
the cache gets no other compute. Global Cached Staircase (3.2.3, Figure 1c): the cache keeps every prior
state (up to the context length). With ``memory_mix`` the cached state is a learned softmax mix of the
layers' states (embedding included); with C = 1 and m = 1 that is the Feedback Transformer (Fan et al.
2020; staircase paper section 3.3), processed token by token.

**Segments and state.** :meth:`Staircase.forward` reads a segment chunk by chunk and then runs extra
"flush" steps that ingest nothing, so the last chunks get their remaining passes and every token of the
segment has an output. The state returned is the one before the flush (backward chunks and cache), so the
next segment continues the recurrence exactly: a stream read in segments gives the logits of one long
forward (truncated BPTT detaches it between training steps). Streaming generation uses the same property:
it keeps the state at the last complete chunk; what the chunk being written attends to at each of its passes
(the cache and the older chunks in flight) does not depend on it, so it is computed once per chunk, and
each new token costs one query per pass. Those windows and the chunk's own keys/values live in static
per-slot buffers (:class:`StaircaseSlots`, bounded by S and the cache, written at explicit slots), so the
serving engine batches streams continuously: a request is prefilled into one slot while the others decode.

Positions are rotary and local to each step's window (cache first, then the chunks in stream order), so
they stay bounded on an endless stream and only relative distances matter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from blockloop.models.decoder import LanguageModel
from blockloop.models.recurrent_core import KV, build_core, prefix_kv, rotate_prefix, window_mask
from blockloop.nn.kv_cache import DecoderCache
from blockloop.nn.rope import rope_angles

if TYPE_CHECKING:
    from blockloop.families.staircase import StaircaseConfig


@dataclass(frozen=True)
class StaircaseState:
    """What carries from one step to the next, per stream (batch row).

    ``chunks``: hidden states of the chunks still in flight, oldest first, with their validity masks and
    how many passes each has had. ``cache``: per core layer, un-rotated keys/values of finished states
    (Cached variants), with ``cache_valid``.
    """

    chunks: tuple[Tensor, ...]
    valid: tuple[Tensor, ...]
    passes: tuple[int, ...]
    cache: tuple[KV, ...]
    cache_valid: Tensor

    @property
    def tokens_in_flight(self) -> int:
        return sum(c.shape[1] for c in self.chunks)

    @property
    def layout(self) -> tuple[object, ...]:
        """What must agree for two streams' states to be stepped as one batch."""
        return self.passes, tuple(c.shape[1] for c in self.chunks), self.cache_valid.shape[1]

    def row(self, index: int) -> StaircaseState:
        """Stream ``index`` as a batch of one."""
        pick = slice(index, index + 1)
        return StaircaseState(tuple(c[pick] for c in self.chunks), tuple(v[pick] for v in self.valid), self.passes,
                              tuple((k[pick], v[pick]) for k, v in self.cache), self.cache_valid[pick])

    @staticmethod
    def batch(states: list[StaircaseState]) -> StaircaseState:
        """Streams of one layout as one batch (the inverse of :meth:`row`)."""
        first = states[0]
        cat = lambda tensors: torch.cat(list(tensors), dim=0)  # noqa: E731
        return StaircaseState(
            tuple(cat(s.chunks[i] for s in states) for i in range(len(first.chunks))),
            tuple(cat(s.valid[i] for s in states) for i in range(len(first.valid))), first.passes,
            tuple((cat(s.cache[i][0] for s in states), cat(s.cache[i][1] for s in states)) for i in range(len(first.cache))),
            cat(s.cache_valid for s in states),
        )

    def detach(self) -> StaircaseState:
        """Cut the graph here (truncated BPTT between training segments)."""
        return replace(
            self,
            chunks=tuple(c.detach() for c in self.chunks),
            cache=tuple((k.detach(), v.detach()) for k, v in self.cache),
        )


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


class Staircase(LanguageModel):
    """Embedding -> staircase over the shared core -> final norm -> LM head (tied to the embedding if set)."""

    def __init__(self, config: StaircaseConfig) -> None:
        super().__init__(config, core=build_core(config))
        if config.memory_mix:
            # Feedback Transformer: memory m_t = sum_l softmax(w)_l h^l_t over the embedding and every layer.
            self.memory_weights = nn.Parameter(torch.zeros(config.n_layer + 1))

    # ------------------------------------------------------------------ state
    def initial_state(self, batch_size: int, device: torch.device | None = None) -> StaircaseState:
        """An empty stream: nothing in flight, an empty cache."""
        device = device or self.embed.weight.device
        c, dtype = self.config, self.embed.weight.dtype
        empty = torch.zeros(batch_size, c.n_kv_head, 0, c.head_dim, dtype=dtype, device=device)
        cache = tuple((empty, empty) for _ in range(c.n_layer)) if c.cache_after else ()
        return StaircaseState((), (), (), cache, torch.zeros(batch_size, 0, dtype=torch.bool, device=device))

    def step(self, state: StaircaseState, x: Tensor, valid: Tensor) -> tuple[StaircaseState, Tensor]:
        """One staircase step: the core over [chunks in flight, new chunk ``x``]; returns the finished states.

        ``x (B, c, d)`` with c <= C (c = 0 for a flush step). The finished chunk (if any) is returned as
        ``(B, c', d)`` and, in the cached variants, moved into the cache.
        """
        state, done, _ = self._step(state, x, valid)
        return state, done

    def _step(self, state: StaircaseState, x: Tensor, valid: Tensor) -> tuple[StaircaseState, Tensor, list[Tensor]]:
        """:meth:`step`, also returning the window's states entering each layer (and leaving the last)."""
        c = self.config
        chunks, valids, passes = state.chunks, state.valid, state.passes
        if x.shape[1]:
            chunks, valids, passes = chunks + (x,), valids + (valid,), passes + (0,)
        passes = tuple(p + 1 for p in passes)
        h, h_valid = torch.cat(chunks, dim=1), torch.cat(valids, dim=1)
        n_cache = state.cache_valid.shape[1]
        cos, sin = rope_angles(torch.arange(n_cache + h.shape[1], device=h.device), c.rotary_dim, c.rope_base)
        mask = window_mask(state.cache_valid, h_valid)
        layer_states = [h]
        for layer, block in enumerate(self.core.blocks):
            prefix = rotate_prefix(state.cache[layer], cos[:n_cache], sin[:n_cache]) if n_cache else None
            h = block(h, cos[n_cache:], sin[n_cache:], mask=mask, prefix=prefix)
            layer_states.append(h)
        pieces = list(torch.split(h, [t.shape[1] for t in chunks], dim=1))
        if passes[0] < c.passes:
            return StaircaseState(tuple(pieces), valids, passes, state.cache, state.cache_valid), h[:, :0], layer_states
        done, done_valid = pieces[0], valids[0]
        cache, cache_valid = state.cache, state.cache_valid
        if c.cache_after:
            cached = self._memory(layer_states, done.shape[1]) if c.memory_mix else done
            cache = tuple(
                tuple(torch.cat((old, new), dim=2)[:, :, -c.cache_tokens :] for old, new in zip(kv, prefix_kv(block, cached)))
                for kv, block in zip(cache, self.core.blocks)
            )
            cache_valid = torch.cat((cache_valid, done_valid), dim=1)[:, -c.cache_tokens :]
        rest = StaircaseState(tuple(pieces[1:]), valids[1:], passes[1:], cache, cache_valid)
        return rest, done, layer_states

    def _memory(self, layer_states: list[Tensor], length: int) -> Tensor:
        """Feedback memory of the finished chunk: softmax(w)-weighted sum of its states at every layer."""
        weights = torch.softmax(self.memory_weights, dim=0)
        stacked = torch.stack([s[:, :length] for s in layer_states], dim=0)
        return torch.einsum("l,lbtd->btd", weights.to(stacked.dtype), stacked)

    def stream(
        self, x: Tensor, valid: Tensor, state: StaircaseState | None
    ) -> tuple[Tensor, StaircaseState]:
        """Outputs ``(B, T, d)`` for embeddings ``x``, and the state after the last complete chunk.

        Chunks still in flight from an earlier segment finish during the first steps; their outputs were
        already given by that segment's flush and are dropped here.
        """
        C = self.config.chunk_size
        state = self.initial_state(x.shape[0], x.device) if state is None else state
        carried = state.tokens_in_flight
        outputs, committed = [], state
        for start in range(0, x.shape[1], C):
            state, done = self.step(state, x[:, start : start + C], valid[:, start : start + C])
            outputs.append(done)
            if start + C <= x.shape[1]:
                committed = state
        while state.chunks:  # flush: remaining passes for the chunks in flight, nothing new read
            state, done = self.step(state, x[:, :0], valid[:, :0])
            outputs.append(done)
        return torch.cat(outputs, dim=1)[:, carried:], committed

    # ---------------------------------------------------------------- forward
    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        *,
        state: StaircaseState | None = None,
        token_valid: Tensor | None = None,
        return_state: bool = False,
    ) -> tuple[Tensor, Tensor | None] | tuple[Tensor, Tensor | None, StaircaseState]:
        """Logits for ``idx (B, T)`` continuing ``state`` (None: a new stream); mean loss over targets != -100.

        ``token_valid (B, T)`` marks real tokens (left padding is never attended to). With
        ``return_state`` the state after the last complete chunk comes third; pass it with the next
        segment of the same streams.
        """
        valid = torch.ones_like(idx, dtype=torch.bool) if token_valid is None else token_valid
        h, new_state = self.stream(self.drop(self.embed(idx)), valid, state)
        logits = self.logits(self.norm(h))
        loss = self.loss(logits, targets)
        return (logits, loss, new_state) if return_state else (logits, loss)

    # ------------------------------------------------------------- generation
    def allocate_slots(self, n_slots: int, max_len: int | None = None) -> StaircaseSlots:
        """Static decode buffers for ``n_slots`` streams; each starts empty. ``max_len`` is not needed:
        the buffers are bounded by the step size and cache, not the stream length."""
        c, weight = self.config, self.embed.weight
        width = c.cache_tokens + (c.passes - 1) * c.chunk_size + c.chunk_size
        passes = [DecoderCache(c.n_layer, n_slots, c.n_kv_head, width, c.head_dim, dtype=weight.dtype, device=weight.device)
                  for _ in range(c.passes)]
        ids = torch.zeros(n_slots, c.chunk_size, dtype=torch.long, device=weight.device)
        slots = StaircaseSlots(
            [None] * n_slots, passes,  # type: ignore[list-item]  # every row's state is set just below
            torch.zeros(c.passes, n_slots, dtype=torch.long, device=weight.device), ids, ids.bool(),
            torch.zeros(n_slots, dtype=torch.long, device=weight.device), [0] * n_slots,
        )
        self._begin_chunks(slots, list(range(n_slots)), self.initial_state(n_slots))
        return slots

    @torch.no_grad()
    def prefill_slot(self, slots: StaircaseSlots, slot: int, prompt: Tensor) -> Tensor:
        """Read ``prompt (P,)`` as a new stream in row ``slot`` (the other rows keep theirs); logits ``(V,)``."""
        logits, _, state = self(prompt[None], return_state=True)
        self._begin_chunks(slots, [slot], state)
        start = prompt.numel() - prompt.numel() % self.config.chunk_size
        if start < prompt.numel():
            rest = prompt[None, start:]
            self._read(slots, rest, torch.ones_like(rest, dtype=torch.bool), rows=slice(slot, slot + 1))
        return logits[0, -1]

    @torch.no_grad()
    def prefill(self, idx: Tensor, token_valid: Tensor, max_new_tokens: int) -> tuple[Tensor, StaircaseSlots]:
        """Lock-step prefill of left-padded prompts (chunks counted from the padded start, as the forward does)."""
        logits, _, state = self(idx, token_valid=token_valid, return_state=True)
        slots = self.allocate_slots(idx.shape[0])
        self._begin_chunks(slots, list(range(idx.shape[0])), state)
        start = idx.shape[1] - idx.shape[1] % self.config.chunk_size
        if start < idx.shape[1]:
            self._read(slots, idx[:, start:], token_valid[:, start:])
        return logits[:, -1], slots

    @torch.no_grad()
    def decode_step(self, slots: StaircaseSlots, token: Tensor) -> Tensor:
        """Read one token per row through its S / C (or m) passes, each a one-query attention over that
        pass's static window and the chunk so far. Rows whose chunk is now complete advance the recurrence
        one step (their state is replaced) and get the windows of their next chunk, batched over rows whose
        states have one layout (all of them in lock-step generation)."""
        h = self._read(slots, token[:, None], torch.ones_like(token[:, None], dtype=torch.bool))
        groups: dict[tuple[object, ...], list[int]] = {}
        for row, phase in enumerate(slots.host_phase):
            if phase == self.config.chunk_size:
                groups.setdefault(slots.states[row].layout, []).append(row)
        for rows in groups.values():
            index = torch.tensor(rows, device=token.device)
            state = StaircaseState.batch([slots.states[row] for row in rows])
            state, _ = self.step(state, self.embed(slots.pending[index]), slots.pending_valid[index])
            self._begin_chunks(slots, rows, state)
        return self.logits(self.norm(h))[:, -1]

    def _begin_chunks(self, slots: StaircaseSlots, rows: list[int], state: StaircaseState) -> None:
        """Give ``rows`` the stream state ``state`` (batch row i for ``rows[i]``) and load their windows for the
        next chunk: what it attends to at each pass besides itself, found by running the flush steps of the
        state. Empties the chunks being written."""
        c, current, batch = self.config, state, len(rows)
        for i, row in enumerate(rows):
            slots.states[row] = state.row(i)
        for k, cache in enumerate(slots.passes):
            n_cache = current.cache_valid.shape[1]
            older, older_valid, following = [], current.cache_valid[:, :0], current
            if current.chunks:
                empty = torch.zeros(batch, 0, c.d_model, dtype=self.embed.weight.dtype, device=older_valid.device)
                following, _, layer_states = self._step(current, empty, older_valid)
                older = [prefix_kv(block, states) for block, states in zip(self.core.blocks, layer_states)]
                older_valid = torch.cat(current.valid, dim=1)
            n = n_cache + older_valid.shape[1]
            cos, sin = rope_angles(torch.arange(n, device=older_valid.device), c.rotary_dim, c.rope_base)
            cached = [rotate_prefix(kv, cos[:n_cache], sin[:n_cache]) for kv in current.cache] if n_cache else []
            chunks = [rotate_prefix(kv, cos[n_cache:], sin[n_cache:]) for kv in older]
            for i, row in enumerate(rows):
                view = cache.row(row)
                view.reset()
                view.key_valid[:, :n_cache] = current.cache_valid[i]
                view.key_valid[:, n_cache:n] = older_valid[i]
                for layer, kv in enumerate(view.layers):
                    if n_cache:
                        kv.k[:, :, :n_cache], kv.v[:, :, :n_cache] = cached[layer][0][i], cached[layer][1][i]
                    if older:
                        kv.k[:, :, n_cache:n], kv.v[:, :, n_cache:n] = chunks[layer][0][i], chunks[layer][1][i]
                slots.offset[k, row] = n
            current = following
        for row in rows:
            slots.pending_valid[row] = False
            slots.phase[row] = slots.host_phase[row] = 0

    def _read(self, slots: StaircaseSlots, ids: Tensor, valid: Tensor, rows: slice = slice(None)) -> Tensor:
        """Append ``ids (B, T)`` to the chunk each of ``rows`` is writing; their final states ``(B, T, d)``."""
        c, T = self.config, ids.shape[1]
        phase = slots.phase[rows]
        chunk_slots = phase[:, None] + torch.arange(T, device=ids.device)
        h = self.embed(ids)
        for k, cache in enumerate(slots.passes):
            view = cache if rows == slice(None) else cache.row(rows.start)
            cos, sin = rope_angles(slots.offset[k, rows][:, None] + chunk_slots, c.rotary_dim, c.rope_base)
            cache_slots = slots.window + chunk_slots
            mask = view.attention_mask(cache_slots, valid)
            for layer, block in enumerate(self.core.blocks):
                h = block(h, cos, sin, cache=view.layers[layer], slots=cache_slots, mask=mask)
        slots.pending[rows].scatter_(1, chunk_slots, ids)
        slots.pending_valid[rows].scatter_(1, chunk_slots, valid)
        slots.phase[rows] += T
        indices = range(len(slots.host_phase))[rows]
        for row in indices:
            slots.host_phase[row] += T
        return h
