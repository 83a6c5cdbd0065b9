"""Ladder (Ju et al. 2022, section 3.2.4, Figure 1d), Universal Transformer and Transformer-XL.

The Ladder feeds the whole segment at once and applies the shared core ``n_steps`` times, each application
reading the previous one's output: recurrence in depth only. The execution order over the shared layers
is the Table 4 pattern: ``abab`` repeats the core, ``aabb`` repeats each layer before the next. A core of
one layer is the Universal Transformer (section 3.3); one step is the plain transformer.

For long streams the paper uses Transformer-XL's techniques (section 3.2.4): each token attends to a fixed
number of previous tokens (``memory_len`` M, the attention span), and the states each layer application
read in earlier segments are kept in a memory that later segments attend to (keys/values only, recomputed
from the stored states with rotary positions local to the window). Since the span is fixed per token, a
stream read in segments gives exactly the logits of one long forward; one step with a memory is the
Transformer-XL baseline (Dai et al. 2019).

Generation writes every application's keys/values into a :class:`~blockloop.nn.kv_cache.DecoderCache`
(one layer slot per application) and is served by the vanilla decoder's runner
(:mod:`blockloop.serve.runners.decoder`), which only calls :meth:`Ladder.forward` with a step and
:meth:`Ladder.allocate_cache`. With a memory, every application's cache is a ring of the M + 1 slots a query
sees (:class:`~blockloop.nn.kv_cache.RollingKVCache`), so a generating row holds O(M) keys whatever its length,
and, its positions being rotary (only their differences enter a score), it reads on past the training context
as the segment forward does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from blockloop.errors import check_context
from blockloop.models.decoder import LanguageModel
from blockloop.models.recurrent_core import build_core, prefix_kv, rotate_prefix
from blockloop.nn.kv_cache import DecoderCache, StepContext
from blockloop.nn.masks import window_mask
from blockloop.nn.paged_cache import KVPages
from blockloop.nn.rope import rope_angles

if TYPE_CHECKING:
    from blockloop.families.ladder import LadderConfig


@dataclass(frozen=True)
class LadderState:
    """Per layer application: the inputs it read for the last (up to) M tokens of the stream, and their validity."""

    memory: tuple[Tensor, ...]
    valid: Tensor

    def detach(self) -> LadderState:
        return LadderState(tuple(m.detach() for m in self.memory), self.valid)


class Ladder(LanguageModel):
    """Embedding -> the core applied n_steps times (ABAB or AABB) -> final norm -> LM head."""

    def __init__(self, config: LadderConfig) -> None:
        super().__init__(config, core=build_core(config))
        self.order = config.execution_order
        self.streams = bool(config.memory_len)  # rings of the span, rotary positions (allocate_cache)

    def segment(self, x: Tensor, valid: Tensor, state: LadderState | None) -> tuple[Tensor, LadderState | None]:
        """Outputs ``(B, T, d)`` of a segment after ``state``'s memory, and the memory for the next segment."""
        span = self.config.memory_len or None
        memory = state.memory if state is not None else ()
        memory_valid = state.valid if state is not None else valid[:, :0]
        P = memory_valid.shape[1]
        cos, sin = rope_angles(torch.arange(P + x.shape[1], device=x.device), self.config.rotary_dim, self.config.rope_base)
        mask = window_mask(memory_valid, valid, span)
        h, new_memory = x, []
        for application, layer in enumerate(self.order):
            block = self.core.blocks[layer]
            prefix = rotate_prefix(prefix_kv(block, memory[application]), cos[:P], sin[:P]) if P else None
            if span:
                new_memory.append(torch.cat((memory[application], h), dim=1)[:, -span:] if P else h[:, -span:])
            h = block(h, cos[P:], sin[P:], mask=mask, prefix=prefix)
        if not span:
            return h, None
        return h, LadderState(tuple(new_memory), torch.cat((memory_valid, valid), dim=1)[:, -span:])

    def _cached(self, x: Tensor, step: StepContext) -> Tensor:
        cos, sin = rope_angles(step.token_positions, self.config.rotary_dim, self.config.rope_base)
        mask = step.begin_rings() if step.cache.rolling else step.begin()  # a memory: every entry a ring of its span
        for application, layer in enumerate(self.order):
            x = self.core.blocks[layer](x, cos, sin, kv=step.layer(application), mask=mask)
        return x

    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        *,
        state: LadderState | None = None,
        token_valid: Tensor | None = None,
        return_state: bool = False,
        step: StepContext | None = None,
        last_only: bool = False,
    ) -> tuple[Tensor, Tensor | None] | tuple[Tensor, Tensor | None, LadderState | None]:
        """Logits for ``idx (B, T)`` after ``state`` (None: a new stream), loss over targets not ``IGNORE_INDEX``.

        With ``return_state`` the memory for the next segment comes third (None without a memory). With a
        ``step`` the tokens are written at its cache slots instead (generation, see Decoder.forward).
        """
        x = self.drop(self.embed(idx))
        new_state = None
        if step is not None:
            h = self._cached(x, step)
        else:
            check_context(idx.shape[1], self.config.context_length, "segment")
            valid = torch.ones_like(idx, dtype=torch.bool) if token_valid is None else token_valid
            h, new_state = self.segment(x, valid, state)
        h = self.norm(h)
        logits = self.logits(h[:, -1:] if last_only else h)
        loss = self.loss(logits, targets)
        return (logits, loss, new_state) if return_state else (logits, loss)

    def allocate_cache(self, batch_size: int, max_len: int, *, pages: KVPages | None = None) -> DecoderCache:
        """One KV cache with a layer slot per application of a core layer: ``max_len`` slots (or pages), or with a
        memory a ring of the ``memory_len + 1`` slots each query sees (itself and the M before it)."""
        c, weight = self.config, self.embed.weight
        rolling = range(len(self.order)) if c.memory_len else ()
        return DecoderCache(len(self.order), batch_size, c.n_kv_head, max_len, c.head_dim, dtype=weight.dtype,
                            device=weight.device, pages=pages, rolling=rolling, window=c.memory_len + 1)
