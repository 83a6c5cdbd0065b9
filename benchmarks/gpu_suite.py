"""Issue 12's GPU benchmark suite: every row of its table in one command, each baseline timed in the same run.

    .venv/bin/python benchmarks/gpu_suite.py --record     # on one H100/H200: meant for about 20 minutes (not yet run)

``--smoke`` runs the same rows with tiny presets on CPU in about a minute, which checks the suite, not the engine.

Rows (the Block Transformer paper's protocol through :mod:`blockloop.bench`: random prompts, EOS off, warm-up,
CUDA events, batch search; tok/s, TTFT, TPOT, peak memory and static cache per sample, fraction of the
memory roofline = bytes read per step / measured copy bandwidth):

* vanilla and block, decode-heavy (128 / 2048) and prefill-heavy (2048 / 128) in one run each, with Hugging
  Face ``generate()`` on the vanilla weights and the vanilla model over a paged KV cache beside its static one
  (:func:`blockloop.bench.suite.throughput_rows`);
* recursive: a vanilla model trained briefly, converted to 2 loops and uptrained with the early-exit loss
  (the ``blockloop`` commands are recorded), then a Poisson request stream served by the vanilla model
  sequence-wise and by the looped one sequence-wise, depth-wise with confidence exit and self-speculatively
  (:func:`blockloop.bench.suite.stream_rows`): measured speed, greedy agreement, validation loss, and the
  speculative server's acceptance rate and tokens per verification pass (issue 19);
* double decoder vs the decoder of the same size: KV bytes, TTFT and TPOT ratios;
* training tokens/s and MFU, eager and compiled (``benchmarks/train_throughput.py``'s trainer run).

Writes ``gpu-<date>-<device>.md`` and ``.json`` (``gpu-<date>-<device>-<rows>.*`` for a ``--rows`` subset) to
runs/bench/ (``--out-dir DIR`` elsewhere, ``--record`` into benchmarks/results/), again after every row, so a run
stopped part-way (a device call ends at 10 minutes: split the rows over several calls) keeps the rows it finished.
A target is called met only from a CUDA run; ``--smoke`` rows say so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from train_throughput import run_variant

from blockloop.bench.hf_baseline import hf_available
from blockloop.bench.records import (
    add_output_arguments,
    environment,
    environment_line,
    output_dir,
    run_script,
)
from blockloop.bench.suite import (
    StreamSettings,
    ThroughputSettings,
    bench_dtype,
    load_models,
    measure_bandwidth,
    stream_rows,
    throughput_rows,
)
from blockloop.bench.throughput import scenario_lengths
from blockloop.cli import main as blockloop
from blockloop.cli.common import positive_int, positive_ints
from blockloop.device import resolve_device
from blockloop.errors import BlockloopError
from blockloop.families import build_model, from_name
from blockloop.serve.runners import ExitRule, Speculation

ROWS = ("decode-heavy", "prefill-heavy", "recursive", "double-decoder", "training")


@dataclass
class Plan:
    """Presets and sizes of one suite run (the issue's on a GPU, tiny ones for ``--smoke``)."""

    vanilla: str
    block: str
    decoder: str  # the double decoder's same-size decoder-only baseline
    double: str
    decode_batches: list[int]
    prefill_batches: list[int]
    search: bool  # double the decode-heavy batch past the list until out of memory
    repeats: int
    warmup: int
    lengths: dict[str, tuple[int, int]] | None  # (prompt, gen) per scenario; None: the paper's, fitted to the models
    double_lengths: tuple[int, int]
    double_batch: int
    max_batch: int  # bound of the batch search
    tokenizer: str  # of the trained models (recursive and training rows)
    pretrain_steps: int  # the vanilla model the looped one is converted from
    uptrain_steps: int  # early-exit uptraining of the 2-loop model
    uptrain_seq_len: int
    uptrain_batch: int
    stream_requests: int
    stream_slots: int
    stream_rate: float  # Poisson arrivals per second
    stream_prompts: tuple[int, int]
    stream_tokens: tuple[int, int]
    exit_threshold: float  # max_prob confidence exit
    train_preset: str
    train_seq: int
    train_batch: int
    train_steps: int
    train_log_interval: int
    train_variants: tuple[str, ...]


GPU = Plan(
    vanilla="pythia-85m", block="block-85m", decoder="paper-decoder-100m", double="paper-double-100m",
    decode_batches=[64, 256], prefill_batches=[64], search=True, repeats=2, warmup=1, lengths=None,
    double_lengths=(1024, 256), double_batch=32, max_batch=1024, tokenizer="neox", pretrain_steps=400,
    uptrain_steps=400, uptrain_seq_len=512, uptrain_batch=32, stream_requests=512, stream_slots=128, stream_rate=200.0,
    stream_prompts=(64, 512), stream_tokens=(64, 512), exit_threshold=0.9,
    train_preset="pythia-302m", train_seq=2048, train_batch=8, train_steps=30, train_log_interval=10, train_variants=("eager", "compiled"),
)

SMOKE = Plan(
    vanilla="tiny", block="tiny-block", decoder="demo", double="demo-double",
    decode_batches=[1, 2], prefill_batches=[2], search=False, repeats=1, warmup=0,
    lengths={"decode-heavy": (8, 16), "prefill-heavy": (32, 4)}, double_lengths=(16, 8), double_batch=2,
    max_batch=2, tokenizer="byte", pretrain_steps=4, uptrain_steps=4, uptrain_seq_len=32, uptrain_batch=4,
    stream_requests=8, stream_slots=4, stream_rate=200.0, stream_prompts=(4, 12), stream_tokens=(4, 8),
    exit_threshold=0.5, train_preset="tiny", train_seq=32, train_batch=4, train_steps=4, train_log_interval=2,
    train_variants=("eager",),
)


@dataclass
class Suite:
    plan: Plan
    device: torch.device
    dtype: torch.dtype
    bandwidth: float
    work: Path  # scratch runs of the recursive row
    commands: list[str]

    def throughput(self, presets: str, lengths: tuple[int, int], batches: list[int], *, search: bool, hf: bool,
                   caches: tuple[str, ...] = ("static",)) -> list[dict[str, Any]]:
        models = load_models(presets, [], str(self.device), self.dtype)
        p = self.plan
        settings = ThroughputSettings(*lengths, batches, repeats=p.repeats, warmup=p.warmup, search=search, hf=hf,
                                      max_batch=p.max_batch, compile=self.device.type == "cuda", caches=caches)
        return throughput_rows(models, settings, self.bandwidth,
                               on_row=lambda row: print(f"[gpu_suite] {json.dumps(row, default=str)}", flush=True))

    def run_cli(self, *argv: str) -> None:
        """A ``blockloop`` command, in this process, recorded with the scratch folder written ``$WORK``."""
        self.commands.append("blockloop " + " ".join(argv).replace(str(self.work), "$WORK"))
        if blockloop(list(argv)) != 0:
            raise BlockloopError(f"blockloop {' '.join(argv)} failed")


def best(rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The highest-throughput row of model ``name``."""
    return max((r for r in rows if r["name"] == name), key=lambda r: r["tok_s"])


def lengths_of(suite: Suite, scenario: str) -> tuple[int, int]:
    if suite.plan.lengths is not None:
        return suite.plan.lengths[scenario]
    with torch.device("meta"):  # only configs and runners are read
        models = [build_model(from_name(name)) for name in (suite.plan.vanilla, suite.plan.block)]
    return scenario_lengths(scenario, models)


def scenario_rows(suite: Suite, scenario: str) -> list[dict[str, Any]]:
    """Vanilla and block in one throughput run, HF ``generate()`` on the vanilla weights beside them."""
    p = suite.plan
    lengths = lengths_of(suite, scenario)
    decode = scenario == "decode-heavy"
    batches = p.decode_batches if decode else p.prefill_batches
    hf_missing = hf_available()
    rows = suite.throughput(f"{p.vanilla},{p.block}", lengths, batches, search=decode and p.search, hf=hf_missing is None)
    vanilla, block = best(rows, p.vanilla), best(rows, p.block)
    try:  # the paged cache's first GPU run: a failure is recorded, not allowed to cost the rest of the suite
        rows += suite.throughput(p.vanilla, lengths, batches, search=decode and p.search, hf=False, caches=("paged",))
        paged = best(rows, f"{p.vanilla} paged")
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        paged = {"tok_s": float("nan"), "batch": None, "roofline_fraction": None, "cache_bytes_per_sample": 0,
                 "error": f"{type(exc).__name__}: {exc}"}
    hf = best(rows, "hf-generate") if hf_missing is None else {"tok_s": float("nan"), "batch": None, "why_not": hf_missing}
    setting = f"prompt {lengths[0]} / generate {lengths[1]}"
    return [
        {"row": f"vanilla {scenario}", "setting": f"`{p.vanilla}`, {setting}, batch {vanilla['batch']}",
         "target": "≥ 85% of the memory roofline; HF generate() reported" if decode else "≥ 18K tok/s (batch 64)",
         "measured": {**vanilla, "hf_generate_tok_s": hf["tok_s"], "hf_batch": hf["batch"],
                      "vs_hf": vanilla["tok_s"] / hf["tok_s"], "paged_tok_s": paged["tok_s"], "paged_batch": paged["batch"],
                      "paged_roofline_fraction": paged["roofline_fraction"],
                      "paged_cache_bytes_per_sample": paged["cache_bytes_per_sample"], "paged_error": paged.get("error")},
         "met": max(vanilla["roofline_fraction"] or 0, paged["roofline_fraction"] or 0) >= 0.85 if decode
         else max(vanilla["tok_s"], paged["tok_s"]) >= 18_000},
        {"row": f"block {scenario}", "setting": f"`{p.block}` vs `{p.vanilla}`, {setting}, batch {block['batch']}",
         "target": "≥ 400K tok/s and ≥ 10x the vanilla engine" if decode else "> 59K tok/s",
         "measured": {**block, "vs_vanilla": block["tok_s"] / vanilla["tok_s"]},
         "met": block["tok_s"] >= 400_000 and block["tok_s"] >= 10 * vanilla["tok_s"] if decode else block["tok_s"] > 59_000},
        {"row": f"{scenario} throughput, every batch", "rows": rows},
    ]


def recursive_rows(suite: Suite) -> list[dict[str, Any]]:
    """Train a vanilla model, convert it to 2 loops, uptrain with the early-exit loss, then serve a stream."""
    p, w = suite.plan, suite.work
    common = ["--tokenizer", p.tokenizer, "--seq-len", str(p.uptrain_seq_len), "--batch-size", str(p.uptrain_batch),
              "--device", str(suite.device), "--no-progress", "--eval-batches", "4"]
    suite.run_cli("train", "--preset", p.vanilla, "--steps", str(p.pretrain_steps), "--eval-interval", str(p.pretrain_steps),
                  "--out", str(w / "vanilla"), *common)
    suite.run_cli("convert", "--to", "recursive", "--checkpoint", str(w / "vanilla"), "--loops", "2",
                  "--out", str(w / "looped"), "--no-progress")
    suite.run_cli("train", "--init-from", str(w / "looped"), "--early-exit", "weighted", "--steps", str(p.uptrain_steps),
                  "--eval-interval", str(p.uptrain_steps), "--out", str(w / "looped-exit"), *common[2:])
    models = load_models(None, [str(w / "vanilla"), str(w / "looped-exit")], str(suite.device), suite.dtype)
    models[0].name, models[1].name = f"{p.vanilla} (trained)", f"{p.vanilla} looped 2x (early exit)"
    rule = ExitRule("max_prob", p.exit_threshold)
    speculation = Speculation(k=4, draft_loops=1)  # draft with the first of the two loops (issue 19)
    settings = StreamSettings(requests=p.stream_requests, slots=p.stream_slots, prompt_range=p.stream_prompts,
                              tokens_range=p.stream_tokens, rate=p.stream_rate, exits=[rule], speculations=[speculation],
                              compile=suite.device.type == "cuda")
    stream = list(stream_rows(models, settings))
    depthwise, speculative = stream[-2], stream[-1]
    return [
        {"row": "recursive", "setting": f"`{p.vanilla}` looped 2x, Poisson stream {p.stream_rate:g} req/s, "
         f"{p.stream_requests} requests, {p.stream_slots} slots, exit max_prob {p.exit_threshold:g}",
         "target": "depth-wise + confidence exit ≥ 2x the full-size vanilla model (sequence-wise)",
         "measured": {"vs_vanilla": depthwise["ratio_vs_baseline"], "vs_looped_sequence_wise": depthwise["ratio_vs_same_model"],
                      "greedy_agreement_vs_no_exit": depthwise["agreement_vs_no_exit"],
                      "mean_exit_loop": depthwise["mean_exit_loop"],
                      "val_loss": {r["name"]: r["val_loss"] for r in stream}},
         "met": depthwise["ratio_vs_baseline"] >= 2.0},
        {"row": "recursive speculative", "setting": f"the same looped model and stream, drafting k = {speculation.k} "
         f"tokens with {speculation.draft_loops} loop, verified by the other",
         "target": "output identical to sequence-wise greedy (issue 19); acceptance, tokens per pass and tok/s reported",
         "measured": {"vs_vanilla": speculative["ratio_vs_baseline"],
                      "vs_looped_sequence_wise": speculative["ratio_vs_same_model"],
                      "greedy_agreement_vs_no_exit": speculative["agreement_vs_no_exit"],
                      "acceptance_rate": speculative["acceptance_rate"], "tokens_per_pass": speculative["tokens_per_pass"]},
         "met": speculative["agreement_vs_no_exit"] == 1.0},
        {"row": "recursive stream, every server", "rows": [{k: v for k, v in r.items() if k != "simulated"} for r in stream]},
    ]


def double_decoder_rows(suite: Suite) -> list[dict[str, Any]]:
    p = suite.plan
    rows = suite.throughput(f"{p.decoder},{p.double}", p.double_lengths, [p.double_batch], search=False, hf=False)
    decoder, double = best(rows, p.decoder), best(rows, p.double)
    kv = double["cache_bytes_per_sample"] / decoder["cache_bytes_per_sample"]
    return [{"row": "double decoder", "setting": f"`{p.double}` vs `{p.decoder}`, prompt {p.double_lengths[0]} / "
             f"generate {p.double_lengths[1]}, batch {p.double_batch}",
             "target": "KV bytes within 5% of 1/3; TTFT and TPOT ratios reported",
             "measured": {"kv_bytes_ratio": kv, "ttft_ratio": double["ttft_s"] / decoder["ttft_s"],
                          "tpot_ratio": double["tpot_s"] / decoder["tpot_s"], "tok_s_ratio": double["tok_s"] / decoder["tok_s"],
                          "rows": rows},
             "met": abs(kv - 1 / 3) <= 0.05 / 3}]


def training_rows(suite: Suite) -> list[dict[str, Any]]:
    p = suite.plan
    args = argparse.Namespace(preset=p.train_preset, data="shakespeare", tokenizer=p.tokenizer,
                              seq_len=p.train_seq, batch_size=p.train_batch, steps=p.train_steps,
                              log_interval=p.train_log_interval, device=str(suite.device))
    results = {}
    for variant in p.train_variants:
        with tempfile.TemporaryDirectory() as tmp:
            results[variant] = run_variant(args, variant == "compiled", Path(tmp))
    return [{"row": "training", "setting": f"`{p.train_preset}`, bf16 autocast on CUDA, seq {p.train_seq}, batch {p.train_batch}",
             "target": "≥ 50% MFU (compiled), eager beside it", "measured": results,
             "met": results.get("compiled", {}).get("mfu", 0.0) >= 0.5}]


def summary(row: dict[str, Any]) -> str:
    """The measured cell of the markdown table."""
    m = row["measured"]
    if "error" in m:
        return f"failed: {m['error']}"
    if "tok_s" in m:
        parts = [f"{m['tok_s']:,.0f} tok/s", f"TTFT {1e3 * m['ttft_s']:.2f} ms", f"TPOT {1e3 * m['tpot_s']:.3f} ms"]
        if m["roofline_fraction"] is not None:
            parts.append(f"{100 * m['roofline_fraction']:.0f}% of roofline")
        if m["peak_mem_per_sample"] is not None:
            parts.append(f"peak {m['peak_mem_per_sample'] / 2**20:.1f} MiB/sample")
        parts.append(f"cache {m['cache_bytes_per_sample'] / 2**20:.2f} MiB/sample")
        parts += [f"{m[k]:.2f}x {k[3:]}" for k in ("vs_hf", "vs_vanilla") if k in m]
        if "hf_generate_tok_s" in m:
            parts.append(f"HF generate() {m['hf_generate_tok_s']:,.0f} tok/s (batch {m['hf_batch']})")
        if m.get("paged_error"):
            parts.append(f"paged KV failed: {m['paged_error']}")
        elif "paged_tok_s" in m:
            roof = m["paged_roofline_fraction"]
            parts.append(f"paged KV {m['paged_tok_s']:,.0f} tok/s (batch {m['paged_batch']}"
                         + (f", {100 * roof:.0f}% of roofline" if roof is not None else "")
                         + f", cache {m['paged_cache_bytes_per_sample'] / 2**20:.2f} MiB/sample)")
        return "; ".join(parts)
    if "kv_bytes_ratio" in m:
        return (f"KV bytes {m['kv_bytes_ratio']:.3f}x, TTFT {m['ttft_ratio']:.2f}x, TPOT {m['tpot_ratio']:.2f}x, "
                f"tok/s {m['tok_s_ratio']:.2f}x")
    if "acceptance_rate" in m:
        return (f"{m['vs_vanilla']:.2f}x vanilla, {m['vs_looped_sequence_wise']:.2f}x looped sequence-wise, greedy "
                f"agreement {100 * m['greedy_agreement_vs_no_exit']:.1f}%, acceptance {100 * m['acceptance_rate']:.1f}%, "
                f"{m['tokens_per_pass']:.2f} tokens per pass")
    if "vs_vanilla" in m:
        losses = ", ".join(f"{k} {v:.3f}" for k, v in m["val_loss"].items() if v is not None)
        return (f"{m['vs_vanilla']:.2f}x vanilla, {m['vs_looped_sequence_wise']:.2f}x looped sequence-wise, greedy "
                f"agreement {100 * m['greedy_agreement_vs_no_exit']:.1f}%, mean exit loop {m['mean_exit_loop']:.2f}; "
                f"val loss {losses}")
    return "; ".join(f"{k} {v['tokens_per_s']:,.0f} tok/s" + (f", MFU {100 * v['mfu']:.1f}%" if "mfu" in v else "")
                     for k, v in m.items())


def write(out: Path, record: dict[str, Any], smoke: bool) -> Path:
    """The record's ``.json`` and ``.md``; a subset of the rows is named by its rows, so the calls a GPU session
    splits the suite into (one device call runs at most 10 minutes) do not overwrite each other."""
    device = record["device"]
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower().split(" (")[0]).strip("-") + ("-smoke" if smoke else "")
    subset = "" if record["rows_asked"] == list(ROWS) else "-" + "-".join(record["rows_asked"])
    stem = f"gpu-{record['date'][:10]}-{slug}{subset}"
    (out / f"{stem}.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    status = "smoke (CPU): no claim" if smoke else None
    missing = [name for name in record["rows_asked"] if name not in record["rows_done"]]
    lines = [f"# Issue 12 GPU suite{' (smoke: tiny presets, not a measurement)' if smoke else ''}", "",
             *([f"- **incomplete**: stopped before {', '.join(missing)} (written after each row)"] if missing else []),
             f"- {environment_line(record)}", f"- memory bandwidth (copy): {record['bandwidth_gb_s']:.1f} GB/s; "
             f"suite wall time {record['wall_s']:.0f} s", "", "| row | setting | target | measured | met |", "|---|---|---|---|---|"]
    for row in record["rows"]:
        if "target" in row:
            met = status or ("yes" if row["met"] else "no")
            lines.append(f"| {row['row']} | {row['setting']} | {row['target']} | {summary(row)} | {met} |")
    lines += ["", "Commands run by the suite (after the suite's own command above; `$WORK` is a scratch folder):", "",
              "```bash",
              *record["commands"], "```", ""]
    (out / f"{stem}.md").write_text("\n".join(lines))
    return out / f"{stem}.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny presets on CPU (about a minute): checks the suite runs")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cuda, cpu (--smoke: cpu)")
    parser.add_argument("--threads", type=int, help="CPU threads for torch")
    parser.add_argument("--repeats", type=positive_int, help="timed runs per batch size (default: 2 on a GPU; 1 helps a "
                        "row fit one 10-minute device call)")
    parser.add_argument("--max-batch", type=positive_int, help="bound of the decode-heavy batch search (default: 1024)")
    parser.add_argument("--decode-batches", type=positive_ints, help="decode-heavy batch sizes before the search "
                        "(default: 64,256; e.g. 256 with --max-batch 256 times one batch, to fit a short device call)")
    add_output_arguments(parser)
    args = parser.parse_args()
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    # A step past dynamo's recompile limit would run eagerly and be timed as compiled: fail the row instead.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    device = torch.device("cpu" if args.smoke else resolve_device(args.device))
    plan = SMOKE if args.smoke else GPU
    overrides = {"repeats": args.repeats, "max_batch": args.max_batch, "decode_batches": args.decode_batches}
    plan = dataclasses.replace(plan, **{k: v for k, v in overrides.items() if v is not None})  # recorded with the run
    dtype = bench_dtype("auto", str(device))
    out = output_dir(args)
    start = time.perf_counter()
    environment_now = environment(str(device), dtype)  # the date (and so the file name) of the whole run
    with tempfile.TemporaryDirectory() as work:
        suite = Suite(plan, device, dtype, measure_bandwidth(device), Path(work), [])
        results: list[dict[str, Any]] = []
        done: list[str] = []

        def record() -> dict[str, Any]:
            return {**environment_now, "smoke": args.smoke, "plan": asdict(plan), "rows_asked": rows, "rows_done": done,
                    "bandwidth_gb_s": suite.bandwidth / 1e9, "wall_s": time.perf_counter() - start,
                    "commands": suite.commands, "rows": results}

        for name in rows:
            builder = {"decode-heavy": lambda s: scenario_rows(s, "decode-heavy"),
                       "prefill-heavy": lambda s: scenario_rows(s, "prefill-heavy"), "recursive": recursive_rows,
                       "double-decoder": double_decoder_rows, "training": training_rows}[name]
            try:
                results += builder(suite)
            except Exception as exc:  # noqa: BLE001  (one failing row must not cost the others their device time)
                traceback.print_exc()
                results.append({"row": name, "setting": "-", "target": "-", "measured": {"error": f"{type(exc).__name__}: {exc}"},
                                "met": False})
            done.append(name)
            # Written after every row: a device call killed at its time limit still returns the rows it finished.
            path = write(out, record(), args.smoke)
            print(f"[gpu_suite] {name} done after {time.perf_counter() - start:.0f} s (written to {path})", flush=True)
    print(path.read_text())


if __name__ == "__main__":
    run_script(main)
