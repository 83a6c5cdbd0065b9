"""The vanilla decoder-only transformer, and the layers every family is built from.

Pre-norm blocks; ``parallel_residual`` gives GPT-NeoX's x + attn(ln1(x)) + mlp(ln2(x)), otherwise
x + attn(ln1(x)) then + mlp(ln2(.)). Positions enter through rotary embeddings on q and k (and, for
GPT-2, a learned absolute table). The config fields that pretrained architectures need (Gemma's scaled
embeddings and sandwich norms, Gemma-3's q/k norms and sliding-window layers, ...) default to off.
With a :class:`~blockloop.nn.kv_cache.StepContext` the same forward does prefill (many tokens) and
decode steps (one token), writing keys/values at explicit cache slots; the decode state around it is the
serving runner's (:mod:`blockloop.serve.runners.decoder`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blockloop.config import DecoderConfig
from blockloop.errors import check_context
from blockloop.nn.attention import attention
from blockloop.nn.init import init_weights
from blockloop.nn.kv_cache import DecoderCache, LayerStep, StepContext
from blockloop.nn.linear import Linear
from blockloop.nn.loss import token_cross_entropy
from blockloop.nn.masks import MaskMod, sliding_window_mask_mod, within_window
from blockloop.nn.mlp import build_mlp
from blockloop.nn.norm import build_norm
from blockloop.nn.paged_cache import KVPages
from blockloop.nn.rope import apply_rope, rope_angles

CrossKV = tuple[Tensor, Tensor]


def split_heads(x: Tensor, n_head: int, head_dim: int) -> Tensor:
    """``(B, T, n_head * head_dim) -> (B, n_head, T, head_dim)``."""
    return x.view(x.shape[0], x.shape[1], n_head, head_dim).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """``(B, H, T, D) -> (B, T, H * D)``."""
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], x.shape[1] * x.shape[3])  # no -1: a batch may be empty


class SelfAttention(nn.Module):
    """Multi-head / grouped-query self-attention with one fused q/k/v projection.

    Causal (or bidirectional with ``causal=False``) unless a ``mask`` is given: a cache's mask, or an
    encoder's padding mask.
    """

    def __init__(self, config: DecoderConfig, *, causal: bool = True) -> None:
        super().__init__()
        self.causal = causal
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        q, kv = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
        self.qkv = Linear(config.d_model, q + 2 * kv, bias=config.qkv_bias, splits=(q, kv, kv))  # W^Q, W^K, W^V in one product
        self.proj = Linear(config.n_head * config.head_dim, config.d_model, bias=config.bias)
        self.dropout = config.dropout
        self.scale = config.attn_scale
        # Gemma-3 normalises each query/key head before rotary; other models have no such norm.
        qk_norm = partial(build_norm, config.norm, config.head_dim, config.norm_eps)
        self.q_norm = qk_norm() if config.qk_norm else None
        self.k_norm = qk_norm() if config.qk_norm else None

    def project(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv: LayerStep | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated queries and the keys/values to attend over (the whole cache after writing, with one)."""
        q, k, v = self.qkv(x).split_with_sizes(  # Tensor.split's Python wrapper costs more than the op here
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim], dim=-1
        )
        q, k = split_heads(q, self.n_head, self.head_dim), split_heads(k, self.n_kv_head, self.head_dim)
        v = split_heads(v, self.n_kv_head, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is not None:
            k, v = kv.write(k, v)
        return q, k, v

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        *,
        kv: LayerStep | None = None,
        mask: Tensor | None = None,
        mask_mod: MaskMod | None = None,
    ) -> Tensor:
        q, k, v = self.project(x, cos, sin, kv)
        dropout = self.dropout if self.training else 0.0
        causal = self.causal and mask is None and mask_mod is None
        out = attention(q, k, v, causal=causal, mask=mask, mask_mod=mask_mod, scale=self.scale, dropout_p=dropout)
        return self.proj(merge_heads(out))


