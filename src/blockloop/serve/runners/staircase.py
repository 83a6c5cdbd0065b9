"""Serving the staircase family (Staircase, Cached / Global Cached Staircase, Feedback Transformer) as
streams over static per-slot buffers: each new token costs one query per pass, and a chunk boundary is a
few masked copies, so :meth:`StaircaseRunner.decode_step` is one static-shape graph (issue 12).

**Windows at fixed positions.** A chunk's pass k attends to its window (the cache, then the older chunks
in flight, each at a later pass; see :mod:`blockloop.models.staircase`, "Segments and state") and to its
own tokens causally. Every row lays pass k's window out the same way, slot = rotary position: the cache
in ``cache_tokens`` slots, then one C-slot block per older chunk, oldest first, ending at ``n_k =
cache_tokens + (P - 1 - k) C``; the chunk being written sits at ``n_k + phase``. A young stream's missing
chunks and cache entries are invalid slots at the start, so the distances between real tokens, all that
rotary attention sees, are those of the model's forward.

**The boundary is a shift.** Once a chunk is complete, the next chunk's window at pass k is what pass
k + 1 holds: the same cache (the two passes run in the same staircase step), the same older chunks at the
same passes, and the completed chunk's own keys/values at pass k + 1, at the same positions. The last
pass's window is the cache alone: it drops its oldest C entries and gains the completed chunk's finished
states, whose keys/values each token's read already computes (its last pass is read at once). So nothing
is recomputed at a boundary: pass buffer k takes pass buffer k + 1, the chunk slots empty. Rows of a
continuous batch are at their own phases, so every step computes the boundary for every row and keeps it
where the row's chunk is complete (``torch.where``): copies of the pass buffers, cheap beside recomputing
the windows.

**The cache window is double-buffered.** Every cached key moves C positions down at each boundary, so
the whole cache window is rotated again once per chunk: doing that every step (the static form) would
cost a rotation of the cache per token. Instead the last pass's buffer holds two cache halves, masked by
validity: the chunk reads the live one while each step rotates 1/C of the next window into the other, from
a ring of un-rotated entries (no shifting); at the boundary the halves swap, which is a change of masks.
Attention reads both halves (one more cache read per token). Prefill stays host-driven: the model's
forward gives the stream state, whose flush steps give the windows (:meth:`StaircaseRunner._load`).

**Prefix steps.** Every row's state is its own (its buffers' rows, its phase, ring head and live half), so a
step may read the first ``n`` rows only (``prefix_steps``): over views of the buffers' first rows, built once
(:meth:`StaircaseSlots.buffers`), while the rows past them keep their state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from blockloop.models.recurrent_core import rotate_prefix
from blockloop.models.staircase import Staircase, StaircaseState
from blockloop.nn.kv_cache import DecoderCache, StepContext
from blockloop.nn.rope import rope_angles
from blockloop.serve.runners.base import Runner, over_rows, prefix_views, row_buckets, static_state


@dataclass
class StaircaseSlots:
    """Generation state of ``B`` slots, each a stream at its own phase (continuous batching).

    ``passes[k]``: pass k's :class:`~blockloop.nn.kv_cache.DecoderCache` (one layer entry per core layer):
    the window at slots ``0 .. n_k - 1``, the chunk being written in the last C slots (a per-pass KV cache).
    With a cache, the last pass's window has two halves of ``cache_tokens`` slots: the ``live`` one the
    chunk reads and the one being prepared for the next chunk (``next_valid``: its real entries).
    ``cache``: a ring of ``cache_tokens + C`` un-rotated cache entries per row, the window's from ring slot
    ``head`` on, then the chunk's. ``phase (B,)``: how many tokens of its chunk each row has read.
    ``prefixes``: ``passes`` and ``cache`` of a step over the first ``n`` rows, by ``n`` (:func:`prefix_views`).
    """

    passes: list[DecoderCache]
    cache: DecoderCache | None
    head: Tensor
    live: Tensor
    next_valid: Tensor
    phase: Tensor
    prefixes: dict[int, tuple[list[DecoderCache], DecoderCache | None]] = field(default_factory=dict, repr=False)

    def buffers(self, rows: slice) -> tuple[list[DecoderCache], DecoderCache | None]:
        """``passes`` and ``cache`` for ``rows``: built once for a step's first rows, views made now otherwise
        (a prefill)."""
        if rows.start == 0 and rows.stop in self.prefixes:
            return self.prefixes[rows.stop]
        return [p.rows(rows.start, rows.stop) for p in self.passes], self.cache and self.cache.rows(rows.start, rows.stop)


class StaircaseRunner(Runner):
    model: Staircase
    state: StaircaseSlots
    prefix_steps = True
    streams = True  # fixed-size per-pass buffers and ring, positions local to each window

    def allocate(self, n_slots: int, max_len: int) -> None:
        """Static decode buffers for ``n_slots`` streams; each starts empty. ``max_len`` is not needed: the
        buffers are bounded by the step size and cache, not the stream length."""
        c, weight = self.model.config, self.model.embed.weight

        def buffer(width: int) -> DecoderCache:
            return DecoderCache(c.n_layer, n_slots, c.n_kv_head, width, c.head_dim, dtype=weight.dtype, device=weight.device)

        widths = [self._window(k) + c.chunk_size for k in range(c.passes)]
        widths[-1] += c.cache_tokens  # the last pass's second cache half
        zeros = torch.zeros(n_slots, dtype=torch.long, device=weight.device)
        next_valid, phase = zeros.new_zeros(n_slots, c.cache_tokens, dtype=torch.bool), zeros.clone()
        static_state(next_valid, phase)  # a chunk boundary resets them in place
        passes = [prefix_views(buffer(width)) for width in widths]
        ring = prefix_views(buffer(c.cache_tokens + c.chunk_size)) if c.cache_tokens else None
        prefixes = {n: ([views[n] for views in passes], ring and ring[n]) for n in row_buckets(n_slots)}
        self.state = StaircaseSlots(*prefixes[n_slots], zeros, zeros.clone(), next_valid, phase, prefixes)

    def _window(self, k: int) -> int:
        """``n_k``: the slots of pass k's window (the cache and the ``P - 1 - k`` older chunks)."""
        c = self.model.config
        return c.cache_tokens + (c.passes - 1 - k) * c.chunk_size

    @torch.no_grad()
    def prefill_rows(self, start: int, prompts: Tensor) -> Tensor:
        """Read ``prompts (n, P)`` as new streams in rows ``start .. start + n - 1``, in one forward: whole chunks
        through the model, the incomplete last chunk token by token as decoding reads it."""
        logits, _, state = self.model(prompts, return_state=True)
        rows = slice(start, start + len(prompts))
        self._load(rows, state)
        length = prompts.shape[1]
        done = length - length % self.model.config.chunk_size
        if done < length:
            rest = prompts[:, done:]
            self._read(rest, torch.ones_like(rest, dtype=torch.bool), rows)
        return logits[:, -1]

    @torch.no_grad()
    def prefill_batch(self, idx: Tensor, token_valid: Tensor) -> Tensor:
        """Left-padded prompts, chunks counted from the padded start (as the forward does)."""
        logits, _, state = self.model(idx, token_valid=token_valid, return_state=True)
        rows = slice(0, len(idx))
        self._load(rows, state)
        start = idx.shape[1] - idx.shape[1] % self.model.config.chunk_size
        if start < idx.shape[1]:
            self._read(idx[:, start:], token_valid[:, start:], rows)
        return logits[:, -1]

    @torch.no_grad()
    def decode_step(self, tokens: Tensor) -> Tensor:
        """Read one token per row of the first ``len(tokens)`` rows through its S / C (or m) passes, each a
        one-query attention over that pass's window and the chunk so far; rows whose chunk is now complete
        start the next one."""
        m, rows = self.model, slice(0, len(tokens))
        h = self._read(tokens[:, None], torch.ones_like(tokens[:, None], dtype=torch.bool), rows)
        self._advance(self.state.phase[rows] == m.config.chunk_size, rows)
        return m.logits(m.norm(h))[:, -1]

    def _read(self, ids: Tensor, valid: Tensor, rows: slice) -> Tensor:
        """Append ``ids (B, T)`` to the chunk each of ``rows`` is writing, through every pass, and (Cached
        variants) write the cache entries of their finished states; their final states ``(B, T, d)``."""
        m, slots = self.model, self.state
        c, T = m.config, ids.shape[1]
        passes, ring = slots.buffers(rows)
        chunk = slots.phase[rows][:, None] + torch.arange(T, device=ids.device)
        states = [m.embed(ids)]
        for k, cache in enumerate(passes):
            cos, sin = rope_angles(self._window(k) + chunk, c.rotary_dim, c.rope_base)
            at = cache.max_len - c.chunk_size + chunk
            states = m.read_pass(states[-1], cos, sin, StepContext(cache, at, token_valid=valid))
        if ring is not None:
            cache, at = ring, self._ring(rows, c.cache_tokens + chunk)
            for layer, (k, v) in zip(cache.layers, m.cache_entries(states, T)):
                layer.write(at, k, v)
            cache.mark(at, valid)
            self._prepare(rows, chunk)
        slots.phase[rows] += T
        return states[-1]

    def _ring(self, rows: slice, positions: Tensor) -> Tensor:
        """Ring slots of window ``positions (B, N)`` of ``rows`` (past ``cache_tokens``: the chunk's entries)."""
        return (self.state.head[rows][:, None] + positions) % self.state.cache.max_len  # type: ignore[union-attr]

    def _prepare(self, rows: slice, chunk: Tensor) -> None:
        """Rotate into the last pass's other cache half the next chunk's window entries whose turn comes at
        phases ``chunk (B, T)``: at each phase ``ceil((cache_tokens - C) / C)`` of the entries it keeps (they
        move C positions down) and the one this token adds, so the half is ready when the chunk completes."""
        c, slots = self.model.config, self.state
        kept = c.cache_tokens - c.chunk_size
        per_phase = -(-kept // c.chunk_size)
        older = (chunk[..., None] * per_phase + torch.arange(per_phase, device=chunk.device)).clamp_max(kept - 1)
        window = torch.cat((older.flatten(1), kept + chunk), dim=1)  # positions in the next window
        ring = self._ring(rows, c.chunk_size + window)
        passes, cache = slots.buffers(rows)
        last = passes[-1]
        cos, sin = rope_angles(window, c.rotary_dim, c.rope_base)
        at = (1 - slots.live[rows])[:, None] * c.cache_tokens + window
        batch = torch.arange(len(ring), device=ring.device)[:, None]
        for into, source in zip(last.layers, cache.layers):
            k, v = source.k[batch, :, ring].transpose(1, 2), source.v[batch, :, ring].transpose(1, 2)
            into.write(at, *rotate_prefix((k, v), cos, sin))
        slots.next_valid[rows].scatter_(1, window, cache.key_valid.gather(1, ring))

    def _advance(self, done: Tensor, rows: slice) -> None:
        """Rows where ``done (B,)`` (of ``rows``; their chunk is complete) start the next chunk: pass k's buffer
        takes pass k + 1's window and chunk, the last pass switches to its prepared cache half (the ring moves C
        on), and the chunk slots empty. Computed for every row, kept where ``done``."""
        c, slots = self.model.config, self.state
        passes, ring = slots.buffers(rows)
        row, kv_row = done[:, None], done[:, None, None, None]
        for into, source in zip(passes, passes[1:]):
            contents, valid = self._contents(source, rows, last=source is passes[-1])
            window = torch.arange(valid.shape[1], device=done.device)  # pass k's window: pass k + 1's slots
            for layer, (k, v) in zip(into.layers, contents):
                layer.write(window, torch.where(kv_row, k, layer.k[:, :, : len(window)]),
                            torch.where(kv_row, v, layer.v[:, :, : len(window)]))
            into.mark(_all(into), torch.where(row, _then_empty(valid, c.chunk_size), into.key_valid))
        last, next_valid = passes[-1], slots.next_valid[rows]
        halves = next_valid.new_zeros(len(done), 0)
        if ring is not None:
            head, live = slots.head[rows], slots.live[rows]
            empty = torch.zeros_like(next_valid)
            halves = torch.cat((torch.where(live.bool()[:, None], next_valid, empty),
                                torch.where(live.bool()[:, None], empty, next_valid)), 1)
            slots.head = over_rows(torch.where(done, (head + c.chunk_size) % ring.max_len, head), slots.head)
            slots.live = over_rows(torch.where(done, 1 - live, live), slots.live)
            next_valid.masked_fill_(row, False)
        last.mark(_all(last), torch.where(row, _then_empty(halves, c.chunk_size), last.key_valid))
        slots.phase[rows].masked_fill_(done, 0)

    def _contents(self, cache: DecoderCache, rows: slice, *, last: bool) -> tuple[list[tuple[Tensor, Tensor]], Tensor]:
        """A pass buffer's keys/values per layer and validity, window then chunk (of the ``last`` pass's two
        cache halves, each row's live one)."""
        ct = self.model.config.cache_tokens
        if not last or not ct:
            return [(layer.k, layer.v) for layer in cache.layers], cache.key_valid
        live = self.state.live[rows].bool()

        def pick(x: Tensor) -> Tensor:  # (B, H, 2 ct + C, D)
            return torch.cat((torch.where(live[:, None, None, None], x[:, :, ct : 2 * ct], x[:, :, :ct]), x[:, :, 2 * ct :]), 2)

        valid = cache.key_valid
        live_valid = torch.cat((torch.where(live[:, None], valid[:, ct : 2 * ct], valid[:, :ct]), valid[:, 2 * ct :]), 1)
        return [(pick(layer.k), pick(layer.v)) for layer in cache.layers], live_valid

    def _load(self, rows: slice, state: StaircaseState) -> None:
        """Start ``rows`` at the stream state ``state`` (its last complete chunk; batch row i for the i-th of
        ``rows``): each pass's window for the next chunk, found by running the state's flush steps (the
        cache and the older chunks of pass k are those of the state after k of them), at the window's last
        slots, and the cache the last pass reads. Empties the chunks being written."""
        m, slots = self.model, self.state
        c, current = m.config, state
        passes, ring = slots.buffers(rows)
        for k, view in enumerate(passes):
            last = current  # after the loop: the state the last pass reads (its window is its cache)
            older, older_valid, following = [], current.cache_valid[:, :0], current
            if current.chunks:
                empty = torch.zeros(older_valid.shape[0], 0, c.d_model, dtype=m.embed.weight.dtype, device=older_valid.device)
                following, _, layer_states = m.traced_step(current, empty, older_valid)
                older = m.window_keys(layer_states)
                older_valid = torch.cat(current.valid, dim=1)
            valid = torch.cat((current.cache_valid, older_valid), dim=1)
            window = torch.arange(self._window(k) - valid.shape[1], self._window(k), device=valid.device)
            cos, sin = rope_angles(window, c.rotary_dim, c.rope_base)
            view.reset()
            view.mark(window, valid)
            for layer, kv in enumerate(view.layers):
                parts = [*current.cache[layer : layer + 1], *older[layer : layer + 1]]
                if parts and window.numel():
                    kv.write(window, *rotate_prefix((torch.cat([p[0] for p in parts], 2), torch.cat([p[1] for p in parts], 2)), cos, sin))
            current = following
        if ring is not None:
            ring.reset()
            window = torch.arange(c.cache_tokens - last.cache_valid.shape[1], c.cache_tokens, device=last.cache_valid.device)
            ring.mark(window, last.cache_valid)
            for layer, (k, v) in zip(ring.layers, last.cache):
                layer.write(window, k, v)
        slots.head[rows] = slots.live[rows] = slots.phase[rows] = 0
        slots.next_valid[rows] = False


def _all(cache: DecoderCache) -> Tensor:
    return torch.arange(cache.max_len, device=cache.key_valid.device)


def _then_empty(valid: Tensor, n: int) -> Tensor:
    """``valid (B, W)`` followed by ``n`` empty slots."""
    return torch.cat((valid, valid.new_zeros(valid.shape[0], n)), dim=1)
