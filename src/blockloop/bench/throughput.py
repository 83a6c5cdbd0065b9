"""The Block Transformer paper's throughput protocol (section 3.2 / appendix E) on the serving engine.

A batch of ``B`` random-token prompts of ``prompt_len`` tokens, each continued by exactly ``gen_len``
tokens (no EOS), after warm-up runs; every timed run reuses the same engine slots. Reported: generated
tokens per second, time to first token and time per output token (of the whole batch, mean over the timed
runs), peak memory per sample (CUDA) and static cache bytes per sample, and the fraction of the
memory-bandwidth roofline.
TTFT is timed as the same batch asking for one token (all prompts prefilled, first tokens sampled; a
Block Transformer's window is one block, so its TTFT also holds ``L_B - 1`` token-decoder steps);
TPOT = (run time - TTFT) / (gen_len - 1).
Prefill-heavy is 2048 / 128 and decode-heavy 128 / 2048 in the paper; on CPU shrink them with flags.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any

import torch
from torch import Tensor, nn

from blockloop.bench.roofline import bytes_per_step
from blockloop.bench.timing import timed
from blockloop.choices import KEY_BUCKETS
from blockloop.device import ran_out_of_memory
from blockloop.errors import BlockloopError, check_context
from blockloop.nn.linear import packed_linears
from blockloop.serve.engine import Engine
from blockloop.serve.requests import SamplingParams
from blockloop.serve.runners import Paging, runner_for

SCENARIOS = {"prefill-heavy": (2048, 128), "decode-heavy": (128, 2048)}


def scenario_lengths(scenario: str, models: list[nn.Module], *, prompt_len: int | None = None,
                     gen_len: int | None = None) -> tuple[int, int]:
    """The paper's (prompt, generated) lengths of ``scenario`` in place of those not given, the longer of those
    shortened to fit every model (both, in proportion, where that alone cannot fit); given lengths are kept as they
    are (:func:`check_lengths` refuses them if they cannot fit).

    Both of the paper's scenarios add up to 2176 tokens, one block of 128 past the 2048-token context of its
    own models; the engine keeps every token of a request in its cache, so the long part gives way.
    """
    paper_prompt, paper_gen = SCENARIOS[scenario]
    prompt, gen = prompt_len or paper_prompt, gen_len or paper_gen
    multiple = max(runner_for(model).prompt_multiple for model in models)
    room = min(model.config.context_length for model in models)
    over = -(-prompt // multiple) * multiple + gen - room
    if over > 0 and prompt_len is None and (gen_len is not None or prompt >= gen):
        prompt = (prompt - over) // multiple * multiple
    elif over > 0 and gen_len is None:
        gen -= over
    if (prompt < 1 or gen < 1) and prompt_len is None and gen_len is None:
        # a context hardly longer than the short part (a tiny model's): both give way, in the scenario's proportion
        prompt = max(multiple, room * paper_prompt // (paper_prompt + paper_gen) // multiple * multiple)
        gen = room - prompt
    if prompt < 1 or gen < 1:
        given = "".join(f" with {flag} {value}" for flag, value in (("--prompt-len", prompt_len), ("--gen-len", gen_len))
                        if value is not None)
        raise BlockloopError(f"the {scenario} scenario does not fit a model context of {room} tokens{given}; "
                             "give --prompt-len and --gen-len that add up to at most the context")
    return prompt, gen


@dataclass
class ThroughputResult:
    name: str
    batch: int
    prompt_len: int
    gen_len: int
    tok_s: float
    ttft_s: float
    tpot_s: float
    peak_mem_per_sample: int | None
    cache_bytes_per_sample: int | None
    roofline_tok_s: float | None
    roofline_fraction: float | None
    compile_s: float | None = None  # compiling (and capturing) every graph of the runs, before them: not in tok/s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def state_tensors(obj: object) -> list[Tensor]:
    """Every tensor a decode state holds (caches, cross K/V, buffers), one per storage: a view of a cache (a
    prefix of its rows) is the cache. Meta tensors (a state sized without memory) have no storage to share."""
    seen: dict[int, Tensor] = {}

    def visit(x: object) -> None:
        if isinstance(x, Tensor):
            seen.setdefault(id(x) if x.is_meta else x.untyped_storage().data_ptr(), x)
        elif isinstance(x, nn.Module):
            for b in x.buffers():
                visit(b)
        elif isinstance(x, (list, tuple)):
            for item in x:
                visit(item)
        elif is_dataclass(x):
            for value in vars(x).values():
                visit(value)

    visit(obj)
    return list(seen.values())


def state_bytes(obj: object) -> int:
    """Bytes of a decode state's tensors (:func:`state_tensors`)."""
    return sum(t.untyped_storage().nbytes() for t in state_tensors(obj))


