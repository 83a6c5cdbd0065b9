"""The vanilla decoder-only transformer: the baseline every other family is measured against.

Pre-norm blocks; ``parallel_residual`` gives GPT-NeoX's x + attn(ln1(x)) + mlp(ln2(x)), otherwise
x + attn(ln1(x)) then + mlp(ln2(.)). Positions enter only through rotary embeddings on q and k.
With a :class:`~blockloop.nn.kv_cache.DecoderCache` the same forward does prefill (many tokens) and
decode steps (one token), writing keys/values at explicit cache slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blockloop.config import DecoderConfig
from blockloop.nn.attention import attention
from blockloop.nn.kv_cache import DecoderCache, KVCache
from blockloop.nn.mlp import build_mlp
from blockloop.nn.norm import RMSNorm, build_norm
from blockloop.nn.precision import at_least_fp32
from blockloop.nn.rope import apply_rope, rope_angles


@dataclass
class DecodeState:
    """Where each row of a generation batch is: the cache, the next slot, each row's next position."""

    cache: DecoderCache
    next_slot: int
    next_position: Tensor


class SelfAttention(nn.Module):
    """Multi-head / grouped-query causal self-attention with one fused q/k/v projection."""

    def __init__(self, config: DecoderConfig, *, causal: bool = True) -> None:
        super().__init__()
        self.causal = causal
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.qkv = nn.Linear(config.d_model, (config.n_head + 2 * config.n_kv_head) * config.head_dim, bias=config.bias)
        self.proj = nn.Linear(config.n_head * config.head_dim, config.d_model, bias=config.bias)
        self.dropout = config.dropout

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        *,
        cache: KVCache | None = None,
        slots: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim], dim=-1
        )
        q = q.view(batch, length, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(batch, length, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = v.view(batch, length, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            out = attention(q, k, v, causal=self.causal, dropout_p=self.dropout if self.training else 0.0)
        else:
            k, v = cache.write(slots, k, v)
            out = attention(q, k, v, mask=mask)
        return self.proj(out.transpose(1, 2).reshape(batch, length, -1))


class CrossAttention(nn.Module):
    """Queries from the sequence, keys/values from a separate ``memory (B, M, d_model)``; no positions."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.q = nn.Linear(config.d_model, config.n_head * config.head_dim, bias=config.bias)
        self.kv = nn.Linear(config.d_model, 2 * config.n_kv_head * config.head_dim, bias=config.bias)
        self.proj = nn.Linear(config.n_head * config.head_dim, config.d_model, bias=config.bias)

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:
        batch, length, _ = x.shape
        q = self.q(x).view(batch, length, self.n_head, self.head_dim).transpose(1, 2)
        k, v = self.kv(memory).view(batch, memory.shape[1], 2, self.n_kv_head, self.head_dim).permute(2, 0, 3, 1, 4)
        return self.proj(attention(q, k, v).transpose(1, 2).reshape(batch, length, -1))


class Block(nn.Module):
    """Pre-norm transformer layer: self-attention, optional cross-attention to a memory, MLP."""

    def __init__(self, config: DecoderConfig, *, causal: bool = True, cross_attention: bool = False) -> None:
        super().__init__()
        self.norm1 = build_norm(config.norm, config.d_model, config.norm_eps)
        self.attn = SelfAttention(config, causal=causal)
        if cross_attention:
            self.norm_cross = build_norm(config.norm, config.d_model, config.norm_eps)
            self.cross = CrossAttention(config)
        self.norm2 = build_norm(config.norm, config.d_model, config.norm_eps)
        self.mlp = build_mlp(config.mlp, config.d_model, config.d_ff, config.bias)
        self.parallel_residual = config.parallel_residual
        self.drop = nn.Dropout(config.dropout)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, memory: Tensor | None = None, **attn_kwargs: Tensor | KVCache | None
    ) -> Tensor:
        attn_out = self.drop(self.attn(self.norm1(x), cos, sin, **attn_kwargs))
        if self.parallel_residual and memory is None:
            return x + attn_out + self.drop(self.mlp(self.norm2(x)))
        x = x + attn_out
        if memory is not None:
            x = x + self.drop(self.cross(self.norm_cross(x), memory))
        return x + self.drop(self.mlp(self.norm2(x)))


class TransformerStack(nn.Module):
    """``n_layer`` pre-norm blocks and the final norm over input embeddings.

    The body of every transformer in blockloop: the vanilla decoder, and the block decoder, token decoder
    and (non-causal) embedder encoder of the Block Transformer. With a cache, the inputs are written at
    cache ``slots`` and attend to everything valid before them.
    """

    def __init__(self, config: DecoderConfig, *, causal: bool = True, cross_attention: bool = False) -> None:
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(
            Block(config, causal=causal, cross_attention=cross_attention) for _ in range(config.n_layer)
        )
        self.norm = build_norm(config.norm, config.d_model, config.norm_eps)

    def forward(
        self,
        x: Tensor,
        *,
        positions: Tensor | None = None,
        cache: DecoderCache | None = None,
        slots: Tensor | None = None,
        token_valid: Tensor | None = None,
        memory: Tensor | None = None,
    ) -> Tensor:
        """Hidden states for embeddings ``x (B, T, d)``; ``memory`` feeds the cross-attention layers."""
        if cache is not None and slots is None:
            raise ValueError("a cached forward needs the cache slots to write")
        if positions is None:
            positions = slots if slots is not None else torch.arange(x.shape[1], device=x.device)
        cos, sin = rope_angles(positions, self.config.rotary_dim, self.config.rope_base)
        mask = cache.attention_mask(slots, token_valid) if cache is not None else None
        for i, block in enumerate(self.blocks):
            layer_cache = cache.layers[i] if cache is not None else None
            x = block(x, cos, sin, memory, cache=layer_cache, slots=slots, mask=mask)
        return self.norm(x)

    def allocate_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype, device: torch.device) -> DecoderCache:
        c = self.config
        return DecoderCache(c.n_layer, batch_size, c.n_kv_head, max_len, c.head_dim, dtype=dtype, device=device)


def init_weights(model: nn.Module, std: float, n_layer: int) -> None:
    """GPT-2 init: N(0, std), output projections scaled by 1/sqrt(2 n_layer), norms at identity."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            scale = 1 / math.sqrt(2 * n_layer) if name.endswith(".proj") else 1.0
            nn.init.normal_(module.weight, mean=0.0, std=std * scale)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, (nn.LayerNorm, RMSNorm)):
            nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


def count_parameters(model: nn.Module, excluded: tuple[nn.Module, ...] = ()) -> int:
    """Unique parameters of ``model`` (tied ones once), leaving out the weights of ``excluded`` modules."""
    params = {id(p): p for p in model.parameters()}
    for module in excluded:
        params.pop(id(module.weight), None)
    return sum(p.numel() for p in params.values())


class Decoder(nn.Module):
    """Token embedding -> transformer stack -> LM head (optionally tied to the embedding)."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.padded_vocab_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.body = TransformerStack(config)
        self.lm_head = nn.Linear(config.d_model, config.padded_vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_weights(self, self.config.init_std, self.config.n_layer)

    def allocate_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None) -> DecoderCache:
        """A static cache for ``batch_size`` rows of up to ``max_len`` tokens (prompt + generated)."""
        if max_len > self.config.context_length:
            raise ValueError(f"cache of {max_len} tokens exceeds the model context of {self.config.context_length}")
        weight = self.embed.weight
        return self.body.allocate_cache(batch_size, max_len, dtype=dtype or weight.dtype, device=weight.device)

    def generation_caches(self, batch_size: int, prompt_len: int, max_new_tokens: int) -> list[DecoderCache]:
        """Every static cache generation needs: one KV cache over prompt and generated tokens."""
        return [self.allocate_cache(batch_size, prompt_len + max_new_tokens)]

    @torch.no_grad()
    def prefill(self, idx: Tensor, token_valid: Tensor, max_new_tokens: int) -> tuple[Tensor, DecodeState]:
        """Cache left-padded prompts; rotary positions count from each row's first real token."""
        batch, length = idx.shape
        slots = torch.arange(length, device=idx.device)
        positions = (slots[None, :] - (~token_valid).sum(1, keepdim=True)).clamp_min(0)
        (cache,) = self.generation_caches(batch, length, max_new_tokens)
        logits, _ = self(idx, cache=cache, slots=slots, positions=positions, token_valid=token_valid, last_only=True)
        return logits[:, -1], DecodeState(cache, length, positions[:, -1] + 1)

    @torch.no_grad()
    def decode_step(self, state: DecodeState, token: Tensor) -> Tensor:
        slot = torch.full((1,), state.next_slot, device=token.device)
        logits, _ = self(token[:, None], cache=state.cache, slots=slot, positions=state.next_position[:, None])
        state.next_slot += 1
        state.next_position = state.next_position + 1
        return logits[:, -1]

    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        *,
        cache: DecoderCache | None = None,
        slots: Tensor | None = None,
        positions: Tensor | None = None,
        token_valid: Tensor | None = None,
        last_only: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Logits for ``idx (B, T)``, and the mean next-token loss when ``targets`` is given.

        Without a cache this is the training forward over a full causal window. With a cache the tokens
        are written at cache ``slots (T,)`` (shared by all rows); ``positions (B, T)`` are their rotary
        positions (default: the slots) and ``token_valid (B, T)`` marks left padding. ``last_only``
        projects only the final position, which is all generation needs. Targets equal to -100 are
        ignored by the loss.
        """
        if cache is None and idx.shape[1] > self.config.context_length:
            raise ValueError(f"sequence of {idx.shape[1]} tokens exceeds the model context of {self.config.context_length}")
        x = self.body(self.drop(self.embed(idx)), positions=positions, cache=cache, slots=slots, token_valid=token_valid)
        if last_only:
            x = x[:, -1:]
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(at_least_fp32(logits.flatten(0, 1)), targets.flatten(), ignore_index=-100)
        return logits, loss

    def num_parameters(self, *, non_embedding: bool = False) -> int:
        """Unique parameters (tied weights counted once); ``non_embedding`` drops embedding and head."""
        return count_parameters(self, (self.embed, self.lm_head) if non_embedding else ())
