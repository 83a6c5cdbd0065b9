"""The vanilla decoder-only transformer: the baseline every other family is measured against.

Pre-norm blocks; ``parallel_residual`` gives GPT-NeoX's x + attn(ln1(x)) + mlp(ln2(x)), otherwise
x + attn(ln1(x)) then + mlp(ln2(.)). Positions enter only through rotary embeddings on q and k.
With a :class:`~blockloop.nn.kv_cache.DecoderCache` the same forward does prefill (many tokens) and
decode steps (one token), writing keys/values at explicit cache slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blockloop.config import DecoderConfig
from blockloop.nn.attention import attention
from blockloop.nn.kv_cache import DecoderCache, KVCache
from blockloop.nn.mlp import build_mlp
from blockloop.nn.init import init_weights
from blockloop.nn.norm import build_norm
from blockloop.nn.precision import at_least_fp32
from blockloop.nn.rope import apply_rope, rope_angles


@dataclass
class DecodeState:
    """Where each row of a generation batch is: the cache, the next slot, each row's next position."""

    cache: DecoderCache
    next_slot: int
    next_position: Tensor


def split_heads(x: Tensor, n_head: int, head_dim: int) -> Tensor:
    """``(B, T, n_head * head_dim) -> (B, n_head, T, head_dim)``."""
    return x.view(x.shape[0], x.shape[1], n_head, head_dim).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """``(B, H, T, D) -> (B, T, H * D)``."""
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)


class SelfAttention(nn.Module):
    """Multi-head / grouped-query self-attention with one fused q/k/v projection.

    Causal unless a ``mask`` is given (a cache's mask, or an encoder's padding mask for bidirectional use).
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.qkv = nn.Linear(config.d_model, (config.n_head + 2 * config.n_kv_head) * config.head_dim, bias=config.bias)
        self.proj = nn.Linear(config.n_head * config.head_dim, config.d_model, bias=config.bias)
        self.dropout = config.dropout

    def project(
        self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None = None, slots: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated queries and the keys/values to attend over (the whole cache after writing, with one)."""
        q, k, v = self.qkv(x).split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim], dim=-1
        )
        q, k, v = split_heads(q, self.n_head, self.head_dim), split_heads(k, self.n_kv_head, self.head_dim), split_heads(
            v, self.n_kv_head, self.head_dim
        )
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.write(slots, k, v)
        return q, k, v

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
        q, k, v = self.project(x, cos, sin, cache, slots)
        dropout = self.dropout if self.training else 0.0
        out = attention(q, k, v, causal=mask is None, mask=mask, dropout_p=dropout)
        return self.proj(merge_heads(out))


class Block(nn.Module):
    """Pre-norm attention + MLP; ``attention`` is the attention class (double decoders swap in their own)."""

    def __init__(self, config: DecoderConfig, attention: type[nn.Module] = SelfAttention) -> None:
        super().__init__()
        self.norm1 = build_norm(config.norm, config.d_model, config.norm_eps)
        self.attn = attention(config)
        self.norm2 = build_norm(config.norm, config.d_model, config.norm_eps)
        self.mlp = build_mlp(config.mlp, config.d_model, config.d_ff, config.bias)
        self.parallel_residual = config.parallel_residual
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, **attn_kwargs: object) -> Tensor:
        attn_out = self.drop(self.attn(self.norm1(x), cos, sin, **attn_kwargs))
        if self.parallel_residual:
            return x + attn_out + self.drop(self.mlp(self.norm2(x)))
        x = x + attn_out
        return x + self.drop(self.mlp(self.norm2(x)))


class LanguageModel(nn.Module):
    """What every family shares: token embedding (+ dropout), its own ``stacks`` of layers, final norm, and
    an LM head tied to the embedding when configured; initialisation, the loss and parameter counts.

    ``stacks`` are registered in order between the embedding and the head, so initialisation visits the
    modules in the order the model reads.
    """

    def __init__(self, config: DecoderConfig, **stacks: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.padded_vocab_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        for name, module in stacks.items():
            setattr(self, name, module)
        self.norm = build_norm(config.norm, config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.padded_vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_weights(self, self.config)

    def logits(self, x: Tensor) -> Tensor:
        """The LM head on final-normed states, times the muP readout multiplier (1 without muP)."""
        return self.lm_head(x) * self.config.logit_multiplier

    @staticmethod
    def loss(logits: Tensor, targets: Tensor | None) -> Tensor | None:
        """Mean next-token cross-entropy over targets that are not -100 (None without targets)."""
        if targets is None:
            return None
        return F.cross_entropy(at_least_fp32(logits.flatten(0, 1)), targets.flatten(), ignore_index=-100)

    def num_parameters(self, *, non_embedding: bool = False) -> int:
        """Unique parameters (tied weights counted once); ``non_embedding`` drops embedding and head."""
        params = {id(p): p for p in self.parameters()}
        if non_embedding:
            params.pop(id(self.embed.weight), None)
            params.pop(id(self.lm_head.weight), None)
        return sum(p.numel() for p in params.values())


class Decoder(LanguageModel):
    """Token embedding -> n_layer blocks -> final norm -> LM head (optionally tied to the embedding)."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__(config, blocks=nn.ModuleList(Block(config) for _ in range(config.n_layer)))

    def allocate_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None) -> DecoderCache:
        """A static cache for ``batch_size`` rows of up to ``max_len`` tokens (prompt + generated)."""
        if max_len > self.config.context_length:
            raise ValueError(f"cache of {max_len} tokens exceeds the model context of {self.config.context_length}")
        weight = self.embed.weight
        return DecoderCache(
            self.config.n_layer,
            batch_size,
            self.config.n_kv_head,
            max_len,
            self.config.head_dim,
            dtype=dtype or weight.dtype,
            device=weight.device,
        )

    @torch.no_grad()
    def prefill(self, idx: Tensor, token_valid: Tensor, max_new_tokens: int) -> tuple[Tensor, DecodeState]:
        """Cache left-padded prompts; rotary positions count from each row's first real token."""
        batch, length = idx.shape
        slots = torch.arange(length, device=idx.device)
        positions = (slots[None, :] - (~token_valid).sum(1, keepdim=True)).clamp_min(0)
        cache = self.allocate_cache(batch, length + max_new_tokens)
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
        batch, length = idx.shape
        if cache is None and length > self.config.context_length:
            raise ValueError(f"sequence of {length} tokens exceeds the model context of {self.config.context_length}")
        if cache is not None and slots is None:
            raise ValueError("a cached forward needs the cache slots to write")
        if positions is None:
            positions = slots if slots is not None else torch.arange(length, device=idx.device)
        cos, sin = rope_angles(positions, self.config.rotary_dim, self.config.rope_base)
        mask = cache.attention_mask(slots, token_valid) if cache is not None else None

        x = self.drop(self.embed(idx))
        for i, block in enumerate(self.blocks):
            layer_cache = cache.layers[i] if cache is not None else None
            x = block(x, cos, sin, cache=layer_cache, slots=slots, mask=mask)
        x = self.norm(x)
        if last_only:
            x = x[:, -1:]
        logits = self.logits(x)
        return logits, self.loss(logits, targets)
