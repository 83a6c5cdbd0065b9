"""Eager CPU decode over the slots the rows hold against the whole static cache (issue 12, item 1 on CPU).

An engine built for the model's context (what ``blockloop serve`` does without ``--kv-tokens``) gives every
slot ``context_length`` cache entries. An eager CPU step's mask now covers only the slots up to the furthest
query's (:meth:`blockloop.nn.kv_cache.DecoderCache.visible`) and attention reads only those keys; the baseline,
in the same run, is the previous behaviour, every step attending over the whole cache (``visible`` returning
``max_len``). SmolLM2-135M, ``--prompt-len``-token prompts, ``--gen-len`` greedy tokens, ``--slots`` requests
at once, alternating run by run after one warm-up each; the generated tokens must be the same both ways.

    .venv/bin/python benchmarks/cpu_live_slots.py --threads 1 --record

Writes ``cpu_live_slots.json`` to runs/bench/ (``--out-dir DIR`` elsewhere, ``--record`` into benchmarks/results/).
"""

from __future__ import annotations

import argparse
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
from blockloop.cli.common import add_threads, positive_int, positive_ints, set_threads
from blockloop.convert.smollm2 import import_smollm2
from blockloop.data.pretrained import SMOLLM2_GGUF
from blockloop.nn.kv_cache import DecoderCache
from blockloop.serve.engine import Engine
from blockloop.serve.requests import SamplingParams


def decode(model: torch.nn.Module, prompts: list[list[int]], gen_len: int, max_len: int) -> tuple[float, list[list[int]]]:
    """Seconds for an engine of ``len(prompts)`` slots of ``max_len`` entries to serve the prompts, and the tokens."""
    engine = Engine(model, len(prompts), max_len=max_len)
    requests = [engine.submit(p, gen_len, sampling=SamplingParams(temperature=0.0)) for p in prompts]
    start = time.perf_counter()
    engine.run()
    return time.perf_counter() - start, [r.output for r in requests]


def compare(model: torch.nn.Module, slots: int, prompt_len: int, gen_len: int, repeats: int, max_len: int) -> dict[str, object]:
    generator = torch.Generator().manual_seed(slots)
    seconds: dict[str, list[float]] = {"live": [], "whole": []}
    for run in range(repeats + 1):
        prompts = torch.randint(0, model.config.vocab_size, (slots, prompt_len), generator=generator).tolist()
        live, ours = decode(model, prompts, gen_len, max_len)
        with mock.patch.object(DecoderCache, "visible", lambda self, query_slots: self.max_len):
            whole, theirs = decode(model, prompts, gen_len, max_len)
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=positive_ints, default="1,4", help="comma-separated numbers of requests served at once")
    parser.add_argument("--prompt-len", type=positive_int, default=64)
    parser.add_argument("--gen-len", type=positive_int, default=32)
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per side (after one warm-up)")
    add_threads(parser)
    add_output_arguments(parser)
    args = parser.parse_args()
    set_threads(args.threads)
    out = output_dir(args)
    model = import_smollm2()
    max_len = model.config.context_length
    rows = []
    for slots in args.slots:
        row = compare(model, slots, args.prompt_len, args.gen_len, args.repeats, max_len)
        rows.append(row)
        print(f"{slots} slot(s) of {max_len} entries: live slots {row['live_tok_s']:.1f} tok/s, whole cache "
              f"{row['whole_cache_tok_s']:.1f} tok/s, {row['speedup']:.2f}x", flush=True)
    result = {"model": SMOLLM2_GGUF, "max_len": max_len, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
              "repeats": args.repeats, "rows": rows, **environment("cpu")}
    (out / "cpu_live_slots.json").write_text(json.dumps(result, indent=2) + "\n")
    print(environment_line(result))


if __name__ == "__main__":
    run_script(main)
