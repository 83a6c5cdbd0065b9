"""Block-based double decoder (Alexander et al. 2026, "Block-Based Double Decoders"), section 3.1.

Two stacks share one (tied) token embedding:

* the **context decoder**, a plain causal decoder over the whole input whose final (normed) hidden
  states are the causal latents h_t; it has no LM head;
* the **generation decoder**, whose layers each attend, from the query at position t in block k, to
  (a) the within-block keys: its own K/V of block k's tokens at positions <= t, and
  (b) the cross-block keys: K/V projected (per layer) from the latents h_s of every earlier block m < k,
  in ONE softmax over both key sets. As the paper does, the two attentions are computed separately and
  merged with their log-sum-exps, which is exactly the joint softmax (:func:`merge_attention`); a query
  of the first block has no cross keys and simply gets its within-block attention.

Training draws a block partition per batch (:mod:`blockloop.data.partitions`, batched by the family spec);
every token is scored once.
Inference (section 3.3): the context decoder runs once over the prompt but its last token, whose
latents become the cross K/V of every generation layer, computed once; the last prompt token opens the
generation block, and only the generation layers keep a KV cache. Because both stacks are causal, the
context decoder's cache for a shared prompt prefix can be computed once and reused
(:meth:`DoubleDecoder.cache_prefix`, section 3.3 item 3). The decode state is the serving runner's
(:mod:`blockloop.serve.runners.double_decoder`); it calls :meth:`DoubleDecoder.context_pass` once per
prompt and :meth:`DoubleDecoder.generation_step` once per token. Positions are absolute everywhere (RoPE on
queries, within-block keys and cross keys alike), so the merged attention is one attention over the
union of keys with consistent relative positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
from torch import Tensor, nn

from blockloop.errors import check_context
from blockloop.models.decoder import (
    Block,
    CrossKV,
    LanguageModel,
    SelfAttention,
    TransformerStack,
    merge_heads,
    split_heads,
)
from blockloop.nn.attention import attention, merge_attention
from blockloop.nn.kv_cache import DecoderCache, LayerStep, StepContext
from blockloop.nn.masks import block_masks
from blockloop.nn.rope import apply_rope, rope_angles

if TYPE_CHECKING:
    from blockloop.families.double_decoder import DoubleDecoderConfig


class DualAttention(SelfAttention):
    """Within-block self-attention and cross-block attention to context latents, one joint softmax.

    Six projections per layer (q, k, v, o and the cross k', v'), as counted in appendix A.2.
    """

    def __init__(self, config: DoubleDecoderConfig) -> None:
        super().__init__(config)
        self.cross_kv = nn.Linear(config.d_model, 2 * config.n_kv_head * config.head_dim, bias=config.bias)

    def cross_keys(self, latents: Tensor, cos: Tensor, sin: Tensor) -> CrossKV:
        """Keys (rotated at the latents' positions) and values projected from context latents h."""
        k, v = self.cross_kv(latents).chunk(2, dim=-1)
        k, v = split_heads(k, self.n_kv_head, self.head_dim), split_heads(v, self.n_kv_head, self.head_dim)
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        *,
        cross: CrossKV,
        cross_mask: Tensor,
        mask: Tensor,
        kv: LayerStep | None = None,
    ) -> Tensor:
        q, k, v = self.project(x, cos, sin, kv)
        within = attention(q, k, v, mask=mask, return_lse=True)
        across = attention(q, *cross, mask=cross_mask, return_lse=True)
        out, _ = merge_attention(*within, *across)
        return self.proj(merge_heads(out))


@dataclass
class ContextPrefix:
    """The context decoder's cache for a prompt prefix shared by many requests (batch of one).

    ``keys``/``values`` are per context layer ``(1, H_kv, S, D)``; ``latents`` are h ``(1, S, d)``. By
    double causality none of it depends on what follows the prefix, so it is valid for any suffix.
    """

    tokens: list[int]
    keys: list[Tensor]
    values: list[Tensor]
    latents: Tensor

    def __len__(self) -> int:
        return len(self.tokens)


