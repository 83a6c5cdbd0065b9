"""SmolLM2-135M decode on CPU: ``blockloop generate``'s path against Hugging Face ``generate()``, same weights.

The imported SmolLM2-135M-Instruct (grouped-query attention: 9 query heads over 3 key/value heads) is
decoded greedily for exactly ``--gen-len`` tokens after random ``--prompt-len``-token prompts (EOS off), at
each batch size, by :func:`blockloop.serve.generate.generate` (what ``blockloop generate`` calls) and by
``transformers``' ``generate()`` on the same model exported with :func:`blockloop.convert.hf.to_hf_model`
(:mod:`blockloop.bench.hf_baseline`), on the same prompts. Both run in this process, alternating run by run,
so the ratio is what the CPU numbers mean (the machine is shared). blockloop's time includes packing the weights
for oneDNN (:func:`blockloop.nn.linear.packed_linears`), which every ``generate`` call does. Each run also counts
the rows whose greedy tokens equal HF's (float32 rounding differs between the two kernels, so a near-tie may
flip). ``--profile`` adds the top operators of one blockloop run (torch profiler, self CPU time), which is where
the time goes; ``--count-ops`` the ATen operators each side dispatches per decoded token (at batch 1, a decode
step is as much per-op overhead on the host as matmul time, so fewer ops is faster).

    .venv/bin/python benchmarks/cpu_decode_vs_hf.py --batch-sizes 1,8 --prompt-len 64 --gen-len 64 --threads 1 --record

Writes ``cpu_decode_vs_hf.json`` to runs/bench/ (``--out-dir DIR`` elsewhere, ``--record`` into
benchmarks/results/) and prints it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from blockloop.bench.hf_baseline import hf_generate, to_hf_generator
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
from blockloop.serve.generate import generate


def compare(model: torch.nn.Module, hf: torch.nn.Module, batch: int, prompt_len: int, gen_len: int, repeats: int,
            seed: int) -> dict[str, object]:
    """Generated tokens/s of ``generate()`` and of HF ``generate()`` on the same prompts, alternating run by run
    after one warm-up run each (so load from other processes falls on both alike)."""
    generator = torch.Generator().manual_seed(seed)
    seconds: dict[str, list[float]] = {"blockloop": [], "hf": []}
    same_rows = 0
    for run in range(repeats + 1):
        ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=generator)
        start = time.perf_counter()
        out = generate(model, ids.tolist(), gen_len, temperature=0.0)
        mid = time.perf_counter()
        theirs = hf_generate(hf, ids, gen_len)
        end = time.perf_counter()
        assert all(len(row) == gen_len for row in out) and theirs.shape[1] == prompt_len + gen_len
        if run:
            seconds["blockloop"].append(mid - start)
            seconds["hf"].append(end - mid)
            same_rows += sum(row == ref for row, ref in zip(out, theirs[:, prompt_len:].tolist()))
    tok_s = {k: batch * gen_len * len(v) / sum(v) for k, v in seconds.items()}
    ratios = sorted(h / b for b, h in zip(seconds["blockloop"], seconds["hf"]))
    return {"blockloop_tok_s": tok_s["blockloop"], "hf_generate_tok_s": tok_s["hf"],
            "ratio_vs_hf": tok_s["blockloop"] / tok_s["hf"], "ratio_vs_hf_per_run": ratios,
            "rows_equal_to_hf": f"{same_rows}/{batch * repeats}"}


def profile_top(model: torch.nn.Module, batch: int, prompt_len: int, gen_len: int, rows: int = 12) -> list[dict[str, object]]:
    """The operators with the most self CPU time in one ``generate()`` run, with their share of it."""
    prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_len)).tolist()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        generate(model, prompts, gen_len, temperature=0.0)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]
    return [{"op": e.key, "calls": e.count, "self_cpu_share": e.self_cpu_time_total / total} for e in top]


class _OpCounter(TorchDispatchMode):
    """Counts the ATen operators dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Callable[..., object], types: object, args: tuple = (), kwargs: dict | None = None) -> object:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def ops_per_token(model: torch.nn.Module, hf: torch.nn.Module, prompt_len: int) -> dict[str, int]:
    """ATen operators per decoded token on each side: those of a batch-1 run of 3 new tokens minus those of 2
    (prefill and set-up cancel)."""
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len))
    sides = {"blockloop": lambda n: generate(model, ids.tolist(), n, temperature=0.0), "hf": lambda n: hf_generate(hf, ids, n)}
    counts = {}
    for name, run in sides.items():
        totals = []
        for n in (2, 3):
            with _OpCounter() as counter:
                run(n)
            totals.append(counter.ops)
        counts[name] = totals[1] - totals[0]
    return counts


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=positive_ints, default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=positive_int, default=64)
    parser.add_argument("--gen-len", type=positive_int, default=64)
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per side and batch (after one warm-up)")
    add_threads(parser)
    parser.add_argument("--profile", action="store_true", help="also profile one blockloop run per batch size")
    parser.add_argument("--count-ops", action="store_true", help="also count each side's ATen operators per decoded token")
    add_output_arguments(parser)
    args = parser.parse_args()
    set_threads(args.threads)
    out = output_dir(args)

    model = import_smollm2()
    hf = to_hf_generator(model)
    rows = []
    for batch in args.batch_sizes:
        row = {"batch": batch, **compare(model, hf, batch, args.prompt_len, args.gen_len, args.repeats, seed=batch)}
        if args.profile:
            row["blockloop_profile"] = profile_top(model, batch, args.prompt_len, args.gen_len)
        rows.append(row)
        print(f"batch {batch}: blockloop {row['blockloop_tok_s']:.1f} tok/s, HF generate() {row['hf_generate_tok_s']:.1f} "
              f"tok/s, ratio {row['ratio_vs_hf']:.2f}x, rows with HF's greedy tokens {row['rows_equal_to_hf']}", flush=True)
    result = {"model": SMOLLM2_GGUF, "prompt_len": args.prompt_len, "gen_len": args.gen_len, "repeats": args.repeats,
              "rows": rows, **environment("cpu")}
    if args.count_ops:
        result["aten_ops_per_token"] = ops_per_token(model, hf, args.prompt_len)
        print(f"ATen operators per decoded token (batch 1): {result['aten_ops_per_token']}", flush=True)
    (out / "cpu_decode_vs_hf.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(environment_line(result))


if __name__ == "__main__":
    run_script(main)
