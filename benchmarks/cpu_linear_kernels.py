"""Why CPU inference packs its weights: ``F.linear`` (MKL's sgemm for float32) against oneDNN's kernel on the same
weight reordered once (:func:`blockloop.nn.linear.packed_linears`), at SmolLM2-135M's linear shapes.

For each weight shape and number of rows, both kernels multiply the same inputs by ``--copies`` distinct weights
in turn (so the weights stream from memory as in a forward, not from cache), alternating kernel by kernel
within each repeat. Reports microseconds per product, the ratio and the largest difference between the two
products relative to the largest output.

    .venv/bin/python benchmarks/cpu_linear_kernels.py --threads 1 --record

Writes ``cpu_linear_kernels.json`` to runs/bench/ (``--out-dir DIR`` elsewhere, ``--record`` into
benchmarks/results/) and prints a table.
"""

from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F

from blockloop.bench.records import (
    add_output_arguments,
    environment,
    environment_line,
    output_dir,
    run_script,
)
from blockloop.cli import Parser
from blockloop.cli.common import add_threads, positive_int, positive_ints, set_threads

# SmolLM2-135M (d = 576, 9 + 2 x 3 heads of 64, d_ff = 1536, vocab 49152): qkv, attention out, gate / up,
# down, LM head.
SHAPES = {"qkv": (960, 576), "attn_out": (576, 576), "gate_up": (1536, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def per_product_us(multiply, weights: list, x: torch.Tensor, calls: int) -> float:
    """Mean microseconds of ``multiply(x, weight)`` over ``calls`` products, the weights taken in turn."""
    start = time.perf_counter()
    for i in range(calls):
        multiply(x, weights[i % len(weights)])
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=positive_ints, default="1,8,64,512", help="comma-separated numbers of input rows")
    parser.add_argument("--copies", type=positive_int, default=24, help="distinct weights per shape (the LM head: 3)")
    parser.add_argument("--repeats", type=positive_int, default=3)
    add_threads(parser)
    add_output_arguments(parser)
    args = parser.parse_args()
    set_threads(args.threads)
    if not torch.backends.mkldnn.is_available():
        raise SystemExit("this torch has no oneDNN: nothing to compare")
    out = output_dir(args)
    packed_product = torch.ops.mkldnn._linear_pointwise
    rows = []
    for name, (n_out, n_in) in SHAPES.items():
        copies = 3 if name == "lm_head" else args.copies
        dense = [torch.randn(n_out, n_in) / n_in**0.5 for _ in range(copies)]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in dense]
        for n_rows in args.rows:
            x = torch.randn(n_rows, n_in)
            calls = max(2 * copies, min(200, 20_000_000 // (n_out * n_in) * copies // max(1, n_rows // 8)))
            times: dict[str, list[float]] = {"mkl_f_linear": [], "onednn_packed": []}
            per_product_us(F.linear, dense, x, copies)  # warm-up
            per_product_us(lambda x, w: packed_product(x, w, None, "none", [], ""), packed, x, copies)
            for _ in range(args.repeats):
                times["mkl_f_linear"].append(per_product_us(F.linear, dense, x, calls))
                times["onednn_packed"].append(
                    per_product_us(lambda x, w: packed_product(x, w, None, "none", [], ""), packed, x, calls))
            reference = F.linear(x, dense[0])
            difference = (packed_product(x, packed[0], None, "none", [], "") - reference).abs().max() / reference.abs().max()
            row = {"weight": name, "shape": [n_out, n_in], "rows": n_rows,
                   **{k: min(v) for k, v in times.items()},
                   "speedup": min(times["mkl_f_linear"]) / min(times["onednn_packed"]),
                   "max_relative_difference": float(difference)}
            rows.append(row)
            print(f"{name:9s} {n_out:6d}x{n_in:<5d} rows {n_rows:4d}: F.linear {row['mkl_f_linear']:9.1f} us, "
                  f"packed {row['onednn_packed']:9.1f} us, {row['speedup']:.2f}x, rel. diff {difference:.1e}", flush=True)
    result = {"copies": args.copies, "repeats": args.repeats, "rows": rows, **environment("cpu", torch.float32)}
    (out / "cpu_linear_kernels.json").write_text(json.dumps(result, indent=2) + "\n")
    print(environment_line(result))


if __name__ == "__main__":
    run_script(main)
