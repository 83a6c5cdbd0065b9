"""Log-likelihoods of continuations given contexts, computed the way each family defines them, in batches.

A multiple-choice question is a group of requests (one per choice) that share a prefix. The family's spec
(``FamilySpec.scoring``) says how a continuation is scored exactly:

* ``cached``: the shared prefix of a question (the context, up to the last token before anything differs)
  is run once into the model's static KV cache (:class:`~blockloop.nn.kv_cache.DecoderCache`, left-padded
  rows of a batch of questions); its keys/values are written (``DecoderCache.take``, through ``KVCache.write``)
  into one row per choice of a second cache, and every choice continues from there in one batched forward. Equal to
  scoring each choice from scratch (tested in float64).
* ``causal``: one causal forward over context + continuation, rows right-padded (padding comes after
  every scored token, so it changes nothing).
* ``blocks``: the context left-padded with ``pad_id`` to whole blocks, so the continuation starts at a block
  boundary, as generation lays a prompt out; a model's logit at position t predicts token t itself. (The
  Block Transformer paper's footnote to Table 2 pads the first block with L_B - 1 tokens instead, wherever the
  continuation then starts; blockloop scores as it generates, which random-length padding trains for.)
* ``partition``: the context (but its last token) is the context block of a two-block partition, the
  generation block starts at its last token (the PrefixLM layout generation uses).
* ``encoder``: the same split with the context block as the encoder input.

Windows follow lm-eval: context + continuation keep their last ``context_length + 1`` tokens, the input is
all but the last of them; ``exits`` (loop numbers, recursive models) score the static exit after each loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from blockloop.data.partitions import prefix_partition
from blockloop.data.tokenizers import Tokenizer
from blockloop.errors import BlockloopError
from blockloop.families import spec_of
from blockloop.nn.kv_cache import StepContext
from blockloop.nn.linear import packed_linears
from blockloop.nn.loss import IGNORE_INDEX
from blockloop.nn.precision import at_least_fp32


@dataclass(frozen=True)
class Request:
    """Token ids of one context and the continuation to score after it."""

    context: tuple[int, ...]
    continuation: tuple[int, ...]


def encode_request(tokenizer: Tokenizer, context: str, continuation: str) -> Request:
    """lm-eval's pair encoding: trailing spaces of the context move to the continuation, the pair is encoded
    whole and the context's ids split off (so the continuation's ids are those of the whole text); the
    context starts with the tokenizer's BOS where its model reads one (as lm-eval's ``add_bos_token``), and an
    empty context is that BOS, else the end-of-text token."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:
        first = tokenizer.eos_id if tokenizer.start_id is None else tokenizer.start_id
        return Request((first,), tuple(tokenizer.encode(continuation)))
    whole, ids = tokenizer.encode(context + continuation), tokenizer.encode(context)
    start = [] if tokenizer.start_id is None else [tokenizer.start_id]  # a BOS model reads its BOS first
    return Request(tuple(start + ids), tuple(whole[len(ids):]))


@dataclass
class Scores:
    """Per request (groups flattened in order) and per exit: summed log-likelihood and whether every
    continuation token is the argmax (lm-eval's ``is_greedy``)."""

    loglikelihood: Tensor  # (R, E) float64
    greedy: Tensor  # (R, E) bool


@torch.no_grad()
def score(
    model: nn.Module,
    groups: Sequence[Sequence[Request]],
    *,
    exits: Sequence[int] | None = None,
    batch_size: int = 8,
    progress: Callable[[int], None] | None = None,
) -> Scores:
    """Score every request; ``groups`` (a question's choices) share their prefix work, ``batch_size`` groups
    go through one forward (one request per forward for the ``partition`` and ``encoder`` layouts). ``progress(n)``
    is told each time ``n`` more groups are done."""
    check_requests(model, groups)
    if exits is not None and not hasattr(model, "loop_hiddens"):
        raise BlockloopError("--loops / --per-loop score a looped model's exits; this model has no loops")
    if batch_size < 1:
        raise BlockloopError(f"--batch-size must be at least 1, got {batch_size}")
    scorer = LAYOUTS[spec_of(model.config).scoring]
    n_exits = len(exits) if exits is not None else 1
    order = sorted(range(len(groups)), key=lambda g: -max(len(r.context) + len(r.continuation) for r in groups[g]))
    starts = [0]
    for g in groups:
        starts.append(starts[-1] + len(g))
    ll = torch.zeros(starts[-1], n_exits, dtype=torch.float64)
    greedy = torch.zeros(starts[-1], n_exits, dtype=torch.bool)
    was_training = model.training
    model.eval()  # no dropout
    try:
        with packed_linears(model):
            for i in range(0, len(order), batch_size):
                chosen = order[i : i + batch_size]
                out_ll, out_greedy = scorer(model, [list(groups[g]) for g in chosen], exits)
                rows = [r for g in chosen for r in range(starts[g], starts[g + 1])]
                ll[rows], greedy[rows] = out_ll.cpu(), out_greedy.cpu()
                if progress is not None:
                    progress(len(chosen))
    finally:
        model.train(was_training)
    return Scores(ll, greedy)


