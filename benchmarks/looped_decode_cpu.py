"""Depth-wise decode step time on CPU, for comparing how a step reads each row's loop of the looped cache.

Run it once per source tree (``PYTHONPATH=<src>``, named by ``--label``) to compare an older runner with this
one in the same session, alternating; each run appends one JSON line (ms per step, best of ``--repeats``, and
the machine) to ``looped_decode_cpu.jsonl``. ``--read`` picks this tree's looped-cache read ("dense" or
"blocks"); leave it out for a tree that has none. CPU timings are only meaningful as ratios between runs of the
same command on the same machine::

    git archive 830f6e8 src | tar -x -C /tmp/looped_base
    OMP_NUM_THREADS=1 PYTHONPATH=/tmp/looped_base/src .venv/bin/python benchmarks/looped_decode_cpu.py --label gather --record
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/looped_decode_cpu.py --label in-place --read dense --record
"""

from __future__ import annotations

import dataclasses
import time

import torch

from blockloop.bench.records import (
    add_output_arguments,
    append_records,
    environment,
    environment_line,
    output_dir,
    run_script,
)
from blockloop.cli import Parser
from blockloop.cli.common import positive_int
from blockloop.families import build_model, from_name
from blockloop.serve.runners import ExitRule, runner_for
from blockloop.serve.sampling import SlotSampling


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=positive_int, default=512)
    parser.add_argument("--layers", type=positive_int, default=4, help="shared layers")
    parser.add_argument("--loops", type=positive_int, default=2)
    parser.add_argument("--rows", type=positive_int, default=8)
    parser.add_argument("--prompt", type=positive_int, default=480, help="longest prompt; rows are prefilled to different lengths")
    parser.add_argument("--max-len", type=positive_int, default=1024)
    parser.add_argument("--steps", type=positive_int, default=32)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--read", default=None, help="the looped cache's read: dense or blocks")
    parser.add_argument("--label", default="", help="names the source tree in the record")
    add_output_arguments(parser)
    args = parser.parse_args()
    out = output_dir(args)
    torch.manual_seed(0)
    heads = args.d_model // 64
    config = dataclasses.replace(from_name("demo-recursive"), d_model=args.d_model, n_layer=args.layers, loops=args.loops,
                                 n_head=heads, n_kv_head=heads, context_length=args.max_len)
    model = build_model(config).eval()
    runner = runner_for(model, exit_rule=ExitRule("none"), **({"loop_read": args.read} if args.read else {}))
    runner.sampling = SlotSampling.empty(args.rows, torch.device("cpu"))
    runner.allocate(args.rows, args.max_len)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for row in range(args.rows):
            length = args.prompt - 7 * row
            runner.prefill_slot(row, torch.randint(1, config.vocab_size, (length,), generator=generator))
        tokens = torch.randint(1, config.vocab_size, (args.rows,), generator=generator)
        for _ in range(4):  # warm-up
            runner.decode_step(tokens)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            ready = torch.ones(args.rows, dtype=torch.bool)
            for _ in range(args.steps):
                ready = runner.decode_step(torch.where(ready, tokens, -1)).ready
            times.append((time.perf_counter() - start) / args.steps * 1e3)
    record = {"label": args.label, "read": args.read, "d_model": args.d_model, "layers": args.layers, "loops": args.loops,
              "rows": args.rows, "prompt": args.prompt, "max_len": args.max_len, "steps": args.steps,
              "ms_per_step": round(min(times), 3), **environment("cpu")}
    append_records(out / "looped_decode_cpu.jsonl", [record])
    print(f"{args.label or args.read}: {record['ms_per_step']:.2f} ms/step ({args.loops} loops)")
    print(environment_line(record))

if __name__ == "__main__":
    run_script(main)
