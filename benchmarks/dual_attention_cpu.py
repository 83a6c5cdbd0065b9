"""The double decoder's training attention on CPU: two attentions merged by log-sum-exp vs one call (issue 12, item 3).

Both compute the paper's joint softmax of every query over its within-block keys and the cross-block keys of
earlier blocks (section 3.1) under one random partition, forward + backward, through ``blockloop.nn.attention``'s
default CPU backends: the merge needs each half's log-sum-exp (the eager backend; SDPA does not expose it), the
one call concatenates the cross and self K/V and takes one mask (SDPA). The two are timed alternately in the same
run; the ratio is what counts. The same script checks they agree (float64) before timing. It also times building
the one call's FlexAttention ``BlockMask`` from the partition on the tile grid (``nn.masks.dual_block_mask``)
against FlexAttention's eager ``create_block_mask`` over the same ``mask_mod``, and checks they are equal.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dual_attention_cpu.py --record

Writes dual_attention_cpu.{json,md} to runs/bench/ (``--out-dir DIR`` elsewhere, ``--record`` into
benchmarks/results/).
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from blockloop.bench.records import (
    add_output_arguments,
    environment,
    environment_line,
    output_dir,
    run_script,
)
from blockloop.cli import Parser
from blockloop.cli.common import positive_int
from blockloop.nn.attention import attention, merge_attention
from blockloop.nn.masks import block_masks, dual_block_mask, dual_mask_mod


def merged(q, ks, vs, kc, vc, within, cross):
    out, _ = merge_attention(*attention(q, ks, vs, mask=within, return_lse=True),
                             *attention(q, kc, vc, mask=cross, return_lse=True))
    return out


def single(q, ks, vs, kc, vc, block_mask, _):
    """As the model's training forward: the BlockMask built once per batch, its mask_mod evaluated by the call."""
    return attention(q, torch.cat((kc, ks), 2), torch.cat((vc, vs), 2), block_mask=block_mask)


def time_once(fn, tensors, masks) -> float:
    for t in tensors:
        t.grad = None
    start = time.perf_counter()
    fn(*tensors, *masks).square().sum().backward()
    return time.perf_counter() - start


def mask_build_ms(length: int, boundaries: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median ms to build the one call's BlockMask directly and with create_block_mask (alternating); equal masks."""
    from torch.nn.attention.flex_attention import create_block_mask

    def eager():
        return create_block_mask(dual_mask_mod(boundaries, length), 1, 1, length, 2 * length, device="cpu")

    assert torch.equal(dual_block_mask(boundaries, length).to_dense(), eager().to_dense())
    times: dict[str, list[float]] = {"direct": [], "create_block_mask": []}
    for _ in range(repeats):
        for name, build in (("direct", lambda: dual_block_mask(boundaries, length)), ("create_block_mask", eager)):
            start = time.perf_counter()
            build()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = Parser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=positive_int, default=4)
    parser.add_argument("--heads", type=positive_int, default=4)
    parser.add_argument("--head-dim", type=positive_int, default=64)
    parser.add_argument("--lengths", type=positive_int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--repeats", type=positive_int, default=7)
    add_output_arguments(parser)
    args = parser.parse_args()
    out = output_dir(args)
    g = torch.Generator().manual_seed(0)
    rows = []
    for length in args.lengths:
        boundaries = torch.linspace(0, length, 5).long()  # four equal blocks
        within, cross = block_masks(boundaries, length)
        shape = (args.batch, args.heads, length, args.head_dim)
        check = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(5)]
        block_mask = dual_block_mask(boundaries, length)
        error = (merged(*check, within, cross) - single(*check, block_mask, None)).abs().max().item()
        tensors = [torch.randn(shape, generator=g).requires_grad_() for _ in range(5)]
        times = {"lse_merge": [], "single_call": []}
        time_once(merged, tensors, (within, cross))  # warm-up
        time_once(single, tensors, (block_mask, None))
        for _ in range(args.repeats):
            times["lse_merge"].append(time_once(merged, tensors, (within, cross)))
            times["single_call"].append(time_once(single, tensors, (block_mask, None)))
        med = {k: statistics.median(v) for k, v in times.items()}
        masks = mask_build_ms(length, boundaries, args.repeats)
        rows.append({"length": length, "blocks": len(boundaries) - 1, "max_abs_diff_float64": error,
                     "lse_merge_ms": 1e3 * med["lse_merge"], "single_call_ms": 1e3 * med["single_call"],
                     "single_over_merge": med["single_call"] / med["lse_merge"],
                     "mask_direct_ms": masks["direct"], "mask_create_block_mask_ms": masks["create_block_mask"],
                     "direct_over_create": masks["direct"] / masks["create_block_mask"]})
        print(rows[-1], flush=True)
    record = {**environment("cpu"), "settings": vars(args) | {"out_dir": str(out)}, "rows": rows}
    (out / "dual_attention_cpu.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        "# Double decoder training attention on CPU: LSE merge vs one call",
        "",
        f"- {environment_line(record)}",
        f"- shapes: batch {args.batch}, {args.heads} heads, head dim {args.head_dim}, float32, forward + backward, "
        f"median of {args.repeats} alternating repeats after a warm-up; four equal blocks",
        "- lse merge: within-block and cross-block attention each with its log-sum-exp (eager backend), merged by "
        "`merge_attention`; one call: cross and self K/V concatenated, one `attention` (SDPA) under the BlockMask "
        "(its mask_mod evaluated densely on CPU), as the model's training forward",
        "- mask: the one call's BlockMask (128-token tiles, T queries x 2T keys) built from the partition on the tile "
        "grid (`dual_block_mask`) vs FlexAttention's eager `create_block_mask` over the same mask_mod (equal masks)",
        "",
        "| T | blocks | float64 max abs diff | LSE merge ms | one call ms | one call / merge "
        "| mask direct ms | create_block_mask ms | direct / create |",
        "|---|---|---|---|---|---|---|---|---|",
        *(f"| {r['length']} | {r['blocks']} | {r['max_abs_diff_float64']:.1e} | {r['lse_merge_ms']:.1f} | "
          f"{r['single_call_ms']:.1f} | {r['single_over_merge']:.2f} | {r['mask_direct_ms']:.2f} | "
          f"{r['mask_create_block_mask_ms']:.2f} | {r['direct_over_create']:.3f} |" for r in rows),
        "",
        "CPU timings: the ratio is the result, not the milliseconds.",
    ]
    (out / "dual_attention_cpu.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    run_script(main)