def check_lengths(model: nn.Module, prompt_len: int, gen_len: int) -> int:
    """The engine slot length for this protocol; a clear error when it exceeds the model context."""
    if prompt_len < 1 or gen_len < 1:
        raise BlockloopError(f"prompt and generation lengths must be >= 1, got {prompt_len} and {gen_len}")
    need = runner_for(model).padded(prompt_len) + gen_len
    check_context(need, model.config.context_length, f"prompt {prompt_len} + generation {gen_len}, a slot",
                  "lower --prompt-len/--gen-len or pick a preset with a longer context")
    return need


def check_repeats(repeats: int) -> None:
    """Refuse a timing with no timed run (its mean would divide by zero after all the warm-up work)."""
    if repeats < 1:
        raise BlockloopError(f"repeats must be >= 1 timed runs, got {repeats}")


def full_batch_paging(model: nn.Module, batch: int, max_len: int, read: str | None = None) -> Paging:
    """The smallest paged pool in which every row of ``batch`` holds ``max_len`` tokens at once: each row takes
    whole pages, of up to 128 cache entries (FlexAttention's block; a Block Transformer's entry is a block);
    ``read``: how decode reads it (:class:`~blockloop.serve.runners.paging.Paging`)."""
    per_entry = getattr(runner_for(model), "tokens_per_entry", 1)
    entries = -(-max_len // per_entry)
    page = min(128, -(-entries // 16) * 16)
    return Paging(batch * -(-entries // page) * page * per_entry, page_size=page, read=read)


def run_tokens(run: int, warmup: int, gen_len: int, warmup_tokens: int | None) -> int:
    """What run ``run`` of a timing generates: ``gen_len`` when it is timed, at most ``warmup_tokens`` when it is
    one of the ``warmup`` runs before (all ``gen_len`` without ``warmup_tokens``)."""
    return gen_len if run >= warmup or warmup_tokens is None else min(gen_len, warmup_tokens)


def engine_throughput(
    model: nn.Module, name: str, batch: int, prompt_len: int, gen_len: int, *,
    repeats: int = 3, warmup: int = 1, sync_every: int = 16, compile: bool = False, bandwidth: float | None = None,
    seed: int = 0, paged: bool = False, paged_read: str | None = None, warmup_tokens: int | None = None,
    key_buckets: int = KEY_BUCKETS,
) -> ThroughputResult:
    """Time ``repeats`` runs of the protocol on one engine (after ``warmup`` untimed ones); ``paged``: over a
    paged KV cache holding the whole batch at full length (:func:`full_batch_paging`), so nothing is preempted,
    read as ``paged_read`` says (default: the device's);
    ``key_buckets``: the engine's (0: each step reads every slot of a static cache).
    ``warmup_tokens``: what a warm-up run generates (default all ``gen_len``); a compiled engine compiles all its
    steps before it (:meth:`Engine.compile_steps`), so a short one suffices, while on a GPU a full-length warm-up of
    the decode-heavy scenario costs as much as the timed run."""
    if batch < 1:
        raise BlockloopError(f"batch sizes must be >= 1, got {batch}")
    check_repeats(repeats)
    max_len = check_lengths(model, prompt_len, gen_len)
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    paging = full_batch_paging(model, batch, max_len, paged_read) if paged else None
    if compile:
        fresh_compile_caches()
    engine = Engine(runner_for(model, paging=paging), batch, max_len=max_len, sync_every=sync_every, compile=compile,
                    key_buckets=key_buckets)
    compile_s = None
    greedy = SamplingParams(temperature=0.0)
    if compile:  # every graph the runs take, now: a short warm-up leaves none to compile inside a timed run
        with timed(device) as compiling:
            engine.compile_steps(rows=[batch], shortest=prompt_len, sampling=greedy, progress=True)
        compile_s = compiling.seconds
    generator = torch.Generator().manual_seed(seed)
    seconds, ttft = [], []
    with packed_linears(model):  # CPU only: the engine's weights in oneDNN's layout, as generate and serve use them
        for run in range(warmup + repeats):
            prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=generator).tolist()
            n_tokens = run_tokens(run, warmup, gen_len, warmup_tokens)
            with timed(device) as timer:
                for p in prompts:
                    engine.submit(p, n_tokens, sampling=greedy)
                engine.run()
            # Time to first token on its own: the same batch asking for one token (prefill + first sample),
            # since within a full run tokens only reach the host once per sync window.
            with timed(device) as first:
                for p in prompts:
                    engine.submit(p, 1, sampling=greedy)
                while not engine.idle:  # a prompt longer than the engine's prefill chunk takes a window per chunk
                    engine.step(max_steps=1)
            if run >= warmup:
                seconds.append(timer.seconds)
                ttft.append(first.seconds)
    mean = sum(seconds) / len(seconds)
    mean_ttft = sum(ttft) / len(ttft)
    tok_s = batch * gen_len / mean
    step_bytes = bytes_per_step(model, batch, prompt_len, gen_len)
    roofline = batch * bandwidth / step_bytes if bandwidth and step_bytes else None
    peak = torch.cuda.max_memory_allocated(device) // batch if device.type == "cuda" else None
    # No token comes after the first of a one-token answer: its TPOT is no number (recorded as null).
    tpot = max(mean - mean_ttft, 0.0) / (gen_len - 1) if gen_len > 1 else float("nan")
    return ThroughputResult(
        name, batch, prompt_len, gen_len, tok_s, mean_ttft, tpot, peak,
        state_bytes(engine.runner.state) // batch, roofline, tok_s / roofline if roofline else None, compile_s,
    )


def fresh_compile_caches() -> None:
    """Forget the compiled steps of the engines timed before: every decode step is one code object to dynamo (the
    runners' ``torch.no_grad`` steps even share one wrapper), and past its ``recompile_limit`` (8) graphs it runs the
    step eagerly, silently, so a benchmark that builds an engine per model, batch size and cache would time the later
    ones uncompiled (no CUDA graphs). Each engine compiles one graph per row count (at most 8, :func:`row_buckets`) and
    one per key length past the first (``--key-buckets``), for which the engine raises the limit
    (:func:`~blockloop.serve.engine.within_recompile_limit`)."""
    torch._dynamo.reset()


def search_batches(run: Any, batches: list[int], *, search: bool, max_batch: int,
                   on_stop: Callable[[str], None] | None = None) -> list[ThroughputResult]:
    """Run ``run(batch)`` for each batch size; with ``search``, keep doubling past the largest until the
    device runs out of memory or ``max_batch``. Out-of-memory ends the list (the largest that fits); ``on_stop``
    hears why a search ended, which the list alone does not say."""
    results = []
    sizes, largest = list(batches), max(batches)
    while sizes:
        batch = sizes.pop(0)
        try:
            results.append(run(batch))
        except (MemoryError, RuntimeError) as exc:  # the CPU allocator's failure is a plain RuntimeError
            if not ran_out_of_memory(exc):
                raise
            torch.cuda.empty_cache()
            how = type(exc).__name__ if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) else "the CPU allocator"
            _stopped(on_stop, f"out of memory at batch {batch} ({how}); the batches before it are measured")
            return results
        if search and not sizes:
            if largest * 2 > max_batch:
                _stopped(on_stop, f"the search stopped at batch {largest}: the next, {largest * 2}, would pass --max-batch "
                                  f"{max_batch}")
                return results
            largest *= 2
            sizes.append(largest)
    return results


def _stopped(on_stop: Callable[[str], None] | None, why: str) -> None:
    if on_stop is not None:
        on_stop(why)
