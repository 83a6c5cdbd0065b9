"""``blockloop bench``: the throughput protocol, the request stream, and the Pareto plot from recorded runs.

The benchmarks themselves are :mod:`blockloop.bench.suite`; this module reads the flags and prints tables.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from blockloop.choices import BENCH_DTYPES, KEY_BUCKETS
from blockloop.cli.common import (
    add_device,
    add_key_buckets,
    add_no_pack,
    add_no_progress,
    add_threads,
    int_range,
    nonempty,
    nonnegative_int,
    number,
    positive_int,
    positive_ints,
    refuse_flags,
    set_threads,
)
from blockloop.errors import BlockloopError

HELP = "benchmark inference: throughput protocol, request stream, Pareto plot"
DESCRIPTION = ("Time the serving engine with the Block Transformer paper's protocol (random prompts, no EOS, warm-up, "
               "repeated runs), or serve a stream of corpus prompts (--stream), or plot recorded runs (--plot).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("models (the first one is the baseline the ratios divide by)")
    m.add_argument("--presets",
                   help="comma-separated presets, randomly initialised (default without --checkpoint: pythia-85m,block-85m)")
    m.add_argument("--checkpoint", action="append", default=[], type=nonempty,
                   help="a trained run to bench, after the --presets (repeatable; its validation loss is recorded for --plot)")
    add_device(m, default=None)
    add_no_pack(m)
    add_no_progress(m)
    m.add_argument("--dtype", choices=BENCH_DTYPES,
                   help="weights/cache dtype (default: bfloat16 on CUDA, float32 on CPU)")
    m.add_argument("--compile", action="store_true", help="torch.compile the decode step (CUDA graphs on CUDA)")
    add_key_buckets(m, default=None)
    add_threads(m)
    t = p.add_argument_group("throughput protocol (Block Transformer section 3.2)")
    t.add_argument("--scenario", choices=["prefill-heavy", "decode-heavy"],
                   help="prompt/gen lengths 2048/128 or 128/2048 (default: decode-heavy)")
    t.add_argument("--prompt-len", type=positive_int,
                   help="the prompt length, kept as given (default: the scenario's; a length not given is shortened "
                        "to fit the model context; e.g. 32 on CPU)")
    t.add_argument("--gen-len", type=positive_int,
                   help="the generated tokens, kept as given (default: the scenario's, shortened like the prompt; "
                        "e.g. 64 on CPU)")
    t.add_argument("--batch-sizes", type=positive_ints, help="comma-separated batch sizes (default: 1,16,64)")
    t.add_argument("--search", action="store_true", help="keep doubling the batch past the list until out of memory")
    t.add_argument("--max-batch", type=positive_int, help="upper bound for --search (default: 4096)")
    t.add_argument("--repeats", type=positive_int, help="timed runs per batch size (default: 3)")
    t.add_argument("--warmup", type=nonnegative_int,
                   help="untimed runs first (default: 1; --stream: rounds of one short request per slot, per model; "
                        "--url: requests sent one at a time)")
    t.add_argument("--sync-every", type=positive_int,
                   help="decode steps between host syncs (default: 16 for the throughput protocol; --stream: the "
                        "engine's, as `serve` runs it: 1 on CPU, 8 on an accelerator)")
    t.add_argument("--hf", action="store_true", help="also time HF generate() on the first (vanilla) model")
    t.add_argument("--whole-keys", action="store_true",
                   help="also time each model with every step reading its whole static cache (--key-buckets 0): "
                        "the baseline of the key lengths")
    t.add_argument("--paged", action="store_true",
                   help="also time each model whose runner pages (vanilla, ladder, looped, block, double decoder, encoder-decoder) "
                        "over a paged KV cache")
    t.add_argument("--paged-kernel", action="store_true",
                   help="also time those models over the same paged cache read by blockloop's Triton kernel "
                        "(blockloop.nn.paged_decode) rather than FlexAttention; CUDA only")
    s = p.add_argument_group("request stream (continuous batching)")
    s.add_argument("--stream", action="store_true", help="run the request-stream benchmark instead")
    s.add_argument("--url", help="send the stream to a running `blockloop serve` at this address over HTTP instead "
                   "(e.g. http://127.0.0.1:8000; the server's model and slots are used; exit status 1 if any request failed or was turned away)")
    s.add_argument("--requests", type=positive_int, help="requests in the stream (default: 64)")
    s.add_argument("--rate", type=number(0, low_open=True, infinite=True), help="Poisson arrivals per second (default: inf, a fixed queue)")
    s.add_argument("--slots", type=positive_int, help="engine slots (concurrent requests, default: 16)")
    s.add_argument("--prompt-range", type=int_range, help="min,max prompt tokens cut from the corpus (default: 16,64)")
    s.add_argument("--tokens-range", type=int_range, help="min,max tokens each request asks for (default: 16,64)")
    s.add_argument("--corpus", help="built-in corpus the prompts come from (default: shakespeare)")
    s.add_argument("--exit", metavar="RULE[:THRESHOLD]", action="append", default=[],
                   help="also serve looped models depth-wise with this early-exit rule, e.g. max_prob:0.9, "
                   "entropy:2.0, none:0 or oracle (repeatable); reports mean loops per token, greedy agreement with "
                   "the sequence-wise (no-exit) run, and the simulated depth-wise speedup (RRT appendix N) of the "
                   "recorded exits; oracle runs every loop and exits at the first loop agreeing with the last")
    s.add_argument("--speculate", metavar="K", type=positive_int, action="append", default=[],
                   help="also serve looped models self-speculatively: draft K tokens with the first loops, verify with "
                   "all loops in one pass (repeatable); reports the share of drafts kept, tokens per verification pass, "
                   "tok/s against the same model without speculation, and greedy agreement with it (100%%: exact)")
    s.add_argument("--draft-loops", type=positive_int, help="loops that draft under --speculate (default: 1)")
    s.add_argument("--adaptive-k", action="store_true",
                   help="--speculate K is each request's most: lower it after rejections, raise it after full acceptance")
    o = p.add_argument_group("output")
    o.add_argument("--record", type=Path, help="append every result to this JSON-lines file")
    o.add_argument("--plot", type=Path, metavar="PNG",
                   help="draw throughput vs validation loss (Figure 2) from --record's runs and exit")
    o.add_argument("--seed", type=nonnegative_int, help="seed for prompts and arrivals (default: 0)")


def run(args: argparse.Namespace) -> int:
    import torch

    from blockloop.bench import records
    from blockloop.bench.suite import ThroughputSettings, bench_dtype, load_models
    from blockloop.device import resolve_device
    from blockloop.serve.engine import default_sync_every

    if args.record is not None and args.record.is_dir():
        raise BlockloopError(f"--record {args.record} is a directory; name a JSON-lines file")
    _settle_modes(args)
    if args.record is not None and args.plot is None:  # results that took minutes must not be lost to a bad path
        from blockloop.files import check_writable

        check_writable(args.record)
        if args.record.is_file() and args.record.stat().st_size:  # appended to: it must already be records
            from blockloop.bench.records import read_records

            read_records(args.record)
    if args.url is not None:
        return _http(args)
    device = resolve_device(args.device)
    if args.plot is not None:
        if args.record is None:
            raise BlockloopError("--plot reads recorded runs: give --record FILE.jsonl as well")
        n = records.plot_pareto(records.read_records(args.record), args.plot)
        print(f"wrote {args.plot} ({n} runs)")
        return 0
    set_threads(args.threads)
    dtype = bench_dtype(args.dtype, device)
    meta = records.environment(device, dtype)
    # the mode's settings, flag by flag: a record says how it was measured without its command line being parsed
    flags = {**({**STREAM, **ENGINE_STREAM} if args.stream else THROUGHPUT), **LOCAL, **WARMUP, "seed": 0}
    meta["settings"] = {name: getattr(args, name) for name in flags}
    # what a flag left to its default ran with: "auto" and None say nothing a later reader can compare
    window = args.sync_every or (default_sync_every(torch.device(device)) if args.stream else
                                 ThroughputSettings.sync_every)
    meta["settings"].update(device=device, dtype=meta["dtype"], sync_every=window)
    models = load_models(args.presets, args.checkpoint, device, dtype, args.seed)
    measured: list[dict[str, Any]] = []  # every row as it is measured, so that Ctrl-C keeps them
    try:
        if args.stream:
            _stream(args, models, measured)
        else:
            _throughput(args, models, torch.device(device), measured, window)
    except KeyboardInterrupt:
        if measured and args.record is not None:
            if not args.stream:
                from blockloop.bench.suite import add_ratios

                add_ratios(measured, models[0].name)
            records.append_records(args.record, [{**r, **meta} for r in measured])
            print(f"the rows measured before the interrupt ({len(measured)}) are recorded in {args.record}",
                  file=sys.stderr)
        raise
    for r in measured:
        r.update(meta)
    print(f"device: {meta['device']}, {meta['threads']} threads  torch {meta['torch']}  {meta['dtype']}  {meta['date']}")
    if args.record is not None:
        records.append_records(args.record, measured)
    return 0


# The flags of one mode, and their defaults (None in the parser, so that a flag given to a mode that ignores it
# is told apart from one left alone). ENGINE_STREAM are stream flags that --url leaves to the server.
THROUGHPUT = {"scenario": "decode-heavy", "batch_sizes": [1, 16, 64], "max_batch": 4096, "repeats": 3,
              "prompt_len": None, "gen_len": None, "search": False, "hf": False, "paged": False, "paged_kernel": False,
              "whole_keys": False}
STREAM = {"requests": 64, "rate": math.inf, "prompt_range": (16, 64), "tokens_range": (16, 64), "corpus": "shakespeare"}
ENGINE_STREAM = {"slots": 16, "draft_loops": 1, "exit": [], "speculate": [], "adaptive_k": False}
# The flags of the engine blockloop runs here (not --url's server), and their defaults.
LOCAL = {"presets": None, "checkpoint": [], "device": "auto", "dtype": "auto", "compile": False, "threads": None,
         "no_pack": False, "sync_every": None, "key_buckets": KEY_BUCKETS}
# Untimed work before the clock, in every mode that times.
WARMUP = {"warmup": 1}


def _settle_modes(args: argparse.Namespace) -> None:
    """Refuse a flag the chosen mode would ignore, then fill in the defaults of the flags left alone."""
    if args.plot is not None:  # it draws recorded runs and runs nothing
        mode, ignored = "--plot", {**THROUGHPUT, **STREAM, **ENGINE_STREAM, **LOCAL, **WARMUP, "stream": False, "url": None,
                                   "seed": None, "no_progress": False}
    else:
        mode = "--url" if args.url is not None else "--stream" if args.stream else "the throughput protocol"
        ignored = {**STREAM, **ENGINE_STREAM} if mode == "the throughput protocol" else {**THROUGHPUT}
        if mode == "--url":  # the server's model and engine serve the stream
            ignored.update({**ENGINE_STREAM, **LOCAL})
    given = [name for name in ignored if _given(getattr(args, name))]
    if given:
        refuse_flags(given, mode, or_else=" or add --stream" if mode == "the throughput protocol" else "")
    # Flags that only shape another flag of the same mode.
    if mode == "--stream" and not args.speculate:
        shaping = [name for name in ("draft_loops", "adaptive_k") if _given(getattr(args, name))]
        if shaping:
            refuse_flags(shaping, "a stream without --speculate", fix="add --speculate K or leave them out")
    if mode == "the throughput protocol" and args.max_batch is not None and not args.search:
        refuse_flags(["max_batch"], "a run without --search (it bounds the search)", fix="add --search or leave it out")
    for name, default in {**THROUGHPUT, **STREAM, **ENGINE_STREAM, **LOCAL, **WARMUP, "seed": 0}.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def _given(value: Any) -> bool:
    """Whether a flag was given: every default is None, False or []. By identity, since ``0 in (None, False)`` is
    true in Python and ``--key-buckets 0`` is given all the same."""
    return not (value is None or value is False or (isinstance(value, list) and not value))


def _throughput(args: argparse.Namespace, models: list, device: Any, rows: list[dict[str, Any]], sync_every: int
                ) -> None:
    """The throughput protocol's rows, into ``rows`` as each is measured (a line on stderr says so), then its table;
    ``sync_every`` is the window ``--sync-every`` resolved to."""
    from blockloop.bench.hf_baseline import hf_available
    from blockloop.bench.suite import ThroughputSettings, measure_bandwidth, pages_kv, throughput_rows
    from blockloop.bench.throughput import SCENARIOS, check_lengths, scenario_lengths

    prompt_len, gen_len = scenario_lengths(args.scenario, [m.model for m in models], prompt_len=args.prompt_len,
                                           gen_len=args.gen_len)
    for flag, given, used, paper in zip(("--prompt-len", "--gen-len"), (args.prompt_len, args.gen_len),
                                        (prompt_len, gen_len), SCENARIOS[args.scenario]):
        if given is None and used != paper:
            print(f"{args.scenario}: the paper's {paper} tokens ({flag}) shortened to {used} to fit the model context")
    for m in models:  # every model before any is timed: a later one that cannot fit would waste the earlier runs
        try:
            check_lengths(m.model, prompt_len, gen_len)
        except BlockloopError as exc:
            raise BlockloopError(f"{m.name}: {exc}") from None
    if args.search and max(args.batch_sizes) > args.max_batch:
        raise BlockloopError(f"--batch-sizes lists {max(args.batch_sizes)}, past --max-batch {args.max_batch}, which "
                             "bounds the search; raise --max-batch or list smaller sizes")
    paged_flag = "--paged" if args.paged else "--paged-kernel"
    if args.paged_kernel and device.type != "cuda":
        raise BlockloopError(f"--paged-kernel times a Triton kernel, which runs on CUDA, not on {device.type}; "
                             "leave it out (--paged times the paged cache here)")
    unpaged = [m.name for m in models if not pages_kv(m.model)] if args.paged or args.paged_kernel else []
    if unpaged and len(unpaged) == len(models):
        raise BlockloopError(f"{paged_flag} times a paged KV cache, and no model here has one ({', '.join(unpaged)}: a "
                             f"fixed-size state); leave {paged_flag} out")
    if unpaged:
        print(f"{paged_flag}: no paged rows for {', '.join(unpaged)} (a fixed-size state)")
    hf_missing = hf_available() if args.hf else None  # why the HF baseline cannot run, if asked for
    if hf_missing is not None:  # refused before the timing, not skipped after it
        raise BlockloopError(f"--hf times HF generate(), and {hf_missing}; install it, or leave --hf out")
    if args.hf:
        from blockloop.convert.hf import export_architecture

        try:
            export_architecture(models[0].model.config)
        except BlockloopError as exc:
            raise BlockloopError(f"--hf times HF generate() on the first model, {models[0].name}: {exc}") from None
    settings = ThroughputSettings(
        prompt_len, gen_len, args.batch_sizes,
        repeats=args.repeats, warmup=args.warmup, sync_every=sync_every,
        compile=args.compile,
        search=args.search, max_batch=args.max_batch, seed=args.seed, hf=args.hf,
        caches=("static", *(["whole-keys"] if args.whole_keys else []), *(["paged"] if args.paged else []),
                *(["paged-kernel"] if args.paged_kernel else [])),
        key_buckets=args.key_buckets,
    )
    bandwidth = measure_bandwidth(device)
    print(f"measured copy bandwidth: {bandwidth / 1e9:.1f} GB/s; prompt {settings.prompt_len}, generate {settings.gen_len}")
    notes: list[str] = []

    def measured(row: dict[str, Any]) -> None:  # the table waits for the ratios: each row is logged as it comes
        rows.append(row)
        print(f"measured {row['name']} at batch {row['batch']}: {row['tok_s']:.0f} tok/s", file=sys.stderr)

    throughput_rows(models, settings, bandwidth, on_row=measured, on_note=notes.append)
    print("| model | batch | tok/s | vs " + models[0].name + " | TTFT ms | TPOT ms | cache B/sample | peak B/sample | roofline |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        frac = f"{100 * r['roofline_fraction']:.1f}%" if r["roofline_fraction"] else "-"
        ratio = f"{r['ratio_vs_baseline']:.2f}x" if r["ratio_vs_baseline"] else "-"
        ttft, tpot = (f"{1e3 * r[key]:.{digits}f}" if math.isfinite(r[key]) else "-"  # HF rows, one-token answers
                      for key, digits in (("ttft_s", 1), ("tpot_s", 2)))
        print(f"| {r['name']} | {r['batch']} | {r['tok_s']:.0f} | {ratio} | {ttft} | {tpot} | "
              f"{r['cache_bytes_per_sample'] or '-'} | {r['peak_mem_per_sample'] or '-'} | {frac} |")
    print("tok/s: generated tokens per second of a whole run, prefill included (the Block Transformer paper's "
          "throughput); roofline: tok/s over the decode steps' memory-bandwidth bound, so a prefill-heavy run reads low")
    for note in notes:
        print(f"note: {note}")
    if args.warmup == 0 and any(r["tpot_s"] == 0 for r in rows):
        print("note: a TPOT of 0 means the first token, timed on its own, took as long as the whole cold run; "
              "time with --warmup 1 or more")


def _stream(args: argparse.Namespace, models: list, rows: list[dict[str, Any]]) -> None:
    """The stream's rows, into ``rows`` as each model finishes, each printed then."""
    from blockloop.bench.suite import StreamSettings, stream_rows
    from blockloop.serve.runners import ExitRule, Speculation

    settings = StreamSettings(
        requests=args.requests, slots=args.slots, prompt_range=args.prompt_range, tokens_range=args.tokens_range,
        rate=args.rate,
        corpus=args.corpus, sync_every=args.sync_every, compile=args.compile, key_buckets=args.key_buckets,
        seed=args.seed, warmup=args.warmup,
        exits=[ExitRule.parse(text) for text in args.exit],
        speculations=[Speculation(k, args.draft_loops, args.adaptive_k) for k in args.speculate],
    )
    for m in stream_rows(models, settings):
        if not rows:  # after the stream is planned: a request it refuses leaves no table header behind
            print("| model | slots | req/s in | tok/s | vs first | vs same | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms "
                  "| ITL p50/p99 ms | E2E p50/p99 ms | loops/token | agreement | drafts kept | tok/pass |")
            print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        rows.append(m)
        loops = f"{m['mean_exit_loop']:.2f}" if "mean_exit_loop" in m else "-"
        agree = f"{100 * m['agreement_vs_no_exit']:.1f}%" if "agreement_vs_no_exit" in m else "-"
        same = f"{m['ratio_vs_same_model']:.2f}x" if "ratio_vs_same_model" in m else "-"
        kept = f"{100 * m['acceptance_rate']:.1f}%" if "acceptance_rate" in m else "-"
        per_pass = f"{m['tokens_per_pass']:.2f}" if "tokens_per_pass" in m else "-"
        print(f"| {m['name']} | {args.slots} | {args.rate} | {m['throughput_tok_s']:.0f} | {m['ratio_vs_baseline']:.2f}x | "
              f"{same} | {_ms(m['ttft_s'], 'median', 'p90', 'p99')} | {_ms(m['tpot_s'], 'median', 'p90', 'p99')} | "
              f"{_ms(m['itl_s'], 'median', 'p99')} | {_ms(m['e2e_s'], 'median', 'p99')} | {loops} | {agree} | {kept} | "
              f"{per_pass} |")
    window = max((r.get("sync_every", 0) for r in rows), default=0)  # the engine's, when --sync-every was left alone
    floor = max((r.get("admit_every", 1) for r in rows), default=1)  # a block model's window holds whole blocks
    if 1 < window and args.tokens_range[0] <= window:
        fix = ("lower --sync-every to resolve short requests" if window > floor else
               f"a Block Transformer's window is at least its block length ({floor}), so --sync-every cannot lower it")
        print(f"note: tokens reach the host every {window} steps (--sync-every), so a request that finishes within "
              f"one window reads a TPOT and ITL of 0; {fix}")
    if args.tokens_range[0] == 1:
        print("note: a one-token request has no time between tokens: TPOT and ITL count only longer ones ('-': none)")
    simulated = [r for r in rows if "simulated" in r]
    if simulated:
        print(f"\nsimulated schedules of the recorded exits ({args.slots} slots, steps = block passes over the batch; "
              "RRT appendix N):")
        print("| model | decoded tokens | mean exit loop | depth-wise steps | sequence-wise steps | static steps "
              "| speedup vs sequence-wise | vs static |")
        print("|---|---|---|---|---|---|---|---|")
        for r in simulated:
            sim = r["simulated"]
            print(f"| {r['name']} | {sim['decoded_tokens']} | {sim['mean_exit_loop']:.3f} | {sim['depthwise_steps']} | "
                  f"{sim['sequencewise_steps']} | {sim['static_steps']} | {sim['speedup_vs_sequencewise']:.2f}x | "
                  f"{sim['speedup_vs_static']:.2f}x |")


