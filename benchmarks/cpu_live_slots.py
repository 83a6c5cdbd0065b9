"""Eager CPU decode over the slots the rows hold against the whole cache (issue 12, item 1 on CPU).

An engine built for the model's context (what ``blockloop serve`` does) gives every slot ``context_length``
cache entries. An eager CPU step's mask covers only the slots up to the furthest query's
(:func:`blockloop.nn.masks.visible_slots`) and attention reads only those keys; the baseline, in the same run,
is the previous behaviour, every step attending over the whole cache (``visible`` returning ``max_len``).

With ``--kv-tokens N`` the engine keeps its keys in a paged pool of ``N`` tokens, as ``blockloop serve
--kv-tokens N`` does, read on CPU by gathering each row's logical view out of the pool every layer; the same
comparison is then between gathering the slots up to the furthest query's and gathering every slot (the
behaviour before 2026-11-29, ``visible_slots`` patched in the paged caches only: the mask is narrow both ways).

SmolLM2-135M, ``--prompt-len``-token prompts, ``--gen-len`` greedy tokens, ``--slots`` requests at once,
alternating run by run after one warm-up each; the generated tokens must be the same both ways.

    .venv/bin/python benchmarks/cpu_live_slots.py --threads 1 --record
    .venv/bin/python benchmarks/cpu_live_slots.py --threads 1 --kv-tokens 2048 --record

Writes ``cpu_live_slots.json`` (``cpu_live_slots_paged.json`` with ``--kv-tokens``) to runs/bench/ (``--out-dir DIR`` elsewhere, ``--record`` into benchmarks/results/).
"""

from __future__ import annotations

import contextlib
import json
import time
from unittest import mock

import torch

from blockloop.bench.records import (
    add_output_arguments,
    environment,
    environment_line,
    output_dir,
    run_script,
)
from blockloop.cli import Parser
from blockloop.cli.common import add_threads, positive_int, positive_ints, set_threads
from blockloop.convert.smollm2 import import_smollm2
from blockloop.data.pretrained import SMOLLM2_GGUF
from blockloop.nn import paged_cache
from blockloop.nn.kv_cache import DecoderCache
from blockloop.serve.engine import Engine
from blockloop.serve.requests import SamplingParams
from blockloop.serve.runners import Paging, runner_for


def decode(model: torch.nn.Module, prompts: list[list[int]], gen_len: int, max_len: int, paging: Paging | None
           ) -> tuple[float, list[list[int]]]:
    """Seconds for an engine of ``len(prompts)`` slots of ``max_len`` entries to serve the prompts, and the tokens."""
    engine = Engine(runner_for(model, paging=paging), len(prompts), max_len=max_len)
    requests = [engine.submit(p, gen_len, sampling=SamplingParams(temperature=0.0)) for p in prompts]
    start = time.perf_counter()
    engine.run()
    return time.perf_counter() - start, [r.output for r in requests]


def whole_cache(paging: Paging | None) -> contextlib.AbstractContextManager:
    """The baseline: every step attends over (static) or gathers (paged) every slot of its rows."""
    if paging is None:
        return mock.patch.object(DecoderCache, "visible", lambda self, query_slots: self.max_len)
    return mock.patch.object(paged_cache, "visible_slots", lambda slots, limit: limit)


def compare(model: torch.nn.Module, slots: int, prompt_len: int, gen_len: int, repeats: int, max_len: int,
            paging: Paging | None) -> dict[str, object]:
    generator = torch.Generator().manual_seed(slots)
    seconds: dict[str, list[float]] = {"live": [], "whole": []}
    for run in range(repeats + 1):
        prompts = torch.randint(0, model.config.vocab_size, (slots, prompt_len), generator=generator).tolist()
        live, ours = decode(model, prompts, gen_len, max_len, paging)
        with whole_cache(paging):
            whole, theirs = decode(model, prompts, gen_len, max_len, paging)
        if ours != theirs:
            raise SystemExit("live-slot and whole-cache decoding generated different tokens")
        if run:
            seconds["live"].append(live)
            seconds["whole"].append(whole)
    return {"slots": slots, "live_tok_s": slots * gen_len * repeats / sum(seconds["live"]),
            "whole_cache_tok_s": slots * gen_len * repeats / sum(seconds["whole"]),
            "speedup": sum(seconds["whole"]) / sum(seconds["live"]),
            "speedup_per_run": sorted(w / live for live, w in zip(seconds["live"], seconds["whole"]))}


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=positive_ints, default="1,4", help="comma-separated numbers of requests served at once")
    parser.add_argument("--prompt-len", type=positive_int, default=64)
    parser.add_argument("--gen-len", type=positive_int, default=32)
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per side (after one warm-up)")
    parser.add_argument("--kv-tokens", type=positive_int, default=None,
                        help="keep the keys in a paged pool of this many tokens (as serve --kv-tokens) and compare "
                             "gathering the live slots with gathering every slot")
    add_threads(parser)
    add_output_arguments(parser)
    args = parser.parse_args()
    set_threads(args.threads)
    out = output_dir(args)
    model = import_smollm2()
    max_len = model.config.context_length
    paging = Paging(args.kv_tokens) if args.kv_tokens else None
    cache = f"a paged pool of {args.kv_tokens} tokens" if paging else "a static cache"
    rows = []
    for slots in args.slots:
        row = compare(model, slots, args.prompt_len, args.gen_len, args.repeats, max_len, paging)
        rows.append(row)
        print(f"{slots} slot(s) of {max_len} entries in {cache}: live slots {row['live_tok_s']:.1f} tok/s, whole "
              f"cache {row['whole_cache_tok_s']:.1f} tok/s, {row['speedup']:.2f}x", flush=True)
    result = {"model": SMOLLM2_GGUF, "max_len": max_len, "kv_tokens": args.kv_tokens, "prompt_len": args.prompt_len,
              "gen_len": args.gen_len, "repeats": args.repeats, "rows": rows, **environment("cpu")}
    name = "cpu_live_slots_paged.json" if paging else "cpu_live_slots.json"
    (out / name).write_text(json.dumps(result, indent=2) + "\n")
    print(environment_line(result))


if __name__ == "__main__":
    run_script(main)
