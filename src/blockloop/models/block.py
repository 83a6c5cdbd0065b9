"""Block Transformer (Ho et al. 2024, "Block Transformer: Global-to-Local Language Modeling for Fast Inference").

Three parts, as in section 2:

* the **embedder** (2.2, F.1) turns each block of ``L_B`` tokens into one input block embedding;
* the **block decoder** (2.3) is a causal transformer over block embeddings; its output for block ``i``
  is the *context embedding* from which block ``i + 1`` is decoded;
* the **token decoder** (2.4, F.2) decodes the ``L_B`` tokens of a block from that context embedding
  alone, attending only within the block, with its own embedding table and LM head.

Global attention therefore runs over ``T / L_B`` positions and the token decoder's cache never holds
more than one block: that is where the decode-time KV savings of Table 1 come from. Block 0 of a
sequence has no context embedding, so its tokens are not predicted (its logits are zeros and its
targets are ignored). Generation (:mod:`blockloop.serve.runners.block`) calls :meth:`BlockTransformer.block_context`
once per block and :meth:`BlockTransformer.token_logits` once per token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from blockloop.errors import ConfigError, check_context
from blockloop.models.decoder import LanguageModel, TransformerStack, count_parameters
from blockloop.nn.init import init_weights
from blockloop.nn.kv_cache import DecoderCache, StepContext
from blockloop.nn.linear import Linear
from blockloop.nn.paged_cache import KVPages

if TYPE_CHECKING:
    from blockloop.families.block import BlockTransformerConfig


class LookupEmbedder(nn.Module):
    """Concatenate the block's token embeddings (width ``embed_dim`` each) into one block embedding.

    With ``L_B * embed_dim == d`` this is the paper's default lookup embedder; otherwise a linear layer
    maps the concatenation to ``d`` (the fully connected layer of appendix G.8 for uptraining).
    """

    def __init__(self, config: BlockTransformerConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.padded_vocab_size, config.embed_dim)
        width = config.block_len * config.embed_dim
        self.proj = Linear(width, config.block_d_model, bias=False) if width != config.block_d_model else nn.Identity()

    def forward(self, blocks: Tensor) -> Tensor:
        return self.proj(self.embed(blocks).flatten(-2))


class EncoderEmbedder(nn.Module):
    """A small bidirectional transformer over each block (F.1 "Encoder"), or over learned CLS tokens
    prepended to it (F.1 "CLS token"); the outputs (all tokens, or the CLS tokens) are concatenated and
    projected to the block width."""

    def __init__(self, config: BlockTransformerConfig) -> None:
        super().__init__()
        self.n_cls = config.n_cls if config.embedder == "cls" else 0
        self.embed = nn.Embedding(config.padded_vocab_size, config.embed_dim)
        self.cls = nn.Parameter(torch.zeros(self.n_cls, config.embed_dim)) if self.n_cls else None
        self.encoder = TransformerStack(config.embedder_config(), causal=False)
        readout = self.n_cls or config.block_len
        self.proj = Linear(readout * config.embed_dim, config.block_d_model, bias=False)

    def forward(self, blocks: Tensor) -> Tensor:
        batch, n_blocks, block_len = blocks.shape
        x = self.embed(blocks.flatten(0, 1))
        if self.cls is not None:
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)
        hidden = self.encoder(x)
        readout = hidden[:, : self.n_cls] if self.cls is not None else hidden
        return self.proj(readout.flatten(1)).view(batch, n_blocks, -1)


class TokenDecoder(nn.Module):
    """Decodes one block's tokens from its context embedding (appendix F.2).

    The token decoder's input sequence for a block is ``n_lead`` lead positions followed by the block's
    first ``L_B - 1`` tokens; the outputs from the last lead position on predict the ``L_B`` tokens.
    ``prefix``: the lead is ``prefix_len`` vectors projected from the context. ``sum``: one start token
    (the pad embedding), and a projected context vector is added at each of the ``L_B`` input positions.
    ``cross``: one start token, and every layer cross-attends to ``L_B`` projected context states.
    """

    def __init__(self, config: BlockTransformerConfig) -> None:
        super().__init__()
        self.kind, self.n_lead, self.block_len, self.pad_id = config.token_decoder, config.n_lead, config.block_len, config.pad_id
        body = config.token_decoder_config()
        self.d = body.d_model
        self.embed = nn.Embedding(config.padded_vocab_size, self.d)
        context_vectors = config.prefix_len if self.kind == "prefix" else config.block_len
        self.context_proj = Linear(config.block_d_model, context_vectors * self.d, bias=False)
        self.body = TransformerStack(body, cross_attention=self.kind == "cross")
        self.lm_head = Linear(self.d, config.padded_vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def context_vectors(self, context: Tensor) -> Tensor:
        return self.context_proj(context).unflatten(-1, (-1, self.d))  # no -1 over the batch: it may hold no block

    def lead(self, vectors: Tensor) -> Tensor:
        """Embeddings of the lead positions, ``(M, n_lead, d)``."""
        if self.kind == "prefix":
            return vectors
        start = self.embed.weight[self.pad_id].expand(vectors.shape[0], 1, self.d)
        return start + vectors[:, :1] if self.kind == "sum" else start

    def token_inputs(self, tokens: Tensor, vectors: Tensor, offset: int | Tensor) -> Tensor:
        """Embeddings of block tokens ``tokens (M, k)`` that sit at input positions ``offset + 1 ...``
        (``offset`` may be a device scalar: generation's within-block phase)."""
        x = self.embed(tokens)
        if self.kind == "sum":
            x = x + vectors[:, offset + 1 + torch.arange(tokens.shape[1], device=tokens.device)]
        return x

    def memory(self, vectors: Tensor) -> Tensor | None:
        return vectors if self.kind == "cross" else None

    def forward(self, context: Tensor, tokens: Tensor) -> Tensor:
        """Logits ``(M, L_B, V)`` for blocks ``tokens (M, L_B)`` given their contexts ``(M, d_block)``."""
        vectors = self.context_vectors(context)
        x = torch.cat([self.lead(vectors), self.token_inputs(tokens[:, :-1], vectors, 0)], dim=1)
        hidden = self.body(x, memory=self.memory(vectors))
        return self.lm_head(hidden[:, self.n_lead - 1 :])


class BlockTransformer(nn.Module):
    """Embedder -> block decoder -> token decoder, trained with next-token loss on every block but the first."""

    def __init__(self, config: BlockTransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embedder = LookupEmbedder(config) if config.embedder == "lookup" else EncoderEmbedder(config)
        self.drop = nn.Dropout(config.embed_dropout)
        self.block_decoder = TransformerStack(config.block_decoder_config())
        self.token_decoder = TokenDecoder(config)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        c = self.config
        init_weights(self, std=c.init_std, n_layer=c.block_n_layer + c.token_n_layer, scheme=c.init)
        if isinstance(self.embedder, EncoderEmbedder) and self.embedder.cls is not None:
            nn.init.normal_(self.embedder.cls, std=c.init_std)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Logits ``(B, T, V)`` where position ``t`` predicts token ``idx[:, t]`` itself (block 0: zeros).

        ``targets`` are the labels of the block family's batching (:func:`blockloop.families.block.make_batch`):
        same positions, ``IGNORE_INDEX`` = not scored.
        """
        c = self.config
        batch, length = idx.shape
        if length % c.block_len:
            raise ConfigError(f"sequence length {length} is not a multiple of block_len={c.block_len}; pad or cut it to "
                              "whole blocks")
        check_context(length, c.context_length, "sequence")
        blocks = idx.view(batch, -1, c.block_len)
        context = self.block_decoder(self.drop(self.embedder(blocks)))
        logits = self.token_decoder(context[:, :-1].flatten(0, 1), blocks[:, 1:].flatten(0, 1))
        logits = logits.view(batch, length - c.block_len, logits.shape[-1])  # a one-block window predicts nothing
        logits = torch.cat([logits.new_zeros(batch, c.block_len, logits.shape[-1]), logits], dim=1)
        return logits, LanguageModel.loss(logits, targets)

    def num_parameters(self, *, non_embedding: bool = False) -> int:
        tables = (self.embedder.embed, self.token_decoder.embed, self.token_decoder.lm_head)
        return count_parameters(self, tables if non_embedding else ())

    # ----------------------------------------------------------- generation
    def generation_caches(
        self, batch_size: int, prompt_len: int, max_new_tokens: int, *, pages: KVPages | None = None
    ) -> list[DecoderCache]:
        """The block decoder's cache (one entry per block of prompt and output; paged over ``pages``) and the
        token decoder's cache of a single block: all the memory generation holds."""
        c = self.config
        weight = self.token_decoder.embed.weight
        n_blocks = -(-(prompt_len + max_new_tokens) // c.block_len)
        return [
            self.block_decoder.allocate_cache(batch_size, n_blocks, dtype=weight.dtype, device=weight.device, pages=pages),
            self.token_decoder.body.allocate_cache(
                batch_size, c.n_lead + c.block_len - 1, dtype=weight.dtype, device=weight.device
            ),
        ]

    def block_context(self, blocks: Tensor, step: StepContext) -> Tensor:
        """Context embeddings ``(B, d_block)`` after the blocks ``(B, n, L_B)`` (the last one's), cached."""
        return self.block_decoder(self.embedder(blocks), step=step)[:, -1]

    def token_logits(self, x: Tensor, vectors: Tensor, step: StepContext) -> Tensor:
        """The token decoder over inputs ``x (B, T, d)`` of a block with context ``vectors``, cached: the
        logits ``(B, V)`` of the last input position."""
        tokdec = self.token_decoder
        return tokdec.lm_head(tokdec.body(x, step=step, memory=tokdec.memory(vectors))[:, -1])
