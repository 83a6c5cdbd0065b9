"""Reports on presets without training them: parameter counts, training FLOPs and generation KV-cache bytes.

The counts come from models built on the ``meta`` device, so nothing is allocated. :func:`flops_report`
gives what ``blockloop flops`` prints: the double-decoder paper's formulas (appendices A.1-A.2) beside the
preset's exact count and, optionally, torch's FLOP counter, with the decoder-only model of the same width
and depth; families the appendix does not cover get their own rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from blockloop.bench.throughput import state_tensors
from blockloop.config import ModelConfig
from blockloop.data.collate import step_generator
from blockloop.errors import BlockloopError
from blockloop.families import PRESETS, build_model, collate_for, from_name, spec_of
from blockloop.serve.runners import runner_for
from blockloop.train import flops


@dataclass(frozen=True)
class PresetSize:
    name: str
    family: str
    shape: str
    non_embedding: int
    total: int
    description: str


def preset_sizes() -> list[PresetSize]:
    """Every named preset with its parameter counts."""
    sizes = []
    for name, preset in PRESETS.items():
        config = from_name(name)
        with torch.device("meta"):  # counts without allocating the weights
            model = build_model(config)
        sizes.append(PresetSize(name, config.family, config.summary(), model.num_parameters(non_embedding=True),
                                model.num_parameters(), preset.description))
    return sizes


@dataclass(frozen=True)
class Report:
    """A table (``rows[0]`` is the header) with a ``note`` to print before it and a ``footnote`` after it."""

    rows: list[tuple[str, ...]]
    footnote: str
    note: str | None = None


def flops_report(
    preset: str, *, seq_len: int | None = None, out_len: int = 256, bytes_per_value: int = 2, measure: bool = False
) -> Report:
    """Training FLOPs per token at window ``seq_len`` (default: the context) and the KV cache of a ``seq_len`` prompt
    plus ``out_len`` generated tokens at ``bytes_per_value``; ``measure`` adds torch's count of one forward.

    Families with the double-decoder paper's closed forms (appendix A) are shown beside them and beside a plain
    decoder of the same width and depth; the others get their own count and the static state their serving
    runner allocates."""
    config = from_name(preset)
    T = seq_len or config.context_length
    if not 2 <= T <= config.context_length:
        raise BlockloopError(f"--seq-len must be in 2..{config.context_length} (the model context), got {T}")
    if out_len < 1 or bytes_per_value < 1:
        raise BlockloopError("--out-len and --bytes must be at least 1")
    spec_of(config).check_seq_len(config, T)
    report = _report(preset, config, T, out_len, bytes_per_value, measure)
    # Priced all the same (the paper's A.1 prices 2048 + 256 on 2048-token models), and said; a recurrent model's
    # slot (a staircase's windows, Transformer-XL's rings) holds any length.
    if T + out_len > config.context_length and not spec_of(config).recurrent(config):
        past = (f" T + T_out = {T + out_len} tokens is more than {preset}'s context of {config.context_length}: the "
                "cache columns price a longer sequence than one of its slots holds; lower --seq-len or --out-len to "
                "price one it serves.")
        report = replace(report, footnote=report.footnote + past)
    return report


def _report(preset: str, config: ModelConfig, T: int, out_len: int, bytes_per_value: int, measure: bool) -> Report:
    spec = spec_of(config)
    if spec.unrolled is None and spec.paper_training_flops is None:
        return _own_count_report(preset, config, T, out_len, bytes_per_value, measure)
    note, family = None, config.family  # a looped model is counted as its unrolled decoder, but named as itself
    if spec.unrolled is not None:
        config, looped = spec.unrolled(config), config
        note = f"{preset}: {looped.summary()}; FLOPs and KV cache are those of its {config.n_layer}-layer looped depth"
    baseline = config.stack(config.n_layer)
    rows = [("model", "paper formula FLOPs/token", "config FLOPs/token", "measured FLOPs/token", f"KV cache T={T}+{out_len}",
             "serving state per slot")]
    for label, c in ((f"{family} ({preset})", config), ("decoder-only, same width/depth", baseline)):
        s = spec_of(c)
        paper = s.paper_training_flops(*s.paper_lengths(c, T)[:1], c.d_model, c.n_layer, *s.paper_lengths(c, T)[1:]) / T
        measured = "-"
        if measure:
            with torch.device("meta"):
                model = build_model(c)
            batch = collate_for(c)(torch.zeros(1, T, dtype=torch.long), torch.zeros(1, T, dtype=torch.long), step_generator(0, 0))
            batch.pop("targets")
            measured = f"{3 * flops.measured_forward_flops(model, {k: v.to('meta') for k, v in batch.items()}) / T:.4g}"
        kv = s.kv_bytes(c, T, out_len, bytes_per_value)
        with torch.device("meta"):  # what the continuous-batching engine allocates for one T + out_len slot
            served = _generation_state_bytes(build_model(c.replace(context_length=max(c.context_length, T + out_len))),
                                             T + out_len, bytes_per_value)
        rows.append((label, f"{paper:.4g}", f"{s.training_flops_per_token(c, T):.4g}", measured, f"{kv / 2**20:.2f} MiB",
                     f"{served / 2**20:.2f} MiB"))
        if type(c) is type(baseline):  # the preset is a plain decoder: it is its own baseline
            break
    footnote = ("paper formula: appendix A.2 (MHA, 4d MLP, no LM head, 2/3-1/3 split); config: this preset's exact "
                "shapes incl. LM head; measured: 3 x one forward under torch FlopCounterMode; KV cache: appendix A.1's "
                "bytes, what lock-step generation holds; serving state: the static caches `serve`'s engine allocates "
                f"per slot.{f' The {family} family: {spec.cost_note}.' if spec.cost_note else ''}")
    return Report(rows, footnote, note)


def _generation_state_bytes(model: torch.nn.Module, max_len: int, bytes_per_value: int) -> int:
    """Floating-point values of the static state the model's serving runner allocates for one slot."""
    runner = runner_for(model)
    runner.allocate(1, max_len)
    values = [t.untyped_storage().nbytes() // t.element_size() for t in state_tensors(runner.state) if t.is_floating_point()]
    return sum(values) * bytes_per_value


def _own_count_report(preset: str, config: ModelConfig, T: int, out_len: int, nbytes: int, measure: bool) -> Report:
    """A family without an appendix-A closed form: its own count, measured FLOPs and its generation state,
    beside the core it repeats (when it has one) run once as a plain decoder."""
    spec = spec_of(config)
    unit = spec.sequence_multiple(config)
    needed = -(-(T + out_len) // unit) * unit
    with torch.device("meta"):
        model = build_model(config.replace(context_length=max(config.context_length, needed)))
        state = _generation_state_bytes(model, T + out_len, nbytes)
    rows = [("model", "config FLOPs/token", "measured FLOPs/token", f"generation KV state T={T}+{out_len}"),
            (f"{config.family} ({preset})", f"{spec.training_flops_per_token(config, T):.4g}",
             _measured(model, T, measure), f"{state / 2**20:.2f} MiB")]
    if spec.core is not None:
        core = spec.core(config)
        core_spec = spec_of(core)
        rows.append(("core as a plain decoder (one pass)", f"{core_spec.training_flops_per_token(core, T):.4g}", "-",
                     f"{core_spec.kv_bytes(core, T, out_len, nbytes) / 2**20:.2f} MiB"))
    footnote = (f"config: steady-state training FLOPs per token ({spec.cost_note}); measured: 3 x one forward from an "
                "empty state under torch FlopCounterMode; state: the static caches the serving runner allocates per slot.")
    return Report(rows, footnote)


def _measured(model: torch.nn.Module, T: int, measure: bool) -> str:
    """3 x one forward of a ``T``-token window under torch's FLOP counter, per token, or "-"."""
    if not measure:
        return "-"
    idx = torch.zeros(1, T, dtype=torch.long, device="meta")
    return f"{3 * flops.measured_forward_flops(model, {'idx': idx}) / T:.4g}"
