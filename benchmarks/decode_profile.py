"""Where a decode step's time goes: the first GPU run (``results/gpu-2026-11-27-nvidia-h200.md``) decoded pythia-85m
at 12% of its memory roofline, 23 ms per step at batch 256 where reading every cache slot takes 4.8 ms, unprofiled.

Three parts, one device call (about two minutes on an H100/H200), the record written after each:

1. **Attention alone** at the decode shapes of ``--preset`` (one query per row and head over a static cache of
   ``--context`` slots, each row holding a random live length between half and all of them): SDPA with no mask (the
   flash kernel, reading every slot: what a kernel that ignores the mask could do), SDPA through the dense
   ``(B, 1, 1, S)`` boolean mask the static decode step uses, FlexAttention through a block mask of the rows'
   lengths (reads live blocks only; built once, its build time reported apart), and the eager reference; each eager
   and compiled, timed with CUDA events, as ms and GB/s of the keys and values it had to read (live and all slots).
2. **The engine's compiled decode step** (``--step-batch`` rows of ``--prompt-len`` prompts, as the throughput
   protocol runs it) under ``torch.profiler``, over the static cache and over a paged one (the read that can reach
   the live-bytes roofline: the static step reads every slot): wall time per step against device-busy time per
   step (a step that takes much longer than its kernels waits on the host), the kernels that take the device's time
   and the operators that take the host's. Then the same for ``--block-preset``'s step (the suite's decode-heavy
   block row: 1.11 ms per step on the H200 against a 0.13 ms roofline, unprofiled there).
3. **Grouped-query attention under the mask**: part 1's shapes with a third as many key/value heads (SmolLM2's
   grouping; ``--grouped-kv-heads``), SDPA's own ``enable_gqa`` against blockloop's path, which on a GPU folds each
   key/value head's query heads into query rows, since SDPA's GPU kernels take no mask with grouped K/V.
4. **Reading live keys only**, at part 1's shapes: what could replace FlexAttention's paged read, which the H200 run of
   2026-11-28 found at about half the bandwidth of cuDNN's SDPA kernel (``results/gpu-2026-11-28-nvidia-h200.md``).
   FlashAttention's variable-length path (``torch.nn.attention.varlen.varlen_attn``) over a token-major static cache
   with each row's used-key count (``seqused_k``), and over a page pool through a page table (``block_table``);
   FlexAttention over :class:`~blockloop.nn.paged_cache.KVPages` (the engine's paged read) at several page sizes,
   and blockloop's own Triton kernel (:mod:`blockloop.nn.paged_decode`) over the same pool and table at a few key
   tiles (on CPU its rows say it needs CUDA, unless Triton's interpreter runs them). A path this torch lacks
   (``varlen_attn``'s paged arguments are newer than some releases) is a row saying so.

Every timed path on CUDA also names the kernel that took most of its device time (one profiled call), so a row that
is fast or slow says which kernel SDPA chose.

    .venv/bin/python benchmarks/decode_profile.py --record     # on one H100/H200 (through the device kit: --out-dir "$OUT")

``--smoke`` runs every part at tiny sizes on CPU in seconds, which checks the script, not the engine
(``TRITON_INTERPRET=1`` runs the Triton kernel's rows in Triton's interpreter).

Writes ``decode_profile-<device>.md`` and ``.json`` to runs/bench/ (``--out-dir DIR`` elsewhere, ``--record`` into
benchmarks/results/).
"""

from __future__ import annotations

import json
import re
import statistics
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from blockloop.bench.records import (
    add_output_arguments,
    environment,
    environment_line,
    output_dir,
    run_script,
)
from blockloop.bench.suite import bench_dtype
from blockloop.bench.throughput import full_batch_paging
from blockloop.bench.timing import timed
from blockloop.cli import Parser
from blockloop.cli.common import device as device_name
from blockloop.cli.common import nonnegative_int, positive_int, positive_ints
from blockloop.device import resolve_device
from blockloop.errors import BlockloopError
from blockloop.families import build_model, from_name
from blockloop.nn.attention import attention
from blockloop.nn.masks import cache_mask
from blockloop.nn.paged_cache import KVPages
from blockloop.serve.engine import Engine
from blockloop.serve.requests import SamplingParams
from blockloop.serve.runners import runner_for


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median of ``repeats`` timed calls after three untimed ones (compilation, autotuning, caches)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        with timed(device) as t:
            fn()
        times.append(t.seconds)
    return statistics.median(times)


