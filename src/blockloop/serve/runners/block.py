"""Serving the Block Transformer (Ho et al. 2024): the block decoder gives each block's context, the token
decoder reads one token per step over a cache of a single block.

Prompts arrive left-padded with pad tokens to whole blocks (``prompt_multiple``); the block decoder
reads them (the token decoder has no prefill). Rows of a continuous batch share the within-block phase
``filled``, so one token-decoder step serves every row; requests are admitted only at block boundaries
(``admit_every``), when every row's token cache holds just its lead.

Two static graphs, chosen on the host: every row shares the phase and requests join only at block
boundaries, so which step comes next is a fixed schedule the runner counts on the host (no sync, nothing
data-dependent). Reading a token inside the block is one graph for every phase (the phase ``filled`` is a
device scalar, so the token's input position and cache slot are indices, not constants); closing a block
(the block decoder's step, then the new block's lead through the token decoder) is the other.
:meth:`BlockRunner.compiled_step` compiles the two separately (issue 12: static-shape steps a CUDA graph
replays). The block decoder runs once per block, as in the paper; a single graph would run it every token.

With ``paging`` the block decoder's cache (the one that grows with the sequence, one entry per block) is paged
(:mod:`blockloop.serve.runners.paging`): a request holds the pages of its prompt's and output's blocks from
admission (its whole budget: re-prefilling a preempted request would re-pad its blocks) and frees them when it
finishes. The token decoder's cache is one block per row, never more, and stays static.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from blockloop.models.block import BlockTransformer
from blockloop.nn.kv_cache import DecoderCache, StepContext
from blockloop.nn.paged_cache import KVPages
from blockloop.serve.runners.base import Runner, over_rows, prefix_views, static_state
from blockloop.serve.runners.paging import PagedRows, Paging


@dataclass
class BlockDecodeState:
    """The block decoder's cache (each row's next block slot and position), the current block's context
    vectors, its tokens so far and the token-decoder cache. All rows share the within-block phase
    ``filled``: a device scalar, how many of the block's tokens have been read. ``prefixes``: the block and
    token caches of a step over the first ``n`` rows by ``n`` (:func:`prefix_views`)."""

    block_cache: DecoderCache
    next_block_slot: Tensor
    next_block_position: Tensor
    token_cache: DecoderCache
    vectors: Tensor
    block_tokens: Tensor
    filled: Tensor
    prefixes: dict[int, tuple[DecoderCache, DecoderCache]] = field(repr=False)


class BlockRunner(PagedRows, Runner):
    model: BlockTransformer
    state: BlockDecodeState
    prefix_steps = True

    def __init__(self, model: BlockTransformer, paging: Paging | None = None) -> None:
        super().__init__(model)
        self.paging = paging
        self.prompt_multiple = self.admit_every = self.tokens_per_entry = model.config.block_len
        self.pad_id = model.config.pad_id
        self.phase = 0  # tokens of the current block read so far: the host's copy of ``state.filled``
        self._steps = (self._read_token, self._close_block)

    @torch.no_grad()
    def allocate(self, n_slots: int, max_len: int) -> None:
        c, model = self.model.config, self.model
        device = model.token_decoder.embed.weight.device
        n_blocks = -(-max_len // c.block_len)
        pages = None if self.paging is None else self.paging.pages(n_slots, n_blocks, device, tokens_per_entry=c.block_len)
        block_cache, token_cache = model.generation_caches(n_slots, max_len, 0, pages=pages)
        zeros = torch.zeros(n_slots, dtype=torch.long, device=device)
        vectors = model.token_decoder.context_vectors(
            torch.zeros(n_slots, c.block_d_model, device=device, dtype=model.token_decoder.embed.weight.dtype)
        )
        blocks = torch.full((n_slots, c.block_len), c.pad_id, dtype=torch.long, device=device)
        filled = torch.zeros((), dtype=torch.long, device=device)
        static_state(blocks)  # each step writes its token into the block in place
        self.phase = 0
        token_views = prefix_views(token_cache)
        prefixes = {n: (view, token_views[n]) for n, view in prefix_views(block_cache).items()}
        self.state = BlockDecodeState(block_cache, zeros, zeros.clone(), token_cache, vectors, blocks, filled, prefixes)

    @property
    def _pages(self) -> KVPages | None:
        return self.state.block_cache.pages

    def limit_keys(self, n_tokens: int) -> None:
        """The block decoder's cache keeps an entry per block; the token decoder's is a block long already."""
        entries = -(-n_tokens // self.model.config.block_len)
        for cache in (self.state.block_cache, *(block for block, _ in self.state.prefixes.values())):
            cache.limit_keys(entries)

    @torch.no_grad()
    def prefill_rows(self, start: int, prompts: Tensor) -> Tensor:
        """Cache ``prompts (n, P)`` (whole blocks, one length) in rows ``start .. start + n - 1`` in one block-decoder
        forward and open their first blocks: a window's admitted requests are one forward, not one each."""
        state = self.state
        if self.phase:
            raise RuntimeError("requests join a Block Transformer batch only at block boundaries")
        n = prompts.shape[0]
        blocks = prompts.view(n, -1, self.model.config.block_len)
        n_blocks = blocks.shape[1]
        cache = state.block_cache.rows(start, start + n)
        cache.reset()
        context = self.model.block_context(blocks, StepContext(cache, torch.arange(n_blocks, device=prompts.device)))
        state.next_block_slot[start : start + n] = state.next_block_position[start : start + n] = n_blocks
        state.vectors[start : start + n] = self.model.token_decoder.context_vectors(context)
        return self._start_block(state.vectors[start : start + n], state.token_cache.rows(start, start + n))

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
        closing = self.phase == self.model.config.block_len - 1
        self.phase = 0 if closing else self.phase + 1
        return self._steps[closing](tokens)

    def compiled_step(self, compile: Callable[[Callable], Callable]) -> Callable[[Tensor], Tensor]:
        """Each of the two static steps compiled on its own; :meth:`decode_step` picks one by the host phase."""
        self._steps = tuple(compile(step) for step in self._steps)
        return self.decode_step

    def _read_token(self, tokens: Tensor) -> Tensor:
        """A token inside the block for each of the first ``len(tokens)`` rows: the token decoder only, at the
        device phase's input position and slot."""
        state, tokdec, rows = self.state, self.model.token_decoder, len(tokens)
        filled, vectors = state.filled, state.vectors[:rows]
        state.block_tokens[:rows].index_copy_(1, filled[None], tokens[:, None])
        x = tokdec.token_inputs(tokens[:, None], vectors, filled)
        step = StepContext(state.prefixes[rows][1], (tokdec.n_lead + filled)[None])
        state.filled = filled + 1
        return self.model.token_logits(x, vectors, step)

    def _close_block(self, tokens: Tensor) -> Tensor:
        """The block's last token: one block-decoder step gives the next context and the token cache restarts.

        Each row writes its own next block slot (rows past the end of the cache, idle rows of a continuous
        batch, rewrite their last one). A prefix step keeps the other rows' context vectors (idle rows; a
        prefill writes its row's)."""
        state, rows = self.state, len(tokens)
        block_cache, token_cache = state.prefixes[rows]
        state.block_tokens[:rows, -1] = tokens
        slots = state.next_block_slot[:rows].clamp_max(block_cache.max_len - 1)[:, None]
        step = StepContext(block_cache, slots, state.next_block_position[:rows, None])
        context = self.model.block_context(state.block_tokens[:rows, None], step)
        state.next_block_slot = state.next_block_slot + 1
        state.next_block_position = state.next_block_position + 1
        vectors = self.model.token_decoder.context_vectors(context)
        state.vectors = over_rows(vectors, state.vectors)
        state.filled = torch.zeros_like(state.filled)
        return self._start_block(vectors, token_cache)

    def _start_block(self, vectors: Tensor, token_cache: DecoderCache) -> Tensor:
        """Empty the token cache and read the block's lead positions; the first token's logits."""
        tokdec = self.model.token_decoder
        token_cache.reset()
        slots = torch.arange(tokdec.n_lead, device=vectors.device)
        return self.model.token_logits(tokdec.lead(vectors), vectors, StepContext(token_cache, slots))
