"""Serving the Block Transformer (Ho et al. 2024): the block decoder steps once per block, the token
decoder once per token over a cache of a single block.

Prompts arrive left-padded with pad tokens to whole blocks (``prompt_multiple``); the block decoder
reads them (the token decoder has no prefill). Rows of a continuous batch share the within-block phase
``filled``, so one token-decoder step serves every row; requests are admitted only at block boundaries
(``admit_every``), when every row's token cache holds just its lead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from blockloop.models.block import BlockTransformer
from blockloop.nn.kv_cache import DecoderCache, StepContext
from blockloop.serve.runners.base import Runner


@dataclass
class BlockDecodeState:
    """The block decoder's cache (each row's next block slot and position), the current block's context
    vectors and token-decoder cache. All rows share the within-block phase ``filled``."""

    block_cache: DecoderCache
    next_block_slot: Tensor
    next_block_position: Tensor
    token_cache: DecoderCache
    vectors: Tensor
    block_tokens: Tensor
    filled: int = 0


class BlockRunner(Runner):
    model: BlockTransformer
    state: BlockDecodeState

    def __init__(self, model: BlockTransformer) -> None:
        super().__init__(model)
        self.prompt_multiple = self.admit_every = model.config.block_len
        self.pad_id = model.config.pad_id

    def allocate(self, n_slots: int, max_len: int) -> None:
        c, model = self.model.config, self.model
        block_cache, token_cache = model.generation_caches(n_slots, max_len, 0)
        device = token_cache.key_valid.device
        zeros = torch.zeros(n_slots, dtype=torch.long, device=device)
        vectors = model.token_decoder.context_vectors(
            torch.zeros(n_slots, c.block_d_model, device=device, dtype=model.token_decoder.embed.weight.dtype)
        )
        blocks = torch.full((n_slots, c.block_len), c.pad_id, dtype=torch.long, device=device)
        self.state = BlockDecodeState(block_cache, zeros, zeros.clone(), token_cache, vectors, blocks)

    @torch.no_grad()
    def prefill_slot(self, slot: int, prompt: Tensor) -> Tensor:
        """Cache ``prompt (P,)`` (whole blocks) in row ``slot``'s block cache and open its first block."""
        state = self.state
        if state.filled:
            raise RuntimeError("requests join a Block Transformer batch only at block boundaries")
        blocks = prompt.view(1, -1, self.model.config.block_len)
        n_blocks = blocks.shape[1]
        cache = state.block_cache.row(slot)
        cache.reset()
        context = self.model.block_context(blocks, StepContext(cache, torch.arange(n_blocks, device=prompt.device)))
        state.next_block_slot[slot] = state.next_block_position[slot] = n_blocks
        state.vectors[slot] = self.model.token_decoder.context_vectors(context)[0]
        return self._start_block(state.vectors[slot : slot + 1], state.token_cache.row(slot))[0]

    @torch.no_grad()
    def prefill_batch(self, idx: Tensor, token_valid: Tensor) -> Tensor:
        """Pad tokens are embedded like in training, blocks that are all padding are masked out of the block
        decoder, and block positions count from each row's first real block."""
        c, state = self.model.config, self.state
        batch = idx.shape[0]
        blocks = idx.masked_fill(~token_valid, c.pad_id).view(batch, -1, c.block_len)
        n_blocks = blocks.shape[1]
        block_valid = token_valid.view(batch, n_blocks, c.block_len).any(-1)
        slots = torch.arange(n_blocks, device=idx.device)
        positions = (slots[None, :] - (~block_valid).sum(1, keepdim=True)).clamp_min(0)
        context = self.model.block_context(blocks, StepContext(state.block_cache, slots, positions, block_valid))
        state.next_block_slot = torch.full_like(positions[:, -1], n_blocks)
        state.next_block_position = positions[:, -1] + 1
        state.vectors = self.model.token_decoder.context_vectors(context)
        return self._start_block(state.vectors, state.token_cache)

    @torch.no_grad()
    def decode_step(self, tokens: Tensor) -> Tensor:
        c, state, tokdec = self.model.config, self.state, self.model.token_decoder
        state.block_tokens[:, state.filled] = tokens
        state.filled += 1
        if state.filled == c.block_len:
            return self._next_block()
        x = tokdec.token_inputs(tokens[:, None], state.vectors, state.filled - 1)
        slot = torch.full((1,), c.n_lead + state.filled - 1, device=tokens.device)
        return self.model.token_logits(x, state.vectors, StepContext(state.token_cache, slot))

    def _next_block(self) -> Tensor:
        """The block is complete: one block-decoder step gives the next context; the local cache restarts.

        Each row writes its own next block slot (rows past the end of the cache, idle rows of a
        continuous batch, rewrite their last one)."""
        state = self.state
        slots = state.next_block_slot.clamp_max(state.block_cache.max_len - 1)[:, None]
        step = StepContext(state.block_cache, slots, state.next_block_position[:, None])
        context = self.model.block_context(state.block_tokens[:, None], step)
        state.next_block_slot = state.next_block_slot + 1
        state.next_block_position = state.next_block_position + 1
        state.vectors = self.model.token_decoder.context_vectors(context)
        state.filled = 0
        return self._start_block(state.vectors, state.token_cache)

    def _start_block(self, vectors: Tensor, token_cache: DecoderCache) -> Tensor:
        """Empty the token cache and read the block's lead positions; the first token's logits."""
        tokdec = self.model.token_decoder
        token_cache.reset()
        slots = torch.arange(tokdec.n_lead, device=vectors.device)
        return self.model.token_logits(tokdec.lead(vectors), vectors, StepContext(token_cache, slots))
