"""``blockloop flops``: training FLOPs and KV-cache bytes of a preset (:func:`blockloop.bench.reports.flops_report`)."""

from __future__ import annotations

import argparse

from blockloop.cli.common import positive_int, print_table

HELP = "training FLOPs and KV-cache memory of a preset: the paper's formulas, its config, torch's FLOP counter"
DESCRIPTION = ("Architecture-aware training FLOPs (double-decoder paper, appendix A.2) and generation KV-cache bytes "
               "(appendix A.1) for a preset, with the decoder-only model of the same width and depth for comparison.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", required=True, help="model preset (see `blockloop presets`)")
    p.add_argument("--seq-len", type=positive_int, help="training window / prompt length T (default: the preset's context)")
    p.add_argument("--out-len", type=positive_int, default=256, help="generated tokens T_out for the KV cache (default: 256; with the default --seq-len that is past the "
                   "context, as the paper's appendix A.1 prices it, and the output says so)")
    p.add_argument("--bytes", type=positive_int, default=2, help="bytes per cached value (default: 2, bf16)")
    p.add_argument("--measure", action="store_true", help="also count one forward with torch's FlopCounterMode")


def run(args: argparse.Namespace) -> int:
    from blockloop.bench.reports import flops_report

    report = flops_report(args.preset, seq_len=args.seq_len, out_len=args.out_len, bytes_per_value=args.bytes,
                          measure=args.measure)
    if report.note:
        print(report.note)
    print_table(report.rows)
    print(report.footnote)
    return 0
