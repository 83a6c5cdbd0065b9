"""``blockloop bench``: throughput protocol, request stream, and the Pareto plot from recorded runs."""

from __future__ import annotations

import argparse
import datetime
import math
import platform
from pathlib import Path
from typing import Any

import torch
from torch import nn

from blockloop.errors import BlockloopError


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("models (the first one is the baseline the ratios divide by)")
    m.add_argument("--presets",
                   help="comma-separated presets, randomly initialised (default without --checkpoint: pythia-85m,block-85m)")
    m.add_argument("--checkpoint", action="append", default=[],
                   help="a trained run to bench, after the --presets (repeatable; its validation loss is recorded for --plot)")
    m.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    m.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="weights/cache dtype (default: bfloat16 on CUDA, float32 on CPU)")
    m.add_argument("--compile", action="store_true", help="torch.compile the decode step (CUDA graphs on CUDA)")
    m.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's own; 1 is steadier on a shared box)")
    t = p.add_argument_group("throughput protocol (Block Transformer section 3.2)")
    t.add_argument("--scenario", choices=["prefill-heavy", "decode-heavy"], default="decode-heavy",
                   help="prompt/gen lengths 2048/128 or 128/2048 (default: decode-heavy)")
    t.add_argument("--prompt-len", type=int, help="override the scenario's prompt length (e.g. 32 on CPU)")
    t.add_argument("--gen-len", type=int, help="override the scenario's generated tokens (e.g. 64 on CPU)")
    t.add_argument("--batch-sizes", default="1,16,64", help="comma-separated batch sizes (default: 1,16,64)")
    t.add_argument("--search", action="store_true", help="keep doubling the batch past the list until out of memory")
    t.add_argument("--max-batch", type=int, default=4096, help="upper bound for --search (default: 4096)")
    t.add_argument("--repeats", type=int, default=3, help="timed runs per batch size (default: 3)")
    t.add_argument("--warmup", type=int, default=1, help="untimed runs first (default: 1)")
    t.add_argument("--sync-every", type=int, default=16, help="decode steps between host syncs (default: 16)")
    t.add_argument("--hf", action="store_true", help="also time HF generate() on the first (vanilla) model")
    s = p.add_argument_group("request stream (continuous batching)")
    s.add_argument("--stream", action="store_true", help="run the request-stream benchmark instead")
    s.add_argument("--requests", type=int, default=64, help="requests in the stream (default: 64)")
    s.add_argument("--rate", type=float, default=math.inf, help="Poisson arrivals per second (default: inf, a fixed queue)")
    s.add_argument("--slots", type=int, default=16, help="engine slots (concurrent requests, default: 16)")
    s.add_argument("--prompt-range", default="16,64", help="min,max prompt tokens cut from the corpus (default: 16,64)")
    s.add_argument("--tokens-range", default="16,64", help="min,max tokens each request asks for (default: 16,64)")
    s.add_argument("--corpus", default="shakespeare", help="built-in corpus the prompts come from (default: shakespeare)")
    s.add_argument("--exit", metavar="RULE:THRESHOLD", action="append", default=[],
                   help="also serve recursive models depth-wise with this early-exit rule, e.g. max_prob:0.9, "
                   "entropy:2.0, none:0 or oracle (repeatable); reports mean loops per token, greedy agreement with "
                   "the sequence-wise (no-exit) run, and the simulated depth-wise speedup (RRT appendix N) of the "
                   "recorded exits; oracle runs every loop and exits at the first loop agreeing with the last")
    o = p.add_argument_group("output")
    o.add_argument("--record", type=Path, help="append every result to this JSON-lines file")
    o.add_argument("--plot", type=Path, metavar="PNG",
                   help="draw throughput vs validation loss (Figure 2) from --record's runs and exit")
    o.add_argument("--seed", type=int, default=0, help="seed for prompts and arrivals (default: 0)")


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise BlockloopError(f"{flag} takes comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise BlockloopError(f"{flag} needs positive integers, got {text!r}")
    return values


def _models(args: argparse.Namespace, device: str, dtype: torch.dtype) -> list[tuple[str, nn.Module, float | None]]:
    from blockloop.bench.records import last_val_loss
    from blockloop.models import build_model
    from blockloop.presets import from_name

    models: list[tuple[str, nn.Module, float | None]] = []
    presets = args.presets if args.presets is not None else ("" if args.checkpoint else "pythia-85m,block-85m")
    for name in [n.strip() for n in presets.split(",") if n.strip()]:
        torch.manual_seed(args.seed)
        models.append((name, build_model(from_name(name)).to(device=device, dtype=dtype).eval(), None))
    for path in args.checkpoint:
        from blockloop.train.run import load_trained

        trained = load_trained(path, device)
        models.append((Path(path).name, trained.model.to(dtype), last_val_loss(Path(path))))
    if not models:
        raise BlockloopError("nothing to bench: give --presets or --checkpoint")
    return models


def run(args: argparse.Namespace, device: str) -> int:
    from blockloop.bench import records

    if args.plot is not None:
        if args.record is None:
            raise BlockloopError("--plot reads recorded runs: give --record FILE.jsonl as well")
        n = records.plot_pareto(records.read_records(args.record), args.plot)
        print(f"wrote {args.plot} ({n} runs)")
        return 0
    if args.threads is not None:
        if args.threads < 1:
            raise BlockloopError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        args.dtype, torch.bfloat16 if device.startswith("cuda") else torch.float32)
    meta = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else f"cpu ({platform.processor() or platform.machine()})",
            "torch": torch.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads()}
    models = _models(args, device, dtype)
    results = _stream(args, models) if args.stream else _throughput(args, models, torch.device(device))
    for r in results:
        r.update(meta)
    print(f"device: {meta['device']}, {meta['threads']} threads  torch {meta['torch']}  {meta['dtype']}  {meta['date']}")
    if args.record is not None:
        records.append_records(args.record, results)
    return 0