class CrossAttention(nn.Module):
    """Queries from the sequence, keys/values from a memory (encoder states, context vectors); no positions.

    :meth:`keys` projects a memory once, so generation can reuse its K/V at every step.
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.scale = config.attn_scale  # as self-attention's; q/k norms are self-attention's only
        self.q = Linear(config.d_model, config.n_head * config.head_dim, bias=config.qkv_bias)
        kv = config.n_kv_head * config.head_dim
        self.kv = Linear(config.d_model, 2 * kv, bias=config.qkv_bias, splits=(kv, kv))
        self.proj = Linear(config.n_head * config.head_dim, config.d_model, bias=config.bias)

    def keys(self, memory: Tensor) -> CrossKV:
        k, v = self.kv(memory).chunk(2, dim=-1)
        return split_heads(k, self.n_kv_head, self.head_dim), split_heads(v, self.n_kv_head, self.head_dim)

    def forward(self, x: Tensor, cross: CrossKV, cross_mask: Tensor | None) -> Tensor:
        q = split_heads(self.q(x), self.n_head, self.head_dim)
        return self.proj(merge_heads(attention(q, *cross, mask=cross_mask, scale=self.scale)))


class Block(nn.Module):
    """Pre-norm layer: self-attention, optional cross-attention to a memory, MLP.

    With ``sandwich_norm`` the attention and MLP outputs are normalised again before their residual add
    (Gemma-2/3's post-attention and post-feedforward norms). ``parallel_residual`` (GPT-NeoX) adds attention and
    MLP, both read from the layer's input; a layer with cross-attention runs its three branches in turn
    whatever that flag says (the Block Transformer's cross token decoder puts the cross-attention between
    self-attention and the MLP, appendix F.2).

    ``attention`` builds the self-attention (double decoders swap in their dual attention); keyword
    arguments of :meth:`forward` other than the memory go to it.
    """

    def __init__(
        self,
        config: DecoderConfig,
        attention: Callable[[DecoderConfig], nn.Module] = SelfAttention,
        *,
        cross_attention: bool = False,
    ) -> None:
        super().__init__()
        self.norm1 = build_norm(config.norm, config.d_model, config.norm_eps)
        self.attn = attention(config)
        if cross_attention:
            self.norm_cross = build_norm(config.norm, config.d_model, config.norm_eps)
            self.cross = CrossAttention(config)
        self.norm2 = build_norm(config.norm, config.d_model, config.norm_eps)
        self.mlp = build_mlp(config.mlp, config.d_model, config.d_ff, config.bias)
        post_norm = partial(build_norm, config.norm, config.d_model, config.norm_eps)
        self.post_attn_norm = post_norm() if config.sandwich_norm else None
        self.post_mlp_norm = post_norm() if config.sandwich_norm else None
        self.parallel_residual = config.parallel_residual
        self.dropout = config.dropout

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        memory: Tensor | CrossKV | None = None,
        memory_mask: Tensor | None = None,
        **attn_kwargs: object,
    ) -> Tensor:
        """``memory`` is a memory ``(B, M, d)`` or its precomputed cross K/V (see CrossAttention.keys)."""
        attn_out = self.branch(self.attn(self.norm1(x), cos, sin, **attn_kwargs), self.post_attn_norm)
        if self.parallel_residual and memory is None:
            return x + attn_out + self.branch(self.mlp(self.norm2(x)), self.post_mlp_norm)
        x = x + attn_out
        if memory is not None:
            cross = self.cross.keys(memory) if isinstance(memory, Tensor) else memory
            x = x + self.branch(self.cross(self.norm_cross(x), cross, memory_mask))
        return x + self.branch(self.mlp(self.norm2(x)), self.post_mlp_norm)

    def branch(self, out: Tensor, post_norm: nn.Module | None = None) -> Tensor:
        """A branch's output as the residual stream adds it: sandwich-normed where the model has that norm, and
        dropped out while training. What a model lacks is skipped rather than run as an identity module: a decode
        step is hundreds of small calls, and each no-op module call costs about as much as a small op."""
        if post_norm is not None:
            out = post_norm(out)
        return F.dropout(out, self.dropout) if self.training and self.dropout else out


@dataclass
class LayerInputs:
    """Rotary tables ``(cos, sin)`` and mask keyword arguments of one pass: the global layers', and the
    sliding-window local layers' when the config has any: ``local_masks`` over a full-length cache (or
    without one), ``rolling_masks`` over a cache's rolling entries (ring then the step's own keys, see
    :class:`~blockloop.nn.kv_cache.RollingKVCache`)."""

    rope: tuple[Tensor, Tensor]
    masks: dict[str, object]
    local_rope: tuple[Tensor, Tensor] | None = None
    local_masks: dict[str, object] | None = None
    rolling_masks: dict[str, object] | None = None
    # Masks for rows that attend locally where ``local (B,)`` says, when they cannot be picked row by row from the
    # two dense ones (a paged step's block masks; see :meth:`per_row`).
    per_row_masks: Callable[[Tensor], dict[str, object]] | None = None

    def of(self, local: bool, rolling: bool = False) -> tuple[Tensor, Tensor, dict[str, object]]:
        """A global layer's inputs, or a local one's: ``rolling`` when its cache entry is a ring."""
        if not local:
            return (*self.rope, self.masks)
        return (*self.local_rope, self.rolling_masks if rolling else self.local_masks)

    def per_row(self, local: Tensor) -> tuple[Tensor, Tensor, dict[str, object]]:
        """Row ``b``'s local or global inputs as ``local (B,)`` says: one batch whose rows attend differently
        (a looped layer that is local at some depth positions and global at others, rows at different
        loops; such a layer keeps a full-length cache, or pages, at every loop). Needs a cached step's masks,
        which have a row dimension, or ``per_row_masks`` (block masks over a paged pool)."""
        (cos, sin, masks), (local_cos, local_sin, local_masks) = self.of(False), self.of(True)
        if masks["mask"] is None:
            raise ValueError("rows of one batch attend locally and globally only in a cached step")

        def pick(a: Tensor, b: Tensor) -> Tensor:  # rotary tables (T, R) shared by the rows get a row and head axis
            a, b = (a, b) if a.dim() > 2 else (a.expand(len(local), 1, *a.shape), b.expand(len(local), 1, *b.shape))
            return torch.where(local.view(-1, *(1,) * (a.dim() - 1)), a, b)

        if self.per_row_masks is not None:
            return pick(local_cos, cos), pick(local_sin, sin), self.per_row_masks(local)
        return pick(local_cos, cos), pick(local_sin, sin), {"mask": pick(local_masks["mask"], masks["mask"])}


class TransformerStack(nn.Module):
    """``n_layer`` pre-norm blocks (and, unless ``final_norm=False``, the final norm) over embeddings.

    The body of the vanilla decoder, and of the Block Transformer's block decoder, token decoder and
    (bidirectional) embedder encoder. With a ``step``, the inputs are written at its cache slots and
    attend to everything valid before them; ``local_layers`` see only the last ``sliding_window`` of those and
    are rotated with ``local_rope_base`` (Gemma-3's interleaved local/global attention). Their cache entries
    are rolling: ``sliding_window`` (+ rollback) slots per row, not the cache length (:meth:`allocate_cache`).
    """

    def __init__(
        self,
        config: DecoderConfig,
        *,
        causal: bool = True,
        cross_attention: bool = False,
        final_norm: bool = True,
        attention: Callable[..., nn.Module] = SelfAttention,
    ) -> None:
        super().__init__()
        self.config = config
        # ``attention``: a SelfAttention subclass may replace it (the staircase family's also reads cached states).
        attn = attention if causal else partial(attention, causal=False)
        self.blocks = nn.ModuleList(
            Block(config, attn, cross_attention=cross_attention) for _ in range(config.n_layer)
        )
        self.norm = build_norm(config.norm, config.d_model, config.norm_eps) if final_norm else nn.Identity()

    def forward(
        self,
        x: Tensor,
        *,
        step: StepContext | None = None,
        memory: Tensor | None = None,
    ) -> Tensor:
        """Hidden states for embeddings ``x (B, T, d)`` (at positions 0..T-1 without a ``step``);
        ``memory`` feeds the cross-attention layers."""
        inputs = self.layer_inputs(x, step)
        rolling = step.cache.rolling if step is not None else ()
        for i, block in enumerate(self.blocks):
            cos, sin, masks = inputs.of(i in self.config.local_layers, i in rolling)
            x = block(x, cos, sin, memory, kv=step.layer(i) if step is not None else None, **masks)
        return self.norm(x)

    def layer_inputs(self, x: Tensor, step: StepContext | None = None, *, local: bool | None = None) -> LayerInputs:
        """What the layers of one pass share: rotary tables and masks (the step's cache mask, after marking
        its slots written, or causal without a cache), and, when the config has local layers (or ``local``
        says so), the local layers' own (a window band over the cache, and the rolling entries' ring mask when
        the cache has rolling entries). Models that run the blocks in their own order start here."""
        positions = step.token_positions if step is not None else torch.arange(x.shape[1], device=x.device)
        c = self.config
        rope = rope_angles(positions, c.rotary_dim, c.rope_base)
        mask, rolling = step.begin_rolling() if step is not None else (None, None)
        inputs = LayerInputs(rope, {"mask": mask}, rolling_masks={"mask": rolling})
        if c.local_layers if local is None else local:
            inputs.local_rope = rope_angles(positions, c.rotary_dim, c.local_rope_base) if c.local_rope_base else rope
            if mask is None:
                inputs.local_masks = {"mask_mod": sliding_window_mask_mod(c.sliding_window)}
            elif isinstance(mask, Tensor):  # not a paged decode step's block mask: its local layers are all rolling
                inputs.local_masks = {"mask": mask & within_window(step.slots, mask.shape[-1], c.sliding_window)}
        return inputs

    def allocate_cache(
        self, batch_size: int, max_len: int, *, dtype: torch.dtype, device: torch.device, pages: KVPages | None = None,
        rollback: int = 0,
    ) -> DecoderCache:
        """One entry per layer: ``max_len`` slots (or pages), a ring of ``sliding_window + rollback`` for local layers."""
        c = self.config
        return DecoderCache(c.n_layer, batch_size, c.n_kv_head, max_len, c.head_dim, dtype=dtype, device=device, pages=pages,
                            rolling=c.local_layers, window=c.sliding_window or 0, rollback=rollback)


def count_parameters(model: nn.Module, excluded: tuple[nn.Module, ...] = ()) -> int:
    """Unique parameters of ``model`` (tied ones once), leaving out the weights of ``excluded`` modules."""
    params = {id(p): p for p in model.parameters()}
    for module in excluded:
        params.pop(id(module.weight), None)
    return sum(p.numel() for p in params.values())


class LanguageModel(nn.Module):
    """What the single-width families share: token embedding (+ dropout), their own ``stacks`` of layers,
    final norm, and an LM head tied to the embedding when configured; initialisation, the loss and
    parameter counts.

    ``stacks`` are registered in order between the embedding and the head, so initialisation visits the
    modules in the order the model reads.

    ``streams``: generation may read on past the context, because a row's decode state has a fixed size and
    positions enter only through their differences (rotary). False for a cache that grows with the sequence.
    """

    streams: bool = False

    def __init__(self, config: DecoderConfig, **stacks: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.padded_vocab_size, config.d_model)
        if config.learned_positions:
            self.pos_embed = nn.Embedding(config.context_length, config.d_model)
        self.drop = nn.Dropout(config.embed_dropout)
        for name, module in stacks.items():
            setattr(self, name, module)
        self.norm = build_norm(config.norm, config.d_model, config.norm_eps)
        self.lm_head = Linear(config.d_model, config.padded_vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        c = self.config
        init_weights(self, std=c.init_std, n_layer=c.n_layer, scheme=c.init)

    def embed_tokens(self, idx: Tensor, positions: Tensor | None = None) -> Tensor:
        """Token embeddings, times sqrt(d) with ``embed_scale`` (Gemma), plus the learned absolute position
        embeddings of ``positions`` (default 0..T-1) with ``learned_positions`` (GPT-2)."""
        x = self.embed(idx)
        c = self.config
        if c.embed_scale:
            x = x * torch.tensor(c.d_model**0.5, dtype=x.dtype)
        if c.learned_positions:
            x = x + self.pos_embed(torch.arange(idx.shape[1], device=idx.device) if positions is None else positions)
        return x

    def logits(self, x: Tensor) -> Tensor:
        """The LM head on final-normed states, times the muP readout multiplier (1 without muP), soft-capped
        to c * tanh(logits / c) with ``logit_softcap``."""
        logits = self.lm_head(x) * self.config.logit_multiplier
        cap = self.config.logit_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

    @staticmethod
    def loss(logits: Tensor, targets: Tensor | None) -> Tensor | None:
        """Mean cross-entropy of ``logits`` against ``targets`` at the same positions, over targets that are not
        :data:`~blockloop.nn.loss.IGNORE_INDEX` (None without targets): every family's loss, whatever its targets
        mean."""
        if targets is None:
            return None
        return token_cross_entropy(logits, targets)

    def num_parameters(self, *, non_embedding: bool = False) -> int:
        """Unique parameters (tied weights counted once); ``non_embedding`` drops embedding and head."""
        return count_parameters(self, (self.embed, self.lm_head) if non_embedding else ())


class Decoder(LanguageModel):
    """Token embedding -> n_layer blocks -> final norm -> LM head (optionally tied to the embedding)."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__(config, body=TransformerStack(config, final_norm=False))

    def allocate_cache(
        self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None, pages: KVPages | None = None,
        rollback: int = 0,
    ) -> DecoderCache:
        """A static cache for ``batch_size`` rows of up to ``max_len`` tokens (prompt + generated), or a paged
        one over ``pages``; ``rollback``: how many written slots a step may later take back (see
        :class:`~blockloop.nn.kv_cache.DecoderCache`)."""
        check_context(max_len, self.config.context_length, "cache", "allocate fewer slots")
        weight = self.embed.weight
        return self.body.allocate_cache(batch_size, max_len, dtype=dtype or weight.dtype, device=weight.device, pages=pages,
                                        rollback=rollback)

    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        *,
        step: StepContext | None = None,
        last_only: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Logits for ``idx (B, T)``, and the mean loss of predicting ``targets (B, T)`` at each position when
        given: ``targets`` are the next tokens (``idx`` shifted left by one, as nanoGPT's ``y``), not ``idx``.

        Without a ``step`` this is the training forward over a full causal window. With one the tokens
        are written at its cache slots (``(T,)`` shared by all rows, or ``(B, T)`` per row), at its rotary
        positions, its ``token_valid`` marking left padding. ``last_only`` projects only the final
        position, which is all generation needs. Targets equal to ``IGNORE_INDEX`` are ignored by the loss.
        """
        if step is None:
            check_context(idx.shape[1], self.config.context_length, "sequence")
        x = self.drop(self.embed_tokens(idx, step.token_positions if step is not None else None))
        x = self.body(x, step=step)
        x = self.norm(x)
        if last_only:
            x = x[:, -1:]
        logits = self.logits(x)
        return logits, self.loss(logits, targets)