class DoubleDecoder(LanguageModel):
    """Shared embedding -> context decoder -> latents h; embedding + h -> generation decoder -> tied head."""

    def __init__(self, config: DoubleDecoderConfig) -> None:
        super().__init__(
            config,
            context=TransformerStack(config.stack(config.n_context_layer)),
            generation=nn.ModuleList(Block(config, DualAttention) for _ in range(config.n_generation_layer)),
        )

    def forward(
        self, idx: Tensor, targets: Tensor | None = None, *, boundaries: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Logits for every position of ``idx (B, T)`` under the partition ``boundaries (K + 1,)``.

        Without ``boundaries`` the window is one block (the generation decoder alone, no context).
        """
        length = idx.shape[1]
        check_context(length, self.config.context_length, "sequence")
        if boundaries is None:
            boundaries = torch.tensor([0, length], device=idx.device)
        cos, sin = rope_angles(torch.arange(length, device=idx.device), self.config.rotary_dim, self.config.rope_base)
        x = self.drop(self.embed(idx))
        latents = self.context(x)  # the context decoder: causal latents h_t (final norm applied, no head)
        within, cross = block_masks(boundaries.to(idx.device), length)
        cross_kv = [layer.attn.cross_keys(latents, cos, sin) for layer in self.generation]
        logits = self._generate(x, cos, sin, cross_kv, cross, mask=within)
        return logits, self.loss(logits, targets)

    def _generate(self, x: Tensor, cos: Tensor, sin: Tensor, cross: list[CrossKV], cross_mask: Tensor, *,
                  mask: Tensor, step: StepContext | None = None) -> Tensor:
        """The generation decoder from token embeddings ``x`` to logits (muP readout multiplier applied)."""
        for i, block in enumerate(self.generation):
            kv = step.layer(i) if step is not None else None
            x = block(x, cos, sin, cross=cross[i], cross_mask=cross_mask, mask=mask, kv=kv)
        return self.logits(self.norm(x))

    # ------------------------------------------------------------ inference
    def allocate_cache(self, n_layer: int, batch_size: int, max_len: int) -> DecoderCache:
        """A static KV cache for ``n_layer`` layers of either stack."""
        c, weight = self.config, self.embed.weight
        return DecoderCache(n_layer, batch_size, c.n_kv_head, max_len, c.head_dim, dtype=weight.dtype, device=weight.device)

    @torch.no_grad()
    def cache_prefix(self, tokens: Sequence[int]) -> ContextPrefix:
        """Run the context decoder once over a shared prompt prefix and keep its cache and latents."""
        tokens = list(tokens)
        if not tokens:
            raise ValueError("a prefix needs at least one token")
        device = self.embed.weight.device
        idx = torch.tensor([tokens], device=device)
        slots = torch.arange(len(tokens), device=device)
        cache = self.allocate_cache(self.config.n_context_layer, 1, len(tokens))
        latents = self.context(self.embed(idx), step=StepContext(cache, slots))
        return ContextPrefix(tokens, [layer.k for layer in cache.layers], [layer.v for layer in cache.layers], latents)

    @torch.no_grad()
    def context_pass(
        self, idx: Tensor, token_valid: Tensor, prefix: ContextPrefix | None = None
    ) -> tuple[list[CrossKV], Tensor, Tensor]:
        """The context decoder over left-padded prompts ``idx (B, P)`` but their last token (after
        ``prefix``, if cached): every generation layer's cross K/V, their key mask ``(B, 1, 1, S)``, and
        the rotary positions ``(B, P)`` of the prompt tokens, which count real tokens only so that a row's
        positions do not depend on its padding."""
        batch, length = idx.shape
        device = idx.device
        start = len(prefix) if prefix is not None else 0
        context_len = start + length - 1
        positions = start + (token_valid.long().cumsum(1) - 1).clamp_min(0)
        cache = self.allocate_cache(self.config.n_context_layer, batch, context_len)
        if prefix is not None:
            prefix_slots = torch.arange(start, device=device)
            for layer, k, v in zip(cache.layers, prefix.keys, prefix.values):
                layer.write(prefix_slots, k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1))
            cache.mark(prefix_slots)
        latents = [prefix.latents.expand(batch, -1, -1)] if prefix is not None else []
        if length > 1:
            step = StepContext(cache, torch.arange(start, context_len, device=device), positions[:, :-1], token_valid[:, :-1])
            latents.append(self.context(self.embed(idx[:, :-1]), step=step))
        latents = torch.cat(latents, 1) if latents else self.embed.weight.new_zeros(batch, 0, self.config.d_model)
        context_positions = torch.cat([torch.arange(start, device=device).expand(batch, -1), positions[:, :-1]], 1)
        cos, sin = rope_angles(context_positions, self.config.rotary_dim, self.config.rope_base)
        cross = [layer.attn.cross_keys(latents, cos, sin) for layer in self.generation]
        return cross, cache.key_valid[:, None, None, :].clone(), positions

    def generation_step(self, tokens: Tensor, step: StepContext, cross: list[CrossKV], cross_mask: Tensor) -> Tensor:
        """One token per row ``tokens (B,)`` through the generation decoder only (its cache + the fixed cross
        K/V); the next-token logits ``(B, V)``."""
        cos, sin = rope_angles(step.token_positions, self.config.rotary_dim, self.config.rope_base)
        mask = step.begin()
        return self._generate(self.embed(tokens[:, None]), cos, sin, cross, cross_mask, mask=mask, step=step)[:, -1]
