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
each new token costs one query per pass (:class:`StaircaseDecode`).

Positions are rotary and local to each step's window (cache first, then the chunks in stream order), so
they stay bounded on an endless stream and only relative distances matter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from blockloop.config import StaircaseConfig
from blockloop.models.decoder import LanguageModel
from blockloop.models.recurrent_core import KV, build_core, prefix_kv, rotate_prefix, window_mask
from blockloop.nn.rope import rope_angles


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

    def detach(self) -> StaircaseState:
        """Cut the graph here (truncated BPTT between training segments)."""
        return replace(
            self,
            chunks=tuple(c.detach() for c in self.chunks),
            cache=tuple((k.detach(), v.detach()) for k, v in self.cache),
        )


@dataclass
class StaircaseDecode:
    """Generation state: the stream state at the last complete chunk, and the chunk being written.

    ``windows[k]`` is what the chunk being written attends to at its pass k besides itself: per layer the
    rotated keys/values of the cache and of the older chunks in flight at that step (they never depend on
    the new chunk, so they are computed once per chunk), and their validity. ``written[k]`` holds, per
    layer, the rotated keys/values of the chunk's tokens read so far at pass k: a per-pass KV cache.
    """

    state: StaircaseState
    pending: Tensor
    pending_valid: Tensor
    windows: list[tuple[tuple[KV, ...], Tensor]]
    written: list[list[KV]]


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
    @torch.no_grad()
    def prefill(self, idx: Tensor, token_valid: Tensor, max_new_tokens: int) -> tuple[Tensor, StaircaseDecode]:
        """Read the prompts; keep the state at the last complete chunk and read the partial chunk after it."""
        logits, _, state = self(idx, token_valid=token_valid, return_state=True)
        start = idx.shape[1] - idx.shape[1] % self.config.chunk_size
        decode = self._begin_chunk(state)
        if start < idx.shape[1]:
            self._read(decode, idx[:, start:], token_valid[:, start:])
        return logits[:, -1], decode

    @torch.no_grad()
    def decode_step(self, decode: StaircaseDecode, token: Tensor) -> Tensor:
        """Read ``token`` through its S / C (or m) passes, each a one-query attention over its window.

        When the chunk is complete, the recurrence advances one step (the state is replaced) and the
        windows of the next chunk are computed.
        """
        h = self._read(decode, token[:, None], torch.ones_like(token[:, None], dtype=torch.bool))
        if decode.pending.shape[1] == self.config.chunk_size:
            state, _ = self.step(decode.state, self.embed(decode.pending), decode.pending_valid)
            fresh = self._begin_chunk(state)
            decode.state, decode.pending, decode.pending_valid = fresh.state, fresh.pending, fresh.pending_valid
            decode.windows, decode.written = fresh.windows, fresh.written
        return self.logits(self.norm(h))[:, -1]

    def _begin_chunk(self, state: StaircaseState) -> StaircaseDecode:
        """The windows a new chunk will see at each of its passes: run the flush steps of ``state``."""
        c, windows, current = self.config, [], state
        batch = state.cache_valid.shape[0]
        for _ in range(c.passes):
            n_cache = current.cache_valid.shape[1]
            older, older_valid, following = [], current.cache_valid[:, :0], current
            if current.chunks:
                empty = torch.zeros(batch, 0, c.d_model, dtype=self.embed.weight.dtype, device=older_valid.device)
                following, _, layer_states = self._step(current, empty, older_valid)
                older = [prefix_kv(block, states) for block, states in zip(self.core.blocks, layer_states)]
                older_valid = torch.cat(current.valid, dim=1)
            n = n_cache + older_valid.shape[1]
            cos, sin = rope_angles(torch.arange(n, device=older_valid.device), c.rotary_dim, c.rope_base)
            layers = []
            for layer in range(c.n_layer):
                parts = [rotate_prefix(current.cache[layer], cos[:n_cache], sin[:n_cache])] if n_cache else []
                parts += [rotate_prefix(older[layer], cos[n_cache:], sin[n_cache:])] if older else []
                empty_kv = torch.zeros(batch, c.n_kv_head, 0, c.head_dim, dtype=self.embed.weight.dtype,
                                       device=older_valid.device)
                layers.append(tuple(torch.cat([p[i] for p in parts] or [empty_kv], dim=2) for i in range(2)))
            windows.append((tuple(layers), torch.cat((current.cache_valid, older_valid), dim=1)))
            current = following
        idle = state.cache_valid.new_zeros(batch, 0, dtype=torch.long)
        written = [[(kv[0][:, :, :0], kv[1][:, :, :0]) for kv in window[0]] for window in windows]
        return StaircaseDecode(state, idle, idle.bool(), windows, written)

    def _read(self, decode: StaircaseDecode, ids: Tensor, valid: Tensor) -> Tensor:
        """Append ``ids`` to the chunk being written; their final states ``(B, T, d)``."""
        c = self.config
        h = self.embed(ids)
        for (window, window_valid), written in zip(decode.windows, decode.written):
            seen = torch.cat((window_valid, decode.pending_valid), dim=1)
            start = seen.shape[1]
            cos, sin = rope_angles(torch.arange(start, start + h.shape[1], device=h.device), c.rotary_dim, c.rope_base)
            mask = window_mask(seen, valid)
            for layer, block in enumerate(self.core.blocks):
                new = rotate_prefix(prefix_kv(block, h), cos, sin)
                prefix = tuple(torch.cat((window[layer][i], written[layer][i]), dim=2) for i in range(2))
                h = block(h, cos, sin, mask=mask, prefix=prefix)
                written[layer] = tuple(torch.cat((written[layer][i], new[i]), dim=2) for i in range(2))
        decode.pending = torch.cat((decode.pending, ids), dim=1)
        decode.pending_valid = torch.cat((decode.pending_valid, valid), dim=1)
        return h