def top_kernel(fn: Callable[[], object], device: torch.device) -> str | None:
    """The device kernel that takes most of one call's time (CUDA only): which kernel a path ran, read off the
    profiler rather than inferred from SDPA's selection rules."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return max(kernels, key=lambda e: e.self_device_time_total).key[:90] if kernels else None


def timed_row(name: str, compiled: bool, run: Callable[[], Tensor], reference: Tensor | None, device: torch.device,
              repeats: int, live_bytes: int, all_bytes: int) -> dict[str, Any]:
    """One path's row: median time, GB/s of live and of all slots, error against the float64 reference, top
    kernel; a path this torch or device lacks is a row saying why, not the end of the call."""
    try:
        seconds = median_seconds(run, device, repeats)
        out = run()
        error = None if reference is None else float((out.double() - reference).abs().max())
        kernel = top_kernel(run, device)
    except Exception as exc:  # noqa: BLE001
        return {"path": name, "compiled": compiled, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
    return {"path": name, "compiled": compiled, "ms": 1e3 * seconds, "live_gb_s": live_bytes / seconds / 1e9,
            "all_slots_gb_s": all_bytes / seconds / 1e9, "max_abs_error_vs_float64": error, "kernel": kernel}


@dataclass
class DecodeCase:
    """One decode step's attention inputs: a query per row and head over ``context`` cached slots, each row holding
    a random live length between half and all of them; the same for a given seed in every part."""

    q: Tensor
    k: Tensor
    v: Tensor
    lengths: Tensor
    key_valid: Tensor
    mask: Tensor  # the static decode step's (B, 1, 1, S) mask
    reference: Tensor  # float64, eager
    live_bytes: int  # K and V bytes of the live slots, and of every slot
    all_bytes: int


def decode_case(model: torch.nn.Module, batch: int, context: int, kv_heads: int, device: torch.device,
                dtype: torch.dtype) -> DecodeCase:
    c = model.config
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, c.n_head, 1, c.head_dim, generator=generator).to(device, dtype)
    k, v = (torch.randn(batch, kv_heads, context, c.head_dim, generator=generator).to(device, dtype) for _ in range(2))
    lengths = torch.randint(context // 2, context + 1, (batch,), generator=generator).to(device)
    key_valid = torch.arange(context, device=device)[None] < lengths[:, None]
    mask = cache_mask(key_valid, (lengths - 1)[:, None])
    per_key = 2 * kv_heads * c.head_dim * torch.finfo(dtype).bits // 8  # K and V bytes of one cached token
    reference = attention(q.double(), k.double(), v.double(), mask=mask, backend="eager")
    return DecodeCase(q, k, v, lengths, key_valid, mask, reference, per_key * int(lengths.sum()),
                      per_key * batch * context)


def attention_rows(model: torch.nn.Module, batch: int, context: int, device: torch.device, dtype: torch.dtype,
                   repeats: int, kv_heads: int, *, grouping_only: bool = False) -> list[dict[str, Any]]:
    """Part 1: each attention path at one decode step's shapes, with ``kv_heads`` key/value heads. Grouped (fewer
    than the query heads), SDPA's own ``enable_gqa`` under the mask is timed beside blockloop's fold of query heads
    into rows (written on the reading that SDPA's GPU kernels take no mask with grouped K/V; on the H200 with torch
    2.11 SDPA's own was faster at these shapes, and the top-kernel column says which kernel it ran).
    ``grouping_only``: just those two."""
    from torch.nn.attention.flex_attention import create_block_mask

    case = decode_case(model, batch, context, kv_heads, device, dtype)
    q, k, v, lengths, mask, reference = case.q, case.k, case.v, case.lengths, case.mask, case.reference
    live_bytes, all_bytes = case.live_bytes, case.all_bytes

    variants: dict[str, Callable[..., Tensor]] = {
        "sdpa, dense (B,1,1,S) mask (the static decode step)": lambda: attention(q, k, v, mask=mask, backend="sdpa"),
    }
    if kv_heads < model.config.n_head:
        variants["sdpa, dense mask, SDPA's own enable_gqa (what blockloop replaces on a GPU)"] = (
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
    build: list[dict[str, Any]] = []  # the block mask's build time, under the table
    if not grouping_only:
        def live(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return kv_idx < lengths[b]

        for _ in range(2):  # the second build is timed: the first pays for tracing the mask function
            with timed(device) as took:
                block_mask = create_block_mask(live, batch, None, 1, context, device=str(device))
        build.append({"path": "flex block mask build (once per step if rebuilt)", "ms": 1e3 * took.seconds})
        variants = {
            "sdpa, no mask (reads every slot)": lambda: attention(q, k, v, backend="sdpa"),
            **variants,
            "flex, block mask of the rows' lengths": lambda: attention(q, k, v, block_mask=block_mask, backend="flex"),
            "eager, dense mask": lambda: attention(q, k, v, mask=mask, backend="eager"),
        }
    rows = []
    for name, fn in variants.items():
        for compiled in (False, True):
            if name.startswith("flex") and compiled != (device.type == "cuda"):
                continue  # compiled on CUDA by blockloop already; on CPU inductor cannot return its log-sum-exp
            run = torch.compile(fn) if compiled else fn
            rows.append(timed_row(name, compiled, run, None if name.startswith("sdpa, no mask") else reference,
                                  device, repeats, live_bytes, all_bytes))
        torch._dynamo.reset()
    return rows + build


def live_read_rows(model: torch.nn.Module, batch: int, context: int, device: torch.device, dtype: torch.dtype,
                   repeats: int, page_sizes: list[int]) -> list[dict[str, Any]]:
    """Part 4: part 1's decode step (same seed, so the same lengths and values) through reads of live keys only."""
    c = model.config
    heads = c.n_kv_head
    case = decode_case(model, batch, context, heads, device, dtype)
    q, k, v, lengths, key_valid, reference = case.q, case.k, case.v, case.lengths, case.key_valid, case.reference
    live_bytes, all_bytes = case.live_bytes, case.all_bytes
    generator = torch.Generator().manual_seed(1)  # the page order
    rows: list[dict[str, Any]] = []

    def row(name: str, compiled: bool, run: Callable[[], Tensor]) -> None:
        rows.append(timed_row(name, compiled, run, reference, device, repeats, live_bytes, all_bytes))

    # FlashAttention's variable-length layout: tokens first, (rows x slots, heads, dim); one query per row.
    tokens_k, tokens_v = (t.transpose(1, 2).reshape(batch * context, heads, c.head_dim) for t in (k, v))
    q_rows = q.transpose(1, 2).reshape(batch, c.n_head, c.head_dim)
    cu_q = torch.arange(batch + 1, device=device, dtype=torch.int32)
    used = lengths.to(torch.int32)
    grouped = {"enable_gqa": True} if c.n_head != heads else {}  # passed only when needed: older releases lack it

    def varlen_attn(*args: Any, **kwargs: Any) -> Tensor:
        from torch.nn.attention.varlen import varlen_attn  # absent from older releases: that row says so

        return varlen_attn(*args, **kwargs, **grouped)[:, :, None]

    def varlen_static() -> Tensor:
        return varlen_attn(q_rows, tokens_k, tokens_v, cu_q, cu_q * context, 1, context, seqused_k=used)

    row("flash varlen over the static cache (seqused_k), token-major", False, varlen_static)
    for size in page_sizes:
        if context % size:
            continue
        n_pages = batch * context // size
        order = torch.randperm(n_pages, generator=generator).to(device)  # pages scattered over the pool, as in use
        table = order.view(batch, context // size).to(torch.int32)
        pool_k, pool_v = (torch.empty(n_pages, size, heads, c.head_dim, device=device, dtype=dtype) for _ in range(2))
        pool_k[order], pool_v[order] = (t.view(n_pages, size, heads, c.head_dim) for t in (tokens_k, tokens_v))

        def varlen_pages(pool_k: Tensor = pool_k, pool_v: Tensor = pool_v, table: Tensor = table) -> Tensor:
            return varlen_attn(q_rows, pool_k, pool_v, cu_q, None, 1, context, seqused_k=used, block_table=table)

        row(f"flash varlen over {size}-token pages (block_table)", False, varlen_pages)
    for size in page_sizes:
        if context % size:
            continue
        pages = KVPages(batch, context, 1 + batch * context // size, size, device=device, read="pages")
        held = lengths.tolist()  # once: a device tensor read per (page, row) would sync that many times
        for start in range(0, context, size):  # one page per row in turn: each row's pages interleave in the pool
            for b in range(batch):
                if start < held[b]:
                    pages.reserve(b, start + size)
        slots = torch.arange(context, device=device)
        where = pages.positions(slots)  # (batch, context) pool positions
        pool_k, pool_v = (torch.zeros(1, heads, pages.n_pages * size, c.head_dim, device=device, dtype=dtype)
                          for _ in range(2))
        for pool, t in ((pool_k, k), (pool_v, v)):
            live = key_valid.flatten()
            pool[0, :, where.flatten()[live]] = t.transpose(0, 1).reshape(heads, batch * context, c.head_dim)[:, live]
        block_mask = pages.pool_mask(key_valid, (lengths - 1)[:, None])

        def flex_pages(pool_k: Tensor = pool_k, pool_v: Tensor = pool_v, block_mask: Any = block_mask) -> Tensor:
            return attention(q, pool_k, pool_v, mask=block_mask)

        row(f"flex over {size}-token pages (KVPages, the engine's paged read)", device.type == "cuda", flex_pages)
        torch._dynamo.reset()
        for tile in (32, 64, 128) if device.type == "cuda" else (64,):
            def triton_pages(pool_k: Tensor = pool_k, pool_v: Tensor = pool_v, table: Tensor = pages.table,
                             reserved: Tensor = pages.reserved, tile: int = tile) -> Tensor:
                # needs triton: without it, this row says so
                from blockloop.nn.paged_decode import paged_decode_attention

                return paged_decode_attention(q, pool_k, pool_v, table, reserved, lengths - 1, key_valid, page_size=size,
                                              tile=tile)

            row(f"triton over {size}-token pages, {tile}-key tiles (blockloop.nn.paged_decode)", False, triton_pages)
    return rows


def step_profile(model: torch.nn.Module, batch: int, prompt_len: int, steps: int, device: torch.device, *,
                 paged: bool) -> dict[str, Any]:
    """Part 2: ``steps`` decode steps of the compiled engine under the profiler, after a compiling warm-up; ``paged``:
    over a paged cache holding the whole batch (as the suite's paged rows run it), else the static one. Two tables:
    the device's time by kernel, and the host's by operator (a step whose wall time is well above its device-busy
    time waits on the host, which the second table shows)."""
    from torch.profiler import ProfilerActivity, profile

    warmup, window = 32, 16
    tokens = warmup + 2 * window + 2 * steps  # every row decodes through the warm-up, the timing and the profile
    max_len = prompt_len + tokens
    runner = runner_for(model, paging=full_batch_paging(model, batch, max_len) if paged else None)
    engine = Engine(runner, batch, max_len=max_len, sync_every=window, compile=True)
    greedy = SamplingParams(temperature=0.0)
    # every key length the rows will reach, for greedy rows: nothing compiled inside the profile
    engine.compile_steps(rows=[batch], shortest=prompt_len, sampling=greedy)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=generator).tolist()
    for p in prompts:
        engine.submit(p, tokens, sampling=greedy)
    while engine.steps < warmup:  # prefill, then windows that warm the captured steps
        engine.step()
    with timed(device) as wall:
        done = engine.steps
        engine.step(max_steps=steps)
        timed_steps = engine.steps - done
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        done = engine.steps
        engine.step(max_steps=steps)
        profiled_steps = engine.steps - done
    if device.type == "cuda":
        torch.cuda.synchronize()
    events = prof.key_averages()
    if device.type == "cuda":  # the kernels' own rows (an operator's row repeats the time of the kernels it launched)
        sort = "self_device_time_total"
        busy_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    else:
        sort = "self_cpu_time_total"
        busy_us = sum(e.self_cpu_time_total for e in events)
    table = events.table(sort_by=sort, row_limit=20, max_name_column_width=70)
    host_table = events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70)
    return {"steps": timed_steps, "wall_ms_per_step": 1e3 * wall.seconds / timed_steps,
            "busy_ms_per_step": busy_us / 1e3 / profiled_steps, "busy_is": sort, "table": table,
            "host_ms_per_step": sum(e.self_cpu_time_total for e in events) / 1e3 / profiled_steps,
            "host_table": host_table}


def profile_or_error(model: torch.nn.Module, preset: str, batch: int, prompt_len: int, steps: int,
                     device: torch.device, *, paged: bool) -> dict[str, Any]:
    """One model's and cache's step profile; a failure is recorded rather than allowed to cost the others' (one
    device call)."""
    setting = {"preset": preset, "cache": "paged" if paged else "static", "batch": batch, "prompt_len": prompt_len}
    try:
        return {**setting, **step_profile(model, batch, prompt_len, steps, device, paged=paged)}
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        return {**setting, "error": f"{type(exc).__name__}: {exc}"}


def attention_table(a: dict[str, Any], title: str = "Attention alone") -> list[str]:
    lines = ["", f"## {title}: batch {a['batch']}, {a['context']} cache slots, live lengths in [{a['context'] // 2}, "
                 f"{a['context']}], {a['kv_heads']} key/value head{'s' * (a['kv_heads'] != 1)}", "",
             "| path | compiled | ms | GB/s of live K/V | GB/s of every slot | max abs error vs float64 | top kernel |",
             "|---|---|---:|---:|---:|---:|---|"]
    for row in a["rows"]:
        if "error" in row:
            lines.append(f"| {row['path']} | {row['compiled']} | failed: {row['error']} | | | | |")
        elif "live_gb_s" not in row:
            lines.append(f"| {row['path']} | | {row['ms']:.3f} | | | | |")
        else:
            err = "-" if row["max_abs_error_vs_float64"] is None else f"{row['max_abs_error_vs_float64']:.1e}"
            kernel = f"`{row['kernel']}`" if row.get("kernel") else "-"
            lines.append(f"| {row['path']} | {row['compiled']} | {row['ms']:.3f} | {row['live_gb_s']:.0f} | "
                         f"{row['all_slots_gb_s']:.0f} | {err} | {kernel} |")
    return lines


def write(out: Path, record: dict[str, Any]) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", record["device"].lower().split(" (")[0]).strip("-") + ("-smoke" if record["smoke"] else "")
    stem = f"decode_profile-{slug}"
    (out / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [f"# Decode profile: `{record['preset']}`{' (smoke: tiny sizes, not a measurement)' if record['smoke'] else ''}",
             "", f"- {environment_line(record)}"]
    for a in record["attention"]:
        lines += attention_table(a)
    if record.get("live_reads"):
        lines += attention_table(record["live_reads"], "Reading live keys only (part 4)")
    for s in record["steps"]:
        lines += ["", f"## The engine's compiled decode step, `{s['preset']}`, {s['cache']} cache: batch {s['batch']}, "
                      f"prompt {s['prompt_len']}", ""]
        if "error" in s:
            lines += [f"failed: {s['error']}"]
            continue
        lines += [f"{s['wall_ms_per_step']:.3f} ms per step wall time ({s['steps']} steps), {s['busy_ms_per_step']:.3f} ms "
                  f"of it busy ({s['busy_is']}, profiled separately); the host's operators "
                  f"{s['host_ms_per_step']:.3f} ms per step (self CPU time, under the profiler)", "",
                  "```", s["table"], "```", "", "The host's time by operator:", "", "```", s["host_table"], "```"]
    lines.append("")
    (out / f"{stem}.md").write_text("\n".join(lines))
    return out / f"{stem}.md"


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (seconds): checks the script runs")
    parser.add_argument("--preset", default="pythia-85m", help="model whose decode shapes are timed (default: pythia-85m)")
    parser.add_argument("--batch", type=positive_int, default=256, help="rows of part 1 (default: 256, the suite's decode batch)")
    parser.add_argument("--context", type=positive_int, default=2048, help="cache slots per row in part 1 (default: 2048)")
    parser.add_argument("--step-batch", type=positive_int, default=64, help="rows of the profiled engine (default: 64)")
    parser.add_argument("--prompt-len", type=positive_int, default=1024, help="prompt of each profiled row (default: 1024)")
    parser.add_argument("--steps", type=positive_int, default=32, help="profiled decode steps (default: 32)")
    parser.add_argument("--block-preset", default="block-85m",
                        help="a Block Transformer whose compiled step part 2 profiles too (default: block-85m, the "
                             "suite's; '' for none)")
    parser.add_argument("--block-batch", type=positive_int, default=256,
                        help="its rows (default: 256, the suite's decode-heavy batch)")
    parser.add_argument("--block-prompt-len", type=positive_int, default=128,
                        help="its prompts (default: 128, the suite's decode-heavy prompt)")
    parser.add_argument("--repeats", type=positive_int, default=50, help="timed calls per attention path (default: 50)")
    parser.add_argument("--grouped-kv-heads", type=nonnegative_int, default=None,
                        help="part 1 again with this many key/value heads (default: a third of the query heads, "
                             "SmolLM2's grouping, where that divides them; 0: not again)")
    parser.add_argument("--page-sizes", type=positive_ints, default=[16, 64, 128, 256],
                        help="page sizes of part 4's paged reads (default: 16,64,128,256)")
    parser.add_argument("--device", type=device_name, default="auto", help="auto (CUDA if present), cuda, cpu")
    add_output_arguments(parser)
    args = parser.parse_args()
    if args.smoke:
        args.preset, args.batch, args.context, args.step_batch, args.prompt_len, args.steps, args.repeats = (
            "tiny", 2, 64, 2, 16, 4, 3)
        args.block_preset = args.block_preset and "tiny-block"
        args.block_batch, args.block_prompt_len = 2, 16
        args.grouped_kv_heads = 1 if args.grouped_kv_heads is None else args.grouped_kv_heads
        args.page_sizes = [16, 32]
    device = torch.device("cpu" if args.smoke else resolve_device(args.device))
    dtype = bench_dtype("auto", str(device))
    torch.manual_seed(0)
    config = from_name(args.preset)
    grouped = args.grouped_kv_heads
    if grouped is None:
        grouped = config.n_head // 3 if config.n_head % 3 == 0 else 0
    elif grouped and config.n_head % grouped:
        raise BlockloopError(f"--grouped-kv-heads {grouped} does not divide {args.preset}'s {config.n_head} query heads")
    model = build_model(config).to(device=device, dtype=dtype).eval()
    record = {**environment(str(device), dtype), "smoke": args.smoke, "preset": args.preset, "attention": [],
              "steps": []}

    def attention_section(kv_heads: int) -> dict[str, Any]:
        return {"batch": args.batch, "context": args.context, "kv_heads": kv_heads,
                "rows": attention_rows(model, args.batch, args.context, device, dtype, args.repeats, kv_heads,
                                       grouping_only=kv_heads != config.n_kv_head)}

    # Written after each part, the live-key reads second (the most wanted since the 2026-11-28 run) and the
    # grouped-query comparison last: a call stopped at its time cap keeps what it ran.
    out = output_dir(args)
    with torch.no_grad():
        record["attention"].append(attention_section(config.n_kv_head))
        write(out, record)
        record["live_reads"] = {"batch": args.batch, "context": args.context, "kv_heads": config.n_kv_head,
                                "rows": live_read_rows(model, args.batch, args.context, device, dtype, args.repeats,
                                                       args.page_sizes)}
        write(out, record)
        for paged in (False, True):  # each written as it ends: a stop in the paged one keeps the static one
            record["steps"].append(profile_or_error(model, args.preset, args.step_batch, args.prompt_len, args.steps,
                                                    device, paged=paged))
            path = write(out, record)
        if args.block_preset:  # the H200's block step took 1.11 ms against a 0.13 ms roofline (2026-11-28), unprofiled
            block = build_model(from_name(args.block_preset)).to(device=device, dtype=dtype).eval()
            record["steps"].append(profile_or_error(block, args.block_preset, args.block_batch, args.block_prompt_len,
                                                    args.steps, device, paged=False))
            path = write(out, record)
        if grouped and grouped != config.n_kv_head:
            record["attention"].append(attention_section(grouped))
            path = write(out, record)
    print(path.read_text())


if __name__ == "__main__":
    run_script(main)
