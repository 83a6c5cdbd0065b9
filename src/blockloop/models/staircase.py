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
what the chunk being written attends to at each of its passes (the cache and the older chunks in flight)
does not depend on it, so each new token costs one query per pass. Those windows and the chunk's own
keys/values live in static per-slot buffers bounded by S and the cache (the serving runner's,
:mod:`blockloop.serve.runners.staircase`): a prompt's windows come from its state's flush steps
(:meth:`Staircase.traced_step`, :meth:`Staircase.window_keys`), each new token is one
:meth:`Staircase.read_pass` per pass, and once a chunk is complete the next chunk's windows are the
keys/values its own passes wrote, shifted by one pass, and the cache gains its
:meth:`Staircase.cache_entries`. So the serving engine batches streams continuously: a request is prefilled
into one slot while the others decode.

Positions are rotary and local to each step's window (cache first, then the chunks in stream order), so
they stay bounded on an endless stream and only relative distances matter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from blockloop.models.decoder import LanguageModel
from blockloop.models.prefix_attention import KV
from blockloop.models.recurrent_core import build_core, prefix_kv, rotate_prefix
from blockloop.nn.kv_cache import StepContext
from blockloop.nn.masks import window_mask
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
    # The embedded tokens of a segment's incomplete last chunk (B, p < C, d) and their validity: the stream's
    # chunks are fixed by position, so the next segment reads them again at the head of its first chunk.
    pending: Tensor | None = None
    pending_valid: Tensor | None = None

    @property
    def tokens_in_flight(self) -> int:
        return sum(c.shape[1] for c in self.chunks)

    def detach(self) -> StaircaseState:
        """Cut the graph here (truncated BPTT between training segments)."""
        return replace(
            self,
            chunks=tuple(c.detach() for c in self.chunks),
            cache=tuple((k.detach(), v.detach()) for k, v in self.cache),
            pending=None if self.pending is None else self.pending.detach(),
        )


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
        state, done, _ = self.traced_step(state, x, valid)
        return state, done

    def traced_step(self, state: StaircaseState, x: Tensor, valid: Tensor) -> tuple[StaircaseState, Tensor, list[Tensor]]:
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
            cache = tuple(
                tuple(torch.cat((old, new), dim=2)[:, :, -c.cache_tokens :] for old, new in zip(kv, entry))
                for kv, entry in zip(cache, self.cache_entries(layer_states, done.shape[1]))
            )
            cache_valid = torch.cat((cache_valid, done_valid), dim=1)[:, -c.cache_tokens :]
        rest = StaircaseState(tuple(pieces[1:]), valids[1:], passes[1:], cache, cache_valid)
        return rest, done, layer_states

    def cache_entries(self, layer_states: list[Tensor], length: int) -> list[KV]:
        """Per core layer, the un-rotated keys/values that the first ``length`` states of a window leave in the
        cache after their last pass (``layer_states``: that pass's states entering each layer and leaving the
        last): the finished states (3.2.2), or their Feedback memory (3.3)."""
        cached = self._memory(layer_states, length) if self.config.memory_mix else layer_states[-1][:, :length]
        return [prefix_kv(block, cached) for block in self.core.blocks]

    def _memory(self, layer_states: list[Tensor], length: int) -> Tensor:
        """Feedback memory of the finished chunk: softmax(w)-weighted sum of its states at every layer."""
        weights = torch.softmax(self.memory_weights, dim=0)
        stacked = torch.stack([s[:, :length] for s in layer_states], dim=0)
        return torch.einsum("l,lbtd->btd", weights.to(stacked.dtype), stacked)

    def stream(
        self, x: Tensor, valid: Tensor, state: StaircaseState | None
    ) -> tuple[Tensor, StaircaseState]:
        """Outputs ``(B, T, d)`` for embeddings ``x``, and the state to continue the stream from: the one after
        the last complete chunk, holding the tokens of an incomplete one as ``pending``.

        Chunks still in flight from an earlier segment finish during the first steps, and its pending tokens
        are read again at the head of the first chunk; their outputs were already given by that segment (by
        its flush) and are dropped here. So a stream read in segments cut anywhere gives the logits of one
        long forward.
        """
        C = self.config.chunk_size
        state = self.initial_state(x.shape[0], x.device) if state is None else state
        carried = state.tokens_in_flight
        if state.pending is not None:
            carried += state.pending.shape[1]
            x, valid = torch.cat((state.pending, x), dim=1), torch.cat((state.pending_valid, valid), dim=1)
        outputs, committed = [], state
        for start in range(0, x.shape[1], C):
            state, done = self.step(state, x[:, start : start + C], valid[:, start : start + C])
            outputs.append(done)
            if start + C <= x.shape[1]:
                committed = state
        while state.chunks:  # flush: remaining passes for the chunks in flight, nothing new read
            state, done = self.step(state, x[:, :0], valid[:, :0])
            outputs.append(done)
        tail = x.shape[1] % C
        pending = (x[:, -tail:], valid[:, -tail:]) if tail else (None, None)
        return torch.cat(outputs, dim=1)[:, carried:], replace(committed, pending=pending[0], pending_valid=pending[1])

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
        """Logits for ``idx (B, T)`` continuing ``state`` (None: a new stream); mean loss over the targets that are
        not ``IGNORE_INDEX``.

        ``token_valid (B, T)`` marks real tokens (left padding is never attended to). With
        ``return_state`` the state to continue from comes third (:meth:`stream`); pass it with the next
        segment of the same streams, cut anywhere.
        """
        valid = torch.ones_like(idx, dtype=torch.bool) if token_valid is None else token_valid
        h, new_state = self.stream(self.drop(self.embed(idx)), valid, state)
        logits = self.logits(self.norm(h))
        loss = self.loss(logits, targets)
        return (logits, loss, new_state) if return_state else (logits, loss)

    # ------------------------------------------------------------- generation
    def window_keys(self, layer_states: list[Tensor]) -> list[KV]:
        """Per core layer, the un-rotated keys/values it reads from the states entering it (a traced step's)."""
        return [prefix_kv(block, states) for block, states in zip(self.core.blocks, layer_states)]

    def read_pass(self, h: Tensor, cos: Tensor, sin: Tensor, step: StepContext) -> list[Tensor]:
        """One pass of the core over new tokens ``h (B, T, d)`` written at the step's cache slots, attending to
        what the cache holds (a pass's window and the chunk so far); marks the slots written. Returns the
        states entering each layer and leaving the last (as :meth:`traced_step` does)."""
        mask = step.begin()
        layer_states = [h]
        for layer, block in enumerate(self.core.blocks):
            h = block(h, cos, sin, kv=step.layer(layer), mask=mask)
            layer_states.append(h)
        return layer_states