def _http(args: argparse.Namespace) -> int:
    """The request stream over HTTP: one row of TTFT / TPOT / ITL / E2E mean, median, p90 and p99."""
    from blockloop.bench import records
    from blockloop.bench.http_stream import run_http_stream

    m = run_http_stream(args.url, requests=args.requests, rate=args.rate, corpus=args.corpus, seed=args.seed,
                        prompt_range=args.prompt_range, tokens_range=args.tokens_range, warmup=args.warmup)
    others = [f"{m['rejected']} more turned away by its full queue, 503"] if m["rejected"] else []
    others += [f"{m['failed']} failed"] if m["failed"] else []
    others_text = f" ({'; '.join(others)})" if others else ""
    print(f"{m['model']} at {args.url}: {m['requests']} requests at {args.rate}/s{others_text}, {m['output_tokens']} "
          f"tokens in {m['duration_s']:.2f} s: {m['requests_per_s']:.2f} req/s, {m['throughput_tok_s']:.1f} tok/s")
    if m["failed"]:
        print(f"warning: {m['failed']} of {args.requests} requests failed (the first: {m['first_failure']}); the "
              f"figures are those of the {m['requests']} that finished; exit status 1", file=sys.stderr)
    if m["rejected"]:
        print(f"warning: {m['rejected']} of {args.requests} requests were turned away by the server's full queue "
              f"(503); the figures are those of the {m['requests']} that finished; offer less load (--rate) or let the "
              "server queue more (serve --max-waiting); exit status 1", file=sys.stderr)
    print("| metric | mean ms | median ms | p90 ms | p99 ms |\n|---|---|---|---|---|")
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        print(f"| {key[:-2].upper()} | {_ms(m[key], 'mean', 'median', 'p90', 'p99').replace('/', ' | ')} |")
    if args.record is not None:
        # What every record names (read from this machine): the client's CPU, torch, Python, date and command. The
        # server's own device is not visible from here; its command line is the one to quote beside this record.
        env = records.environment()
        env["client_device"] = env.pop("device")
        records.append_records(args.record, [{"kind": "http_stream", "name": m["model"], **env, **m}])
    return 1 if m["failed"] or m["rejected"] else 0  # a script must not read a partly served run as a clean one


def _ms(summary: dict[str, float], *keys: str) -> str:
    """Percentiles in ms; "-" where none was measured (no request had two tokens)."""
    return "/".join(f"{1e3 * summary[k]:.1f}" if math.isfinite(summary[k]) else "-" for k in keys)
