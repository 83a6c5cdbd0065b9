"""Recursive and Relaxed Recursive Transformers (Bae et al. 2024, "Relaxed Recursive Transformers").

A Recursive Transformer keeps ``n_layer`` unique layers Φ' and runs them ``loops`` = B times, so its looped
depth is L = n_layer * B (section 2.2, equation 2): position ℓ of the depth runs shared layer
``layer_order(...)[ℓ]``. The looping is only an execution order over the ordinary :class:`Block` s of a
:class:`TransformerStack`; every tied parameter, norms included, is one tensor used B times.

The Relaxed Recursive Transformer (section 2.3, equation 3) adds one LoRA module per loop to every shared
linear weight (:mod:`blockloop.nn.lora`), or, as the alternative of appendix K, learned per-position
prefix keys/values for self-attention. With ``loop_norms`` every norm of a shared layer (pre, sandwich, q/k)
has its own gain per loop too (:class:`~blockloop.nn.norm.LoopNorm`), what a converted model needs for its
full-rank relaxation to be exact (see :mod:`blockloop.convert.to_recursive`). Early-exit training (section 3.7, appendix M) reads every loop's
output through the shared final norm and LM head.

Interface for continuous depth-wise batching (section 2.4; :mod:`blockloop.serve.runners.recursive`):
:meth:`RecursiveDecoder.run_loop` runs loop ``k`` of the shared block on hidden states ``x (B, T, d)`` where
``k`` is an ``int`` or a ``(B,)`` tensor giving each row its own loop. With a tensor, all rows go through the
same shared layers in one batched call (CYCLE tying only: there loop k runs layers 0..n_layer-1 for every k)
and each row's LoRA delta and prefix are gathered by its loop index; the step's cache must then lay the
loops out per row (``cache.loop_layer(j, loop)``, the runner's looped cache), so each row reads and writes
its own loop's entries. :meth:`embed_input`, :meth:`loop_inputs` and :meth:`exit_logits` are the entry, the
shared per-pass inputs and the exit around it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from blockloop.errors import check_context
from blockloop.models.decoder import Decoder, LayerInputs
from blockloop.models.prefix_attention import PrefixSelfAttention
from blockloop.nn.distill import forward_kl
from blockloop.nn.kv_cache import DecoderCache, StepContext
from blockloop.nn.lora import LoopIndex, LoopLoRALinear, add_loop_lora
from blockloop.nn.masks import with_visible_prefix
from blockloop.nn.norm import add_loop_norms
from blockloop.nn.paged_cache import KVPages

if TYPE_CHECKING:
    from blockloop.families.recursive import RecursiveConfig


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


def local_positions(config: RecursiveConfig) -> list[bool]:
    """Whether each depth position attends locally (sliding window): its shared layer's type, or its own."""
    order = layer_order(config.n_layer, config.loops, config.tying)
    return [layer in config.local_layers or p in config.local_depths for p, layer in enumerate(order)]


def rolling_positions(config: RecursiveConfig) -> list[int]:
    """Depth positions whose cache entry is a ring of ``sliding_window`` slots: every local one. Each depth
    position caches its own keys and values, so a shared layer local at some loops and global at others
    keeps rings at its local positions and full-length entries at its global ones (depth-wise batching,
    which stacks a shared layer's loops in one buffer, rings only layers local at every loop)."""
    return [p for p, is_local in enumerate(local_positions(config)) if is_local]


