"""Block-based double decoder (Alexander et al. 2026, "Block-Based Double Decoders"), section 3.1.

Two stacks share one (tied) token embedding:

* the **context decoder**, a plain causal decoder over the whole input whose final (normed) hidden
  states are the causal latents h_t; it has no LM head;
* the **generation decoder**, whose layers each attend, from the query at position t in block k, to
  (a) the within-block keys: its own K/V of block k's tokens at positions <= t, and
  (b) the cross-block keys: K/V projected (per layer) from the latents h_s of every earlier block m < k,
  in ONE softmax over both key sets: one attention call over the two key sets side by side with one mask
  (:func:`~blockloop.nn.masks.dual_block_mask`, built on the tile grid from the partition). The paper computes
  the two attentions separately and merges their log-sum-exps (:func:`~blockloop.nn.attention.merge_attention`),
  which is the same softmax; the single call trained 1.7-4.5x faster on CPU at T = 256-1024
  (``benchmarks/results/dual_attention_cpu.md``) and is the fused form the paper leaves as future work. A
  query of the first block has no cross keys and simply gets its within-block attention.

Training draws a block partition per batch (:mod:`blockloop.data.partitions`, batched by the family spec);
every token is scored once.
Inference (section 3.3): the context decoder runs once over the prompt but its last token, whose
latents become the cross K/V of every generation layer, computed once; the last prompt token opens the
generation block, and only the generation layers keep a KV cache. That cache holds both key sets of a layer
in one buffer: the cross K/V of context position s at slot s, the generation tokens' own K/V from slot
``P - 1`` on (``P`` the prompt length), so a decode step is one attention over the cache with the cache's
own mask (:meth:`DoubleDecoder.context_pass` writes the cross part). Because both stacks are causal, the
context decoder's cache for a shared prompt prefix can be computed once and reused
(:meth:`DoubleDecoder.cache_prefix`, section 3.3 item 3). The decode state is the serving runner's
(:mod:`blockloop.serve.runners.double_decoder`); it calls :meth:`DoubleDecoder.context_pass` once per
prompt and :meth:`DoubleDecoder.generation_step` once per token. Positions are absolute everywhere (RoPE on
queries, within-block keys and cross keys alike, each key rotated at its own position before it is stored),
so the one attention over the union of keys has consistent relative positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
from torch import Tensor, nn

from blockloop.errors import BlockloopError, check_context
from blockloop.models.decoder import (
    Block,
    CrossKV,
    LanguageModel,
    SelfAttention,
    TransformerStack,
    merge_heads,
    split_heads,
)
from blockloop.nn.attention import attention
from blockloop.nn.kv_cache import DecoderCache, LayerStep, StepContext
from blockloop.nn.linear import Linear
from blockloop.nn.masks import dual_block_mask
from blockloop.nn.paged_cache import KVPages
from blockloop.nn.rope import apply_rope, rope_angles

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

    from blockloop.families.double_decoder import DoubleDecoderConfig


class DualAttention(SelfAttention):
    """Within-block self-attention and cross-block attention to context latents, one joint softmax.

    Six projections per layer (q, k, v, o and the cross k', v'), as counted in appendix A.2. One attention
    call either way: in training the ``cross`` K/V are placed before the layer's own K/V and ``block_mask``
    covers both; in a cached step the layer's cache already holds the cross K/V ahead of its own slots, so
    the cache and its ``mask`` are the two key sets.

    No dropout on the attention weights (FlexAttention, the training path, has none); the residual dropout of
    :class:`Block` still applies, and the context decoder's ordinary self-attention keeps ``dropout``.
    """

    def __init__(self, config: DoubleDecoderConfig) -> None:
        super().__init__(config)
        kv = config.n_kv_head * config.head_dim
        self.cross_kv = Linear(config.d_model, 2 * kv, bias=config.qkv_bias, splits=(kv, kv))

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
        cross: CrossKV | None = None,
        mask: Tensor | None = None,
        block_mask: BlockMask | None = None,
        kv: LayerStep | None = None,
    ) -> Tensor:
        q, k, v = self.project(x, cos, sin, kv)
        if cross is not None:
            k, v = torch.cat((cross[0], k), 2), torch.cat((cross[1], v), 2)
        out = attention(q, k, v, mask=mask, block_mask=block_mask, scale=self.scale)
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
        block_mask = dual_block_mask(boundaries.to(idx.device), length)  # once per batch, shared by every layer
        for layer in self.generation:
            x = layer(x, cos, sin, cross=layer.attn.cross_keys(latents, cos, sin), block_mask=block_mask)
        logits = self.logits(self.norm(x))
        return logits, self.loss(logits, targets)

    # ------------------------------------------------------------ inference
    def allocate_cache(self, n_layer: int, batch_size: int, max_len: int, *, pages: KVPages | None = None) -> DecoderCache:
        """A KV cache for ``n_layer`` layers of either stack (static, or paged over ``pages``)."""
        c, weight = self.config, self.embed.weight
        return DecoderCache(n_layer, batch_size, c.n_kv_head, max_len, c.head_dim, dtype=weight.dtype, device=weight.device,
                            pages=pages)

    @torch.no_grad()
    def cache_prefix(self, tokens: Sequence[int]) -> ContextPrefix:
        """Run the context decoder once over a shared prompt prefix and keep its cache and latents."""
        tokens = list(tokens)
        if not tokens:
            raise BlockloopError("a shared prefix needs at least one token; give a non-empty one, or none")
        device = self.embed.weight.device
        idx = torch.tensor([tokens], device=device)
        slots = torch.arange(len(tokens), device=device)
        cache = self.allocate_cache(self.config.n_context_layer, 1, len(tokens))
        latents = self.context(self.embed(idx), step=StepContext(cache, slots))
        return ContextPrefix(tokens, [layer.k for layer in cache.layers], [layer.v for layer in cache.layers], latents)

    @torch.no_grad()
    def context_pass(
        self, idx: Tensor, token_valid: Tensor, cache: DecoderCache, prefix: ContextPrefix | None = None
    ) -> Tensor:
        """The context decoder over left-padded prompts ``idx (B, P)`` but their last token (after ``prefix``,
        if cached); every generation layer's cross K/V of those ``C`` context positions written into slots
        ``0 .. C-1`` of the generation ``cache`` (rows reset, real context tokens marked visible), where the
        generation tokens' own K/V follow from slot ``C``. Returns the rotary positions ``(B, P)`` of the prompt
        tokens, which count real tokens only so that a row's positions do not depend on its padding."""
        batch, length = idx.shape
        device = idx.device
        start = len(prefix) if prefix is not None else 0
        context_len = start + length - 1
        positions = start + (token_valid.long().cumsum(1) - 1).clamp_min(0)
        context = self.allocate_cache(self.config.n_context_layer, batch, context_len)
        if prefix is not None:
            prefix_slots = torch.arange(start, device=device)
            for layer, k, v in zip(context.layers, prefix.keys, prefix.values):
                layer.write(prefix_slots, k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1))
            context.mark(prefix_slots)
        latents = [prefix.latents.expand(batch, -1, -1)] if prefix is not None else []
        if length > 1:
            step = StepContext(context, torch.arange(start, context_len, device=device), positions[:, :-1], token_valid[:, :-1])
            latents.append(self.context(self.embed(idx[:, :-1]), step=step))
        cache.reset()
        if latents:
            latents = torch.cat(latents, 1)
            context_positions = torch.cat([torch.arange(start, device=device).expand(batch, -1), positions[:, :-1]], 1)
            cos, sin = rope_angles(context_positions, self.config.rotary_dim, self.config.rope_base)
            slots = torch.arange(context_len, device=device)
            for layer, cache_layer in zip(self.generation, cache.layers):
                cache_layer.write(slots, *layer.attn.cross_keys(latents, cos, sin))
            cache.mark(slots, context.key_valid)
        return positions

    def generation_step(self, tokens: Tensor, step: StepContext) -> Tensor:
        """One token per row ``tokens (B,)`` through the generation decoder only, each layer one attention over
        its cache (the row's cross K/V and its generation tokens' K/V); the next-token logits ``(B, V)``."""
        cos, sin = rope_angles(step.token_positions, self.config.rotary_dim, self.config.rope_base)
        mask = step.begin()
        x = self.embed(tokens[:, None])
        for i, block in enumerate(self.generation):
            x = block(x, cos, sin, mask=mask, kv=step.layer(i))
        return self.logits(self.norm(x))[:, -1]
