"""Train time per batch of the staircase family vs the plain transformer with the same core (Table 2 style).

Every model shares one core shape (the demo's: 4 Llama-style layers, d=128), so all but the Universal
Transformer (one layer of it) have the same parameters; what differs is how often the core runs per token.
One timed step = forward + backward + AdamW step on a batch of random byte tokens; the plain decoder is
timed in the same run and every ratio is against it. On CPU (one thread by default) or a GPU (``--device cuda``)
at this size, the paper's absolute times (V100, 117M models) are not comparable, only the ordering and the ratios.

    .venv/bin/python benchmarks/staircase_speed.py --record

Writes ``staircase_speed_<device>.{json,md}`` to runs/bench/ (``--out-dir DIR`` elsewhere, ``--record`` into
benchmarks/results/).
"""

from __future__ import annotations

import json
import statistics

import torch

from blockloop.bench.records import (
    add_output_arguments,
    environment,
    environment_line,
    output_dir,
    run_script,
)
from blockloop.bench.timing import timed
from blockloop.cli import Parser
from blockloop.cli.common import add_threads, positive_int, set_threads
from blockloop.cli.common import device as device_name
from blockloop.device import resolve_device
from blockloop.families import build_model, from_name, spec_of

CORE = {"n_layer": 4, "d_model": 128, "n_head": 4, "n_kv_head": 4, "context_length": 256}


def models(seq_len: int) -> list[tuple[str, str, dict]]:
    """(label, preset, overrides): the Table 2 rows at CPU size, all on the same core."""
    return [
        ("Transformer (plain core)", "tiny", CORE),
        ("Transformer-XL (memory = segment)", "tiny-transformer-xl", {**CORE, "memory_len": seq_len}),
        ("Feedback Transformer (C=1)", "tiny-feedback", {**CORE, "step_size": 64}),
        ("Cached Staircase m=1, S=96, C=32", "tiny-cached-staircase", {**CORE, "chunk_size": 32, "step_size": 96, "cache_after": 1}),
        ("Staircase 2 steps, S=64, C=32", "tiny-staircase", {**CORE, "chunk_size": 32, "step_size": 64}),
        ("Ladder 2 steps", "tiny-ladder", {**CORE, "n_steps": 2}),
        ("Universal Transformer 2 steps (1 layer)", "tiny-universal", {**CORE, "n_layer": 1, "n_steps": 2}),
        ("Staircase 4 steps, S=64, C=16", "tiny-staircase", {**CORE, "chunk_size": 16, "step_size": 64}),
        ("Ladder 4 steps", "tiny-ladder", {**CORE, "n_steps": 4}),
        ("Universal Transformer 4 steps (1 layer)", "tiny-universal", {**CORE, "n_layer": 1, "n_steps": 4}),
        ("Global Cached Staircase m=1, C=32", "tiny-global-staircase", {**CORE, "chunk_size": 32, "step_size": 32}),
    ]


def time_train_step(preset: str, overrides: dict, batch: int, seq_len: int, repeats: int,
                    device: torch.device) -> tuple[int, float]:
    torch.manual_seed(0)
    model = build_model(from_name(preset, **overrides)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 258, (batch, seq_len), device=device)
    recurrent = spec_of(model.config).recurrent(model.config)
    times, state = [], None
    for i in range(repeats + 1):  # the first is a warm-up
        with timed(device) as step:
            if recurrent:  # as in truncated-BPTT training: the previous segment's state comes in
                _, loss, state = model(idx, idx, state=state, return_state=True)
                state = state.detach()
            else:
                _, loss = model(idx, idx)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if i:
            times.append(step.seconds)
    return model.num_parameters(), statistics.median(times)


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--seq-len", type=positive_int, default=128)
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed steps per model (median reported)")
    add_threads(parser, default=1)
    parser.add_argument("--device", type=device_name, default="cpu", help="cpu, cuda or auto (default: cpu); the files are named after it")
    add_output_arguments(parser)
    args = parser.parse_args()
    device = torch.device(resolve_device(args.device))
    out = output_dir(args)
    set_threads(args.threads)
    rows = []
    for label, preset, overrides in models(args.seq_len):
        params, seconds = time_train_step(preset, overrides, args.batch_size, args.seq_len, args.repeats, device)
        rows.append((label, params, seconds))
        print(f"{label}: {params:,} parameters, {seconds * 1e3:.0f} ms per batch", flush=True)
    base = rows[0][2]
    env = environment(device.type)
    lines = [
        f"# Staircase family: train time per batch vs the plain transformer ({device.type.upper()})",
        "",
        f"- {environment_line(env)}",
        (f"- one step = forward + backward + AdamW on {args.batch_size} x {args.seq_len} random byte tokens; median of "
         f"{args.repeats} after a warm-up; core: {CORE['n_layer']} layers, d={CORE['d_model']} (Llama style); recurrent "
         "models get the previous step's state (truncated BPTT), so caches and memories are full"),
        ("- CPU numbers: the ratios show the cost of recurrence, not GPU parallelism (the Feedback Transformer's "
         "token-by-token loop costs far more on a GPU)") if device.type == "cpu" else
        "- GPU numbers at CPU-benchmark size: small kernels, so launch overhead weighs more than in the paper",
        "",
        "| model | parameters | train ms / batch | vs plain |",
        "|---|---|---|---|",
    ]
    lines += [f"| {label} | {params:,} | {s * 1e3:.0f} | {s / base:.2f}x |" for label, params, s in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    settings = {k: v for k, v in vars(args).items() if k not in ("out_dir", "record")}
    record = {**env, "settings": settings, "core": CORE,
              "rows": [{"model": label, "parameters": params, "train_s_per_batch": s, "vs_plain": s / base}
                       for label, params, s in rows]}
    (out / f"staircase_speed_{device.type}.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / f"staircase_speed_{device.type}.md").write_text(text)


if __name__ == "__main__":
    run_script(main)
