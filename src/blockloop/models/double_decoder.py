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
(:meth:`DoubleDecoder.cache_prefix`, section 3.3 item 3). Positions are absolute everywhere (RoPE on
queries, within-block keys and cross keys alike), so the merged attention is one attention over the
union of keys with consistent relative positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
from torch import Tensor, nn

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
from blockloop.nn.kv_cache import DecoderCache, KVCache
from blockloop.nn.rope import apply_rope, rope_angles

if TYPE_CHECKING:
    from blockloop.families.double_decoder import DoubleDecoderConfig


def block_ids(boundaries: Tensor, positions: Tensor) -> Tensor:
    """The block k with b_k <= position < b_{k+1}, for each position."""
    return torch.bucketize(positions, boundaries.to(positions.device), right=True) - 1


def block_masks(boundaries: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """The generation decoder's two ``(T, T)`` masks (True = may attend), section 3.1:

    * within-block: key in the query's block at a position <= the query's (causal self-attention);
    * cross-block: key in an earlier block (the context latents h_s of blocks m < k).

    They are disjoint and together never reach a key after the query: no token sees the future.
    """
    positions = torch.arange(length, device=boundaries.device)
    block = block_ids(boundaries, positions)
    within = (block[:, None] == block[None, :]) & (positions[:, None] >= positions[None, :])
    cross = block[None, :] < block[:, None]
    return within, cross


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
        cache: KVCache | None = None,
        slots: Tensor | None = None,
    ) -> Tensor:
        q, k, v = self.project(x, cos, sin, cache, slots)
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


