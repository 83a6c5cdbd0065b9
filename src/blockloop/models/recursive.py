"""Recursive and Relaxed Recursive Transformers (Bae et al. 2024, "Relaxed Recursive Transformers").

A Recursive Transformer keeps ``n_layer`` unique layers Φ' and runs them ``loops`` = B times, so its looped
depth is L = n_layer * B (section 2.2, equation 2): position ℓ of the depth runs shared layer
``layer_order(...)[ℓ]``. The looping is only an execution order over the ordinary :class:`Block` s of a
:class:`TransformerStack`; every tied parameter, norms included, is one tensor used B times.

The Relaxed Recursive Transformer (section 2.3, equation 3) adds one LoRA module per loop to every shared
linear weight (:mod:`blockloop.nn.lora`), or, as the alternative of appendix K, learned per-position
prefix keys/values for self-attention. Early-exit training (section 3.7, appendix M) reads every loop's
output through the shared final norm and LM head.

Interface for continuous depth-wise batching (section 2.4; the engine of issue 6): :meth:`RecursiveDecoder.run_loop`
runs loop ``k`` of the shared block on hidden states ``x (B, T, d)`` where ``k`` is an ``int`` or a ``(B,)``
tensor giving each row its own loop. With a tensor, all rows go through the same shared layers in one
batched call (CYCLE tying only: there loop k runs layers 0..n_layer-1 for every k) and each row's LoRA
delta and prefix are gathered by its loop index. A KV cache in that call must be a
:meth:`DecoderCache.looped` one, so each row reads and writes its own loop's entries. ``self.drop(self.embed_tokens(idx))``,
``self.body.layer_inputs(x, ...)`` and :meth:`exit_logits` are the entry, the shared per-pass inputs and the
exit around it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from blockloop.models.decoder import Decoder, LayerInputs, SelfAttention
from blockloop.nn.attention import MaskMod, attention
from blockloop.nn.distill import forward_kl
from blockloop.nn.kv_cache import DecoderCache, KVCache
from blockloop.nn.lora import LoopIndex, LoopLoRALinear, add_loop_lora

if TYPE_CHECKING:
    from blockloop.families.recursive import RecursiveConfig

PrefixKV = tuple[Tensor, Tensor]


def layer_order(n_layer: int, loops: int, tying: str) -> list[int]:
    """Which shared layer runs at each of the L = n_layer * loops depth positions (appendix D, Figure 9).

    ``cycle``: 0..K-1 repeated; ``sequence``: each layer ``loops`` times in place; ``cycle_rev``: as cycle,
    with the last loop in reverse order (Takase & Kiyono 2023).
    """
    block = list(range(n_layer))
    if tying == "cycle":
        return block * loops
    if tying == "sequence":
        return [j for j in block for _ in range(loops)]
    if tying == "cycle_rev":
        return block * (loops - 1) + block[::-1]
    raise ValueError(f"unknown tying strategy {tying!r}")


class PrefixSelfAttention(SelfAttention):
    """Self-attention that also attends to learned prefix keys/values (appendix K), visible to every query.

    The prefix has no position (no rotary) and is not cached: it is a parameter of the depth position.
    """

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        *,
        cache: KVCache | None = None,
        slots: Tensor | None = None,
        mask: Tensor | None = None,
        mask_mod: MaskMod | None = None,
        prefix: PrefixKV | None = None,
    ) -> Tensor:
        if prefix is None:
            return super().forward(x, cos, sin, cache=cache, slots=slots, mask=mask, mask_mod=mask_mod)
        q, k, v = self.project(x, cos, sin, cache, slots)
        batch, _, length, _ = q.shape
        pk, pv = (t.expand(batch, -1, -1, -1).to(k.dtype) for t in prefix)
        if mask is None:
            mask = torch.ones(length, k.shape[2], dtype=torch.bool, device=x.device).tril(k.shape[2] - length)[None, None]
        mask = torch.cat([mask.new_ones(*mask.shape[:-1], pk.shape[2]).expand(mask.shape[0], -1, -1, -1), mask], dim=-1)
        dropout = self.dropout if self.training else 0.0
        out = attention(q, torch.cat([pk, k], 2), torch.cat([pv, v], 2), mask=mask, scale=self.scale, dropout_p=dropout)
        return self.proj(out.transpose(1, 2).reshape(batch, length, -1))


class RecursiveDecoder(Decoder):
    """A decoder whose ``n_layer`` blocks are looped ``loops`` times (equation 2), optionally relaxed (equation 3).

    Generation comes from :class:`Decoder` (``prefill``/``decode_step``); the KV cache has one entry per
    depth position, n_layer * loops, because each loop computes new keys and values with the shared weights.
    """

    config: RecursiveConfig

    def __init__(self, config: RecursiveConfig) -> None:
        super().__init__(config)
        self.order = layer_order(config.n_layer, config.loops, config.tying)
        # Which of its LoRA modules a shared layer uses at each depth position: the how-many-th use it is
        # (the loop under cycle tying; the k-th repeat in place under sequence tying).
        self.occurrence = [self.order[:p].count(layer) for p, layer in enumerate(self.order)]
        self.loop_index = LoopIndex()
        if config.prefix_len:
            shared = config.stack(config.n_layer)
            for block in self.body.blocks:
                block.attn = PrefixSelfAttention(shared)
            shape = (config.depth, 2, config.n_kv_head, config.prefix_len, config.head_dim)
            self.prefix_kv = nn.Parameter(torch.empty(shape))
        if config.lora_rank:
            add_loop_lora(
                self.body.blocks, loops=config.loops, rank=config.lora_rank, scaling=config.lora_scaling,
                loop=self.loop_index,
            )
        if config.prefix_len or config.lora_rank:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        for module in self.modules():
            if isinstance(module, LoopLoRALinear):
                module.reset_lora()
        if getattr(self, "prefix_kv", None) is not None:
            nn.init.normal_(self.prefix_kv, std=self.config.init_std)

    def lora_layers(self) -> list[LoopLoRALinear]:
        return [m for m in self.modules() if isinstance(m, LoopLoRALinear)]

    # -------------------------------------------------------------- one loop
    def exit_logits(self, x: Tensor) -> Tensor:
        """Logits of hidden states after any loop: the shared final norm and LM head (section 3.7)."""
        return self.logits(self.norm(x))

    def run_loop(
        self,
        x: Tensor,
        loop: int | Tensor,
        inputs: LayerInputs,
        *,
        cache: DecoderCache | None = None,
        slots: Tensor | None = None,
    ) -> Tensor:
        """Loop ``loop`` over the shared block for ``x (B, T, d)``; ``loop`` is an int or a ``(B,)`` tensor.

        ``inputs`` (rotary tables and masks of the pass) come from ``self.body.layer_inputs``.
        """
        n = self.config.n_layer
        per_row = isinstance(loop, Tensor)
        if per_row and self.config.tying != "cycle":
            raise ValueError(
                f"rows at different loops share layers only under cycle tying, not {self.config.tying!r}"
            )
        try:
            for j in range(n):
                layer = j if per_row else self.order[loop * n + j]
                self.loop_index.value = loop if per_row else self.occurrence[loop * n + j]
                cos, sin, kwargs = inputs.of(layer in self.config.local_layers)
                kwargs = dict(kwargs)
                if cache is not None:  # per-row loops: each row's loop of shared layer j (DecoderCache.looped)
                    kwargs.update(cache=cache.loop_layer(j, loop) if per_row else cache.layers[loop * n + j], slots=slots)
                if self.config.prefix_len:
                    kv = self.prefix_kv[loop * n + j]  # (2, H, P, D), or (B, 2, H, P, D) per row
                    kwargs["prefix"] = (kv[:, 0], kv[:, 1]) if per_row else (kv[0:1], kv[1:2])
                x = self.body.blocks[layer](x, cos, sin, **kwargs)
        finally:
            self.loop_index.value = 0
        return x

    def loop_hiddens(
        self,
        idx: Tensor,
        *,
        cache: DecoderCache | None = None,
        slots: Tensor | None = None,
        positions: Tensor | None = None,
        token_valid: Tensor | None = None,
    ) -> list[Tensor]:
        """Hidden states after each of the B loops (before the final norm)."""
        if cache is None and idx.shape[1] > self.config.context_length:
            raise ValueError(f"sequence of {idx.shape[1]} tokens exceeds the model context of {self.config.context_length}")
        x = self.drop(self.embed_tokens(idx, positions if positions is not None else slots))
        inputs = self.body.layer_inputs(x, positions=positions, cache=cache, slots=slots, token_valid=token_valid)
        hiddens = []
        for loop in range(self.config.loops):
            x = self.run_loop(x, loop, inputs, cache=cache, slots=slots)
            hiddens.append(x)
        return hiddens

    def loop_logits(self, idx: Tensor) -> list[Tensor]:
        """Every loop's logits for a full window: static early exit after loop 1, 2, ..., B (section 3.8)."""
        return [self.exit_logits(h) for h in self.loop_hiddens(idx)]

    # -------------------------------------------------------------- the model
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
        """As :meth:`Decoder.forward`; with ``exit_loss`` set and targets given, the loss is the early-exit loss."""
        hiddens = self.loop_hiddens(idx, cache=cache, slots=slots, positions=positions, token_valid=token_valid)
        x = hiddens[-1][:, -1:] if last_only else hiddens[-1]
        logits = self.exit_logits(x)
        if targets is not None and self.config.exit_loss != "none":
            exits = [self.exit_logits(h) for h in hiddens[:-1]] + [logits]
            return logits, self.early_exit_loss(exits, targets)
        return logits, self.loss(logits, targets)

    def exit_weights(self) -> list[float]:
        """alpha_i per loop: i / sum(i) (weighted CE) or ``exit_coefficient`` for intermediate loops and 1 for
        the last (the aggressive strategy of section 3.7, Table 1)."""
        loops = self.config.loops
        if self.config.exit_loss == "weighted":
            return [i / (loops * (loops + 1) / 2) for i in range(1, loops + 1)]
        return [self.config.exit_coefficient] * (loops - 1) + [1.0]

    def early_exit_loss(self, exits: list[Tensor], targets: Tensor) -> Tensor:
        """sum_i alpha_i (CE_i + lambda KL(final.detach() || loop_i)) over the loops' logits ``exits``; the KD
        term (``exit_kd_weight`` = lambda) distils each intermediate loop from the detached final loop."""
        final = exits[-1].detach()
        total = exits[-1].new_zeros((), dtype=torch.float32)
        for i, (weight, logits) in enumerate(zip(self.exit_weights(), exits)):
            term = self.loss(logits, targets)
            if self.config.exit_kd_weight and i < len(exits) - 1:
                term = term + self.config.exit_kd_weight * forward_kl(final, logits, targets)
            total = total + weight * term
        return total

    def allocate_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None) -> DecoderCache:
        """One KV cache entry per depth position (n_layer * loops): the loops share weights, not keys/values."""
        c = self.config
        if max_len > c.context_length:
            raise ValueError(f"cache of {max_len} tokens exceeds the model context of {c.context_length}")
        weight = self.embed.weight
        return DecoderCache(
            c.depth, batch_size, c.n_kv_head, max_len, c.head_dim, dtype=dtype or weight.dtype, device=weight.device
        )