class RecursiveDecoder(Decoder):
    """A decoder whose ``n_layer`` blocks are looped ``loops`` times (equation 2), optionally relaxed (equation 3).

    Served sequence-wise like a decoder, or depth-wise (:mod:`blockloop.serve.runners.recursive`); the KV
    cache has one entry per depth position, n_layer * loops, because each loop computes new keys and values
    with the shared weights.
    """

    config: RecursiveConfig

    def __init__(self, config: RecursiveConfig) -> None:
        super().__init__(config)
        self.order = layer_order(config.n_layer, config.loops, config.tying)
        # Which of its LoRA modules a shared layer uses at each depth position: the how-many-th use it is
        # (the loop under cycle tying; the k-th repeat in place under sequence tying).
        self.occurrence = [self.order[:p].count(layer) for p, layer in enumerate(self.order)]
        self.loop_index = LoopIndex()
        self.local = local_positions(config)
        n = config.n_layer
        by_loop = [self.local[loop * n : (loop + 1) * n] for loop in range(config.loops)]  # under cycle tying
        self.register_buffer("loop_local", torch.tensor(by_loop), persistent=False)
        self.mixed = [len({kinds[j] for kinds in by_loop}) > 1 for j in range(n)]
        self.rolling = rolling_positions(config)
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
        if config.loop_norms:
            add_loop_norms(self.body.blocks, loops=config.loops, loop=self.loop_index)
        if config.prefix_len or config.lora_rank or config.loop_norms:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        for lora in self.lora_layers():
            lora.reset_lora()
        if getattr(self, "prefix_kv", None) is not None:
            nn.init.normal_(self.prefix_kv, std=self.config.init_std)

    def lora_layers(self) -> list[LoopLoRALinear]:
        """The shared linears that carry one LoRA per loop (section 2.3): what a relaxation adds to the shared block."""
        return [m for m in self.modules() if isinstance(m, LoopLoRALinear)]

    # -------------------------------------------------------------- one loop
    def exit_logits(self, x: Tensor) -> Tensor:
        """Logits of hidden states after any loop: the shared final norm and LM head (section 3.7)."""
        return self.logits(self.norm(x))

    def embed_input(self, idx: Tensor, positions: Tensor | None = None) -> Tensor:
        """The hidden states loop 0 reads: token (and learned position) embeddings, dropout."""
        return self.drop(self.embed_tokens(idx, positions))

    def loop_inputs(self, x: Tensor, step: StepContext | None = None) -> LayerInputs:
        """Rotary tables and masks every loop of one pass shares (marks the step's slots written)."""
        return self.body.layer_inputs(x, step, local=any(self.local))

    def run_loop(self, x: Tensor, loop: int | Tensor, inputs: LayerInputs, *, step: StepContext | None = None) -> Tensor:
        """Loop ``loop`` over the shared block for ``x (B, T, d)``; ``loop`` is an int or a ``(B,)`` tensor.

        ``inputs`` (rotary tables and masks of the pass) come from :meth:`loop_inputs`.
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
                entry = j if per_row else loop * n + j  # a depth position (loop 0's, for rows at their own loops)
                if per_row and self.mixed[j]:  # shared layer j is local at some loops only: each row by its own
                    cos, sin, kwargs = inputs.per_row(self.loop_local[loop, j])
                else:
                    cos, sin, kwargs = inputs.of(self.local[entry], step is not None and entry in step.cache.rolling)
                kwargs = dict(kwargs)
                if step is not None:  # per-row loops: each row's loop of shared layer j (a looped cache)
                    kwargs["kv"] = step.layer(j, step.cache.loop_layer(j, loop)) if per_row else step.layer(loop * n + j)
                if self.config.prefix_len:
                    kv = self.prefix_kv[loop * n + j]  # (2, H, P, D), or (B, 2, H, P, D) per row
                    kwargs["prefix"] = (kv[:, 0], kv[:, 1]) if per_row else (kv[0:1], kv[1:2])
                    if kwargs.get("mask") is not None:  # a cache's mask: every query also sees the whole prefix
                        kwargs["mask"] = with_visible_prefix(kwargs["mask"], self.config.prefix_len)
                x = self.body.blocks[layer](x, cos, sin, **kwargs)
        finally:
            self.loop_index.value = 0
        return x

    def loop_hiddens(self, idx: Tensor, *, step: StepContext | None = None) -> list[Tensor]:
        """Hidden states after each of the B loops (before the final norm)."""
        if step is None:
            check_context(idx.shape[1], self.config.context_length, "sequence")
        x = self.embed_input(idx, step.token_positions if step is not None else None)
        inputs = self.loop_inputs(x, step)
        hiddens = []
        for loop in range(self.config.loops):
            x = self.run_loop(x, loop, inputs, step=step)
            hiddens.append(x)
        return hiddens

    def loop_logits(self, idx: Tensor) -> list[Tensor]:
        """Every loop's logits for a full window: static early exit after loop 1, 2, ..., B (section 3.7, Table 1;
        appendix M)."""
        return [self.exit_logits(h) for h in self.loop_hiddens(idx)]

    # -------------------------------------------------------------- the model
    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        *,
        step: StepContext | None = None,
        last_only: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """As :meth:`Decoder.forward`; with ``exit_loss`` set and targets given, the loss is the early-exit loss."""
        hiddens = self.loop_hiddens(idx, step=step)
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
        term (``exit_kd_weight`` = lambda) distils each intermediate loop from the detached final loop. The paper
        (section 3.7, appendix M) names the KD loss but gives no formula for combining it with the alpha_i: weighting
        it with its loop's CE is blockloop's reading."""
        final = exits[-1].detach()
        total = exits[-1].new_zeros((), dtype=torch.float32)
        for i, (weight, logits) in enumerate(zip(self.exit_weights(), exits)):
            term = self.loss(logits, targets)
            if self.config.exit_kd_weight and i < len(exits) - 1:
                term = term + self.config.exit_kd_weight * forward_kl(final, logits, targets)
            total = total + weight * term
        return total

    def allocate_cache(
        self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None, pages: KVPages | None = None,
        rollback: int = 0,
    ) -> DecoderCache:
        """One KV cache entry per depth position (n_layer * loops): the loops share weights, not keys/values
        (static, or paged over ``pages``). The :attr:`rolling` positions' entries are rings of
        ``sliding_window + rollback`` slots."""
        c = self.config
        check_context(max_len, c.context_length, "cache", "allocate fewer slots")
        weight = self.embed.weight
        return DecoderCache(
            c.depth, batch_size, c.n_kv_head, max_len, c.head_dim, dtype=dtype or weight.dtype, device=weight.device,
            pages=pages, rolling=self.rolling, window=c.sliding_window or 0, rollback=rollback,
        )