def check_requests(model: nn.Module, groups: Sequence[Sequence[Request]], what: str = "questions") -> None:
    """Refuse, before any forward, what :func:`score` cannot score exactly: a family without a scoring layout,
    an empty continuation, or one too long for the model context (a Block Transformer's also needs a whole
    block of context before it). ``what`` the groups are, in the message (lm-eval's are its requests)."""
    c = model.config
    layout = spec_of(c).scoring
    if layout is None:
        raise BlockloopError(f"the {c.family} family cannot score a continuation exactly "
                             "(its FamilySpec.scoring is None); evaluate another model")
    if any(len(r.continuation) == 0 for g in groups for r in g):
        raise BlockloopError("a continuation tokenized to nothing; nothing to score")
    def fits(n: int) -> bool:
        if layout == "blocks":  # whole blocks, after at least one block of context
            return -(-n // c.block_len) * c.block_len <= c.context_length - c.block_len
        return n <= c.context_length

    over = [g for g in groups if not all(fits(len(r.continuation)) for r in g)]
    if over:
        longest = max(len(r.continuation) for g in over for r in g)
        room = "leave a whole block of context in" if layout == "blocks" else "fit"
        raise BlockloopError(f"{len(over)} of its {len(groups)} {what} have an answer too long to {room} the model "
                             f"context of {c.context_length} tokens (the longest: {longest}); evaluate a model with a "
                             "longer context, or leave the task out")


def cut_questions(model: nn.Module, groups: Sequence[Sequence[Request]]) -> int:
    """How many questions lose tokens of their context to fit the model context: their windows keep the last
    tokens only, as lm-eval's do, so the start of a long question or of its few-shot examples goes unseen."""
    c = model.config

    def cut(r: Request) -> bool:
        if spec_of(c).scoring == "blocks":
            return len(r.context) > _block_room(c, len(r.continuation))
        return len(r.context) + len(r.continuation) > c.context_length + 1

    return sum(any(cut(r) for r in g) for g in groups)


def _window(request: Request, limit: int) -> tuple[list[int], list[int], int]:
    """(inputs, targets, scored): lm-eval's window of the last ``limit + 1`` tokens; the last ``scored``
    targets are the continuation (:func:`check_requests` saw that it fits)."""
    full = list(request.context + request.continuation)[-(limit + 1):]
    return full[:-1], full[1:], len(request.continuation)


def _logits(model: nn.Module, exits: Sequence[int] | None, idx: Tensor, **kwargs: object) -> list[Tensor]:
    """The model's logits, or each requested loop's exit logits."""
    if exits is None:
        return [model(idx, **kwargs)[0]]
    hiddens = model.loop_hiddens(idx, **kwargs)
    return [model.exit_logits(hiddens[k - 1]) for k in exits]


def _gather(logits: list[Tensor], targets: Tensor) -> tuple[Tensor, Tensor]:
    """Summed log-probabilities of ``targets (B, T)`` (``IGNORE_INDEX`` = not scored) and greedy flags, ``(B, E)``
    each."""
    scored = targets != IGNORE_INDEX
    safe = targets.clamp_min(0)
    ll, greedy = [], []
    for x in logits:
        logp = torch.log_softmax(at_least_fp32(x), dim=-1)
        ll.append((logp.gather(-1, safe[..., None])[..., 0].double() * scored).sum(1))
        greedy.append(((logp.argmax(-1) == safe) | ~scored).all(1))
    return torch.stack(ll, 1), torch.stack(greedy, 1)


def _padded(rows: list[list[int]], fill: int, device: torch.device, length: int | None = None) -> Tensor:
    length = max(map(len, rows)) if length is None else length
    return torch.tensor([r + [fill] * (length - len(r)) for r in rows], dtype=torch.long, device=device)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _cached(model: nn.Module, groups: list[list[Request]], exits: Sequence[int] | None) -> tuple[Tensor, Tensor]:
    device, limit = _device(model), model.config.context_length
    windows = [[_window(r, limit) for r in g] for g in groups]
    shared = []  # per question: tokens every choice's input starts with, ending before the first scored logit
    for g in windows:
        common = min(len(inputs) - n for inputs, _, n in g)
        first = g[0][0]
        for inputs, _, _ in g[1:]:
            common = next((j for j in range(common) if inputs[j] != first[j]), common)
        shared.append(common)
    P, M = max(shared), max(len(inputs) - s for s, g in zip(shared, windows) for inputs, _, _ in g)
    if P + M > limit and len(groups) > 1:  # left-padded prefixes + the longest rest overflow: one question at a time
        parts = [_cached(model, [g], exits) for g in groups]
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])
    owner = torch.tensor([q for q, g in enumerate(windows) for _ in g], device=device)
    if P:
        prefix = model.allocate_cache(len(groups), P)
        idx = _padded([[0] * (P - s) + g[0][0][:s] for s, g in zip(shared, windows)], 0, device)
        slots = torch.arange(P, device=device)
        pads = torch.tensor([P - s for s in shared], device=device)[:, None]
        model(idx, step=StepContext(prefix, slots, (slots - pads).clamp_min(0), slots >= pads), last_only=True)
    rest = [(inputs[s:], [IGNORE_INDEX] * (len(inputs) - s - n) + targets[-n:], s)
            for s, g in zip(shared, windows) for inputs, targets, n in g]
    cache = model.allocate_cache(len(rest), P + M)
    if P:
        cache.take(prefix, owner)
    steps = torch.arange(M, device=device)
    positions = torch.tensor([s for _, _, s in rest], device=device)[:, None] + steps
    valid = steps < torch.tensor([len(r[0]) for r in rest], device=device)[:, None]
    step = StepContext(cache, P + steps, positions, valid)
    logits = _logits(model, exits, _padded([r[0] for r in rest], 0, device, M), step=step)
    return _gather(logits, _padded([r[1] for r in rest], IGNORE_INDEX, device, M))