@dataclass
class DoubleDecodeState:
    """Generation state: the generation decoder's own KV cache, the per-layer cross K/V (fixed), each
    row's next cache slot and position."""

    cache: DecoderCache
    cross: list[CrossKV]
    cross_mask: Tensor
    next_slot: Tensor
    next_position: Tensor


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
        if length > self.config.context_length:
            raise ValueError(f"sequence of {length} tokens exceeds the model context of {self.config.context_length}")
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
                  mask: Tensor, cache: DecoderCache | None = None, slots: Tensor | None = None) -> Tensor:
        """The generation decoder from token embeddings ``x`` to logits (muP readout multiplier applied)."""
        for i, block in enumerate(self.generation):
            layer_cache = cache.layers[i] if cache is not None else None
            x = block(x, cos, sin, cross=cross[i], cross_mask=cross_mask, mask=mask, cache=layer_cache, slots=slots)
        return self.logits(self.norm(x))

    # ------------------------------------------------------------ inference
    def _cache(self, n_layer: int, batch_size: int, max_len: int) -> DecoderCache:
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
        cache = self._cache(self.config.n_context_layer, 1, len(tokens))
        latents = self.context(self.embed(idx), cache=cache, slots=slots)
        return ContextPrefix(tokens, [layer.k for layer in cache.layers], [layer.v for layer in cache.layers], latents)

    @torch.no_grad()
    def prefill(
        self, idx: Tensor, token_valid: Tensor, max_new_tokens: int, *, prefix: ContextPrefix | None = None
    ) -> tuple[Tensor, DoubleDecodeState]:
        """Context decoder over prompt[:-1] (after ``prefix``, if cached), cross K/V once, first logits.

        ``idx (B, P)`` are left-padded prompts (the suffixes after ``prefix`` when one is given).
        """
        batch, length = idx.shape
        device = idx.device
        start = len(prefix) if prefix is not None else 0
        context_len = start + length - 1
        # Rotary positions count real tokens only, so a row's positions do not depend on its padding.
        positions = start + (token_valid.long().cumsum(1) - 1).clamp_min(0)
        cache = self._cache(self.config.n_context_layer, batch, context_len)
        if prefix is not None:
            for layer, k, v in zip(cache.layers, prefix.keys, prefix.values):
                layer.k[:, :, :start], layer.v[:, :, :start] = k, v
            cache.key_valid[:, :start] = True
        latents = [prefix.latents.expand(batch, -1, -1)] if prefix is not None else []
        if length > 1:
            slots = torch.arange(start, context_len, device=device)
            latents.append(self.context(
                self.embed(idx[:, :-1]), positions=positions[:, :-1], cache=cache, slots=slots, token_valid=token_valid[:, :-1]
            ))
        latents = torch.cat(latents, 1) if latents else self.embed.weight.new_zeros(batch, 0, self.config.d_model)
        context_positions = torch.cat(
            [torch.arange(start, device=device).expand(batch, -1), positions[:, :-1]], 1
        )
        cos, sin = rope_angles(context_positions, self.config.rotary_dim, self.config.rope_base)
        cross = [layer.attn.cross_keys(latents, cos, sin) for layer in self.generation]
        state = DoubleDecodeState(
            self._cache(self.config.n_generation_layer, batch, 1 + max_new_tokens),
            cross,
            cache.key_valid[:, None, None, :].clone(),
            torch.zeros_like(positions[:, -1]),
            positions[:, -1],
        )
        return self.decode_step(state, idx[:, -1]), state

    @torch.no_grad()
    def decode_step(self, state: DoubleDecodeState, token: Tensor) -> Tensor:
        """One token per row through the generation decoder only (its cache + the fixed cross K/V); each row
        writes its own next slot (rows past the end of the cache rewrite their last one)."""
        slots = state.next_slot.clamp_max(state.cache.max_len - 1)[:, None]
        cos, sin = rope_angles(state.next_position[:, None], self.config.rotary_dim, self.config.rope_base)
        mask = state.cache.attention_mask(slots, None)
        logits = self._generate(self.embed(token[:, None]), cos, sin, state.cross, state.cross_mask,
                                mask=mask, cache=state.cache, slots=slots)
        state.next_slot = state.next_slot + 1
        state.next_position = state.next_position + 1
        return logits[:, -1]

    # Continuous batching (blockloop.infer.engine): every row is a slot holding one request, with static
    # cross K/V buffers of ``max_len`` entries per generation layer (masked past the row's prompt).
    def allocate_slots(self, n_slots: int, max_len: int) -> DoubleDecodeState:
        c, weight = self.config, self.embed.weight
        shape = (n_slots, c.n_kv_head, max_len, c.head_dim)
        cross = [(weight.new_zeros(shape), weight.new_zeros(shape)) for _ in self.generation]
        zeros = torch.zeros(n_slots, dtype=torch.long, device=weight.device)
        mask = torch.zeros(n_slots, 1, 1, max_len, dtype=torch.bool, device=weight.device)
        return DoubleDecodeState(self._cache(c.n_generation_layer, n_slots, max_len), cross, mask, zeros, zeros.clone())

    @torch.no_grad()
    def prefill_slot(self, state: DoubleDecodeState, slot: int, prompt: Tensor) -> Tensor:
        """:meth:`prefill` of one prompt, copied into row ``slot``: its cross K/V and the generation
        cache entry of its last prompt token. The first token's logits ``(V,)``."""
        logits, one = self.prefill(prompt[None], torch.ones_like(prompt[None], dtype=torch.bool), 0)
        length = one.cross_mask.shape[-1]
        for (k, v), (k1, v1) in zip(state.cross, one.cross):
            k[slot, :, :length], v[slot, :, :length] = k1[0], v1[0]
        state.cross_mask[slot] = False
        state.cross_mask[slot, ..., :length] = one.cross_mask[0]
        for layer, layer1 in zip(state.cache.layers, one.cache.layers):
            layer.k[slot, :, :1], layer.v[slot, :, :1] = layer1.k[0, :, :1], layer1.v[0, :, :1]
        state.cache.key_valid[slot] = False
        state.cache.key_valid[slot, 0] = True
        state.next_slot[slot], state.next_position[slot] = 1, one.next_position[0]
        return logits[0]