def _throughput(args: argparse.Namespace, models: list, device: torch.device) -> list[dict[str, Any]]:
    from blockloop.bench.hf_baseline import hf_available, hf_throughput
    from blockloop.bench.throughput import SCENARIOS, engine_throughput, search_batches
    from blockloop.bench.timing import copy_bandwidth

    prompt_len, gen_len = SCENARIOS[args.scenario]
    prompt_len, gen_len = args.prompt_len or prompt_len, args.gen_len or gen_len
    batches = _ints(args.batch_sizes, "--batch-sizes")
    if args.repeats < 1 or args.warmup < 0:
        raise BlockloopError("--repeats must be >= 1 and --warmup >= 0")
    bandwidth = copy_bandwidth(device, nbytes=(1 << 28) if device.type == "cuda" else (1 << 26))
    print(f"measured copy bandwidth: {bandwidth / 1e9:.1f} GB/s; prompt {prompt_len}, generate {gen_len}")
    rows: list[dict[str, Any]] = []
    for name, model, val_loss in models:
        def one(batch: int, model: nn.Module = model, name: str = name) -> Any:
            return engine_throughput(model, name, batch, prompt_len, gen_len, repeats=args.repeats, warmup=args.warmup,
                                     sync_every=args.sync_every, compile=args.compile, bandwidth=bandwidth, seed=args.seed)
        for result in search_batches(one, batches, search=args.search, max_batch=args.max_batch):
            rows.append({"kind": "throughput", "val_loss": val_loss, **result.to_dict()})
    if args.hf:
        reason = hf_available()
        if reason is not None:
            print(f"HF generate() baseline skipped: {reason}")
        else:
            name, model, _ = models[0]
            for batch in batches:
                rows.append({"kind": "throughput", "val_loss": None, **hf_throughput(
                    model, batch, prompt_len, gen_len, repeats=args.repeats, warmup=args.warmup, seed=args.seed).to_dict()})
    base = {r["batch"]: r["tok_s"] for r in rows if r["name"] == models[0][0]}
    print("| model | batch | tok/s | vs " + models[0][0] + " | TTFT ms | TPOT ms | cache B/sample | peak B/sample | roofline |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        r["ratio_vs_baseline"] = r["tok_s"] / base[r["batch"]] if r["batch"] in base else None
        frac = f"{100 * r['roofline_fraction']:.1f}%" if r["roofline_fraction"] else "-"
        ratio = f"{r['ratio_vs_baseline']:.2f}x" if r["ratio_vs_baseline"] else "-"
        print(f"| {r['name']} | {r['batch']} | {r['tok_s']:.0f} | {ratio} | {1e3 * r['ttft_s']:.1f} | "
              f"{1e3 * r['tpot_s']:.2f} | {r['cache_bytes_per_sample'] or '-'} | {r['peak_mem_per_sample'] or '-'} | {frac} |")
    return rows


def _stream(args: argparse.Namespace, models: list) -> list[dict[str, Any]]:
    from blockloop.bench.stream import agreement, corpus_prompts, run_stream
    from blockloop.serve.exit_schedule import simulate
    from blockloop.serve.runners import runner_for
    from blockloop.serve.runners.recursive import RecursiveRunner

    lo, hi = _ints(args.prompt_range, "--prompt-range")[:2]
    tmin, tmax = _ints(args.tokens_range, "--tokens-range")[:2]
    if args.requests < 1:
        raise BlockloopError(f"--requests must be >= 1, got {args.requests}")
    rules = [_exit_rule(text) for text in args.exit]
    served = []
    for name, model, val_loss in models:
        served.append((name, model, val_loss, None))
        if isinstance(runner_for(model), RecursiveRunner):
            served += [(f"{name} depth-wise exit {_rule_name(r)}", runner_for(model, exit_rule=r), val_loss, name)
                       for r in rules]
    rows: list[dict[str, Any]] = []
    outputs: dict[str, list[list[int]]] = {}
    print("| model | slots | req/s in | tok/s | vs first | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms | ITL p50/p99 ms "
          "| E2E p50/p99 ms | loops/token | agreement |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, model, val_loss, reference in served:
        prompts = corpus_prompts(model.config.vocab_size, args.requests, lo, hi, corpus=args.corpus, seed=args.seed)
        m = run_stream(model, prompts, n_slots=args.slots, min_tokens=tmin, max_tokens=tmax, rate=args.rate,
                       sync_every=args.sync_every, seed=args.seed, compile=args.compile)
        outputs[name] = m.pop("outputs")
        if "exit_trajectories" in m:
            m["simulated"] = simulate(m.pop("exit_trajectories"), args.slots, model.config.loops)
            m["mean_exit_loop"] = m["simulated"]["mean_exit_loop"]  # of the delivered tokens only
        if reference is not None:
            m["agreement_vs_no_exit"] = agreement(outputs[name], outputs[reference])
        m["ratio_vs_baseline"] = m["throughput_tok_s"] / rows[0]["throughput_tok_s"] if rows else 1.0
        rows.append({"kind": "stream", "name": name, "val_loss": val_loss, **m})
        loops = f"{m['mean_exit_loop']:.2f}" if "mean_exit_loop" in m else "-"
        agree = f"{100 * m['agreement_vs_no_exit']:.1f}%" if "agreement_vs_no_exit" in m else "-"
        print(f"| {name} | {args.slots} | {args.rate} | {m['throughput_tok_s']:.0f} | {m['ratio_vs_baseline']:.2f}x | "
              f"{_ms(m['ttft_s'], 'median', 'p90', 'p99')} | {_ms(m['tpot_s'], 'median', 'p90', 'p99')} | "
              f"{_ms(m['itl_s'], 'median', 'p99')} | {_ms(m['e2e_s'], 'median', 'p99')} | {loops} | {agree} |")
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
    return rows


def _rule_name(rule: Any) -> str:
    return "oracle" if rule.kind == "oracle" else f"{rule.kind}:{rule.threshold:g}"


def _ms(summary: dict[str, float], *keys: str) -> str:
    return "/".join(f"{1e3 * summary[k]:.1f}" for k in keys)


def _exit_rule(text: str) -> Any:
    from blockloop.serve.runners import ExitRule

    kind, _, threshold = text.partition(":")
    try:
        return ExitRule(kind, float(threshold or 0))
    except ValueError as exc:
        raise BlockloopError(f"--exit takes RULE:THRESHOLD such as max_prob:0.9, got {text!r}") from exc
