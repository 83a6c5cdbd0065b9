"""Serving the Block Transformer (Ho et al. 2024): the block decoder gives each block's context, the token
decoder reads one token per step over a cache of a single block.

Prompts arrive left-padded with pad tokens to whole blocks (``prompt_multiple``); the block decoder
reads them (the token decoder has no prefill). Rows of a continuous batch share the within-block phase
``filled``, so one token-decoder step serves every row; requests are admitted only at block boundaries
(``admit_every``), when every row's token cache holds just its lead.

One graph for every step: ``filled`` is a device scalar and :meth:`BlockRunner.decode_step` has no
host branch on it (issue 12: the static-shape form a CUDA graph replays, instead of one graph per phase).
So every step runs the block decoder on the block read so far, at the row's next block slot (rewritten
each step until the block is complete), and its context is kept only when the step's token completes the
block; and every step's token-decoder call reads the block's lead positions and the new token together
(at a boundary the cache restarts and the lead comes from the new context; otherwise rereading the lead
rewrites the keys/values it already holds, since the lead attends only to itself). The price is the block
decoder once per token instead of once per block: ``L_B - 1`` of every ``L_B`` block-decoder steps are
discarded, roughly doubling a step's work when the two decoders are the same size (the paper's presets).
The alternative, a branch on the phase, costs one graph per phase (``L_B`` graphs) or a host sync.
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
    vectors, its tokens so far and the token-decoder cache. All rows share the within-block phase
    ``filled``: a device scalar, how many of the block's tokens have been read."""

    block_cache: DecoderCache
    next_block_slot: Tensor
    next_block_position: Tensor
    token_cache: DecoderCache
    vectors: Tensor
    block_tokens: Tensor
    filled: Tensor


class BlockRunner(Runner):
    model: BlockTransformer
    state: BlockDecodeState

    def __init__(self, model: BlockTransformer) -> None:
        super().__init__(model)
        self.prompt_multiple = self.admit_every = model.config.block_len
        self.pad_id = model.config.pad_id

    @torch.no_grad()
    def allocate(self, n_slots: int, max_len: int) -> None:
        c, model = self.model.config, self.model
        block_cache, token_cache = model.generation_caches(n_slots, max_len, 0)
        device = token_cache.key_valid.device
        zeros = torch.zeros(n_slots, dtype=torch.long, device=device)
        vectors = model.token_decoder.context_vectors(
            torch.zeros(n_slots, c.block_d_model, device=device, dtype=model.token_decoder.embed.weight.dtype)
        )
        blocks = torch.full((n_slots, c.block_len), c.pad_id, dtype=torch.long, device=device)
        filled = torch.zeros((), dtype=torch.long, device=device)
        self.state = BlockDecodeState(block_cache, zeros, zeros.clone(), token_cache, vectors, blocks, filled)

    @torch.no_grad()
    def prefill_slot(self, slot: int, prompt: Tensor) -> Tensor:
        """Cache ``prompt (P,)`` (whole blocks) in row ``slot``'s block cache and open its first block."""
        state = self.state
        if state.filled:  # a host sync: prefill is driven from the host
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
        """Read one token per row; the logits of the next (the first of the next block's after its last)."""
        c, state, tokdec = self.model.config, self.state, self.model.token_decoder
        filled = state.filled
        state.block_tokens.index_copy_(1, filled[None], tokens[:, None])
        done = filled == c.block_len - 1  # this token completes the block
        # The block decoder on the block so far; each row writes its own next block slot (rows past the end
        # of the cache, idle rows of a continuous batch, rewrite their last one).
        slots = state.next_block_slot.clamp_max(state.block_cache.max_len - 1)[:, None]
        step = StepContext(state.block_cache, slots, state.next_block_position[:, None])
        context = self.model.block_context(state.block_tokens[:, None], step)
        state.vectors = torch.where(done, tokdec.context_vectors(context), state.vectors)
        state.next_block_slot = state.next_block_slot + done
        state.next_block_position = state.next_block_position + done
        state.filled = torch.where(done, 0, filled + 1)
        # The token decoder: the lead, then this token (at a boundary a placeholder, never marked valid).
        cache = state.token_cache
        cache.mark(torch.arange(cache.max_len, device=tokens.device), cache.key_valid & ~done)  # restarts at a boundary
        lead = torch.arange(tokdec.n_lead, device=tokens.device)
        if c.block_len == 1:  # every step starts a block: no token to read
            return self.model.token_logits(tokdec.lead(state.vectors), state.vectors, StepContext(cache, lead))
        offset = torch.where(done, 0, filled)
        x = torch.cat([tokdec.lead(state.vectors), tokdec.token_inputs(tokens[:, None], state.vectors, offset)], dim=1)
        valid = torch.cat([torch.ones_like(lead, dtype=torch.bool), ~done[None]])[None].expand(len(tokens), -1)
        step = StepContext(cache, torch.cat([lead, tokdec.n_lead + offset[None]]), token_valid=valid)
        return self.model.token_logits(x, state.vectors, step, at=(tokdec.n_lead - done.long())[None])

    def _start_block(self, vectors: Tensor, token_cache: DecoderCache) -> Tensor:
        """Empty the token cache and read the block's lead positions; the first token's logits."""
        tokdec = self.model.token_decoder
        token_cache.reset()
        slots = torch.arange(tokdec.n_lead, device=vectors.device)
        return self.model.token_logits(tokdec.lead(vectors), vectors, StepContext(token_cache, slots))