def _causal(model: nn.Module, groups: list[list[Request]], exits: Sequence[int] | None) -> tuple[Tensor, Tensor]:
    device, limit = _device(model), model.config.context_length
    windows = [_window(r, limit) for g in groups for r in g]
    idx = _padded([inputs for inputs, _, _ in windows], 0, device)
    targets = _padded([[IGNORE_INDEX] * (len(t) - n) + t[-n:] for _, t, n in windows], IGNORE_INDEX, device)
    return _gather(_logits(model, exits, idx), targets)


def _blocks(model: nn.Module, groups: list[list[Request]], exits: Sequence[int] | None) -> tuple[Tensor, Tensor]:
    c, device = model.config, _device(model)
    rows, targets = [], []
    for r in (r for g in groups for r in g):
        context = list(r.context[-_block_room(c, len(r.continuation)):])
        context = [c.pad_id] * (-len(context) % c.block_len) + context
        rows.append(context + list(r.continuation))
        targets.append([IGNORE_INDEX] * len(context) + list(r.continuation))
    length = -(-max(map(len, rows)) // c.block_len) * c.block_len
    idx = _padded(rows, c.pad_id, device, length)
    return _gather(_logits(model, exits, idx), _padded(targets, IGNORE_INDEX, device, length))


def _block_room(c: Any, continuation: int) -> int:
    """Tokens of context a Block Transformer keeps: the whole blocks beside the continuation's (at least one:
    :func:`check_requests`)."""
    return (c.context_length - -(-continuation // c.block_len) * c.block_len) // c.block_len * c.block_len


def _split(model: nn.Module, groups: list[list[Request]], exits: Sequence[int] | None) -> tuple[Tensor, Tensor]:
    """``partition`` and ``encoder``: one request per forward (the split point is per row)."""
    device, limit, encoder = _device(model), model.config.context_length, spec_of(model.config).scoring == "encoder"
    results = []
    for r in (r for g in groups for r in g):
        inputs, targets, n = _window(r, limit)
        b = len(inputs) - n
        idx, tgt = torch.tensor([inputs], device=device), torch.tensor([targets], device=device)
        if encoder:  # a one-token context leaves the encoder empty, as a one-token prompt does when generating
            logits = _logits(model, exits, idx[:, :b], decoder_idx=idx[:, b:])
        else:
            boundaries = prefix_partition(len(inputs), b).to(device) if b else None
            logits = [x[:, b:] for x in _logits(model, exits, idx, boundaries=boundaries)]
        results.append(_gather(logits, tgt[:, b:]))
    return torch.cat([x for x, _ in results]), torch.cat([y for _, y in results])


LAYOUTS = {"cached": _cached, "causal": _causal, "blocks": _blocks, "partition": _split, "encoder": _split}
