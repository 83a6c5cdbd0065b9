"""Reports on presets without training them: parameter counts, training FLOPs and generation KV-cache bytes.

The counts come from models built on the ``meta`` device, so nothing is allocated. :func:`flops_report`
gives what ``blockloop flops`` prints: the double-decoder paper's formulas (appendices A.1-A.2) beside the
preset's exact count and, optionally, torch's FLOP counter, with the decoder-only model of the same width
and depth; families the appendix does not cover get their own rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockloop.config import ModelConfig
from blockloop.data.collate import collate_for, step_generator
from blockloop.errors import BlockloopError
from blockloop.models import build_model
from blockloop.presets import PRESETS, from_name
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
    plus ``out_len`` generated tokens at ``bytes_per_value``; ``measure`` adds torch's count of one forward."""
    config = from_name(preset)
    T = seq_len or config.context_length
    if not 2 <= T <= config.context_length:
        raise BlockloopError(f"--seq-len must be in 2..{config.context_length} (the model context), got {T}")
    if out_len < 1 or bytes_per_value < 1:
        raise BlockloopError("--out-len and --bytes must be at least 1")
    if config.family == "block":
        return _block_report(preset, config, T, out_len, bytes_per_value, measure)
    if config.family in ("staircase", "ladder"):
        return _recurrent_report(preset, config, T, out_len, bytes_per_value, measure)
    note = None
    if config.family == "recursive":  # weights are shared, compute and KV cache are not: count the looped depth
        note = f"{preset}: {config.summary()}; FLOPs and KV cache are those of its {config.depth}-layer looped depth"
        config = config.stack(config.depth)
    baseline = config.stack(config.n_layer)
    rows = [("model", "paper formula FLOPs/token", "config FLOPs/token", "measured FLOPs/token", f"KV cache T={T}+{out_len}")]
    for label, c in ((f"{config.family} ({preset})", config), ("decoder-only, same width/depth", baseline)):
        t_in, t_out = flops.encoder_decoder_lengths(c, T) if c.family == "encoder_decoder" else (T, None)
        paper = flops.paper_training_flops(c.family, t_in, c.d_model, c.n_layer, t_out) / T
        exact = flops.training_flops_per_token(c, T)
        measured = "-"
        if measure:
            with torch.device("meta"):
                model = build_model(c)
            batch = collate_for(model)(torch.zeros(1, T, dtype=torch.long), torch.zeros(1, T, dtype=torch.long), step_generator(0, 0))
            batch.pop("targets")
            measured = f"{3 * flops.measured_forward_flops(model, {k: v.to('meta') for k, v in batch.items()}) / T:.4g}"
        kv = flops.kv_cache_bytes(c, T, out_len, bytes_per_value)
        rows.append((label, f"{paper:.4g}", f"{exact:.4g}", measured, f"{kv / 2**20:.2f} MiB"))
        if c is config and c.family == "decoder":
            break
    footnote = ("paper formula: appendix A.2 (MHA, 4d MLP, no LM head, 2/3-1/3 split); config: this preset's exact "
                "shapes incl. LM head; measured: 3 x one forward under torch FlopCounterMode (the double decoder's "
                "dense dual attention counts two attentions where the paper's efficient implementation counts one).")
    return Report(rows, footnote, note)


def _measured(model: torch.nn.Module, T: int, measure: bool) -> str:
    """3 x one forward of a ``T``-token window under torch's FLOP counter, per token, or "-"."""
    if not measure:
        return "-"
    idx = torch.zeros(1, T, dtype=torch.long, device="meta")
    return f"{3 * flops.measured_forward_flops(model, {'idx': idx}) / T:.4g}"


def _cache_bytes(caches: list, bytes_per_value: int) -> int:
    return sum(layer.k.numel() + layer.v.numel() for cache in caches for layer in cache.layers) * bytes_per_value


def _block_report(preset: str, config: ModelConfig, T: int, out_len: int, nbytes: int, measure: bool) -> Report:
    """A Block Transformer has no appendix-A formula: its own count, measured FLOPs, and its allocated caches."""
    if T % config.block_len:
        raise BlockloopError(f"--seq-len {T} is not a multiple of the block length {config.block_len}")
    with torch.device("meta"):
        model = build_model(config.replace(context_length=-(-(T + out_len) // config.block_len) * config.block_len))
        caches = model.generation_caches(1, T, out_len)
    rows = [("model", "config FLOPs/token", "measured FLOPs/token", f"KV cache T={T}+{out_len}"),
            (f"block ({preset})", f"{flops.block_flops_per_token(config, T):.4g}", _measured(model, T, measure),
             f"{_cache_bytes(caches, nbytes) / 2**20:.2f} MiB")]
    footnote = ("config: steady-state training FLOPs per token (block decoder once per block, token decoder n_lead + "
                "L_B - 1 positions per block); measured: 3 x one forward under torch FlopCounterMode (the first block "
                "of a window is not decoded); KV cache: the block decoder's cache plus one block of token-decoder cache.")
    return Report(rows, footnote)


def _recurrent_report(preset: str, config: ModelConfig, T: int, out_len: int, nbytes: int, measure: bool) -> Report:
    """The staircase family has no appendix-A formula: the core counted once per pass, measured FLOPs, and
    the generation state the engine allocates per slot, beside the core run once as a plain decoder."""
    with torch.device("meta"):
        model = build_model(config)
        if config.family == "staircase":  # bounded by S and the cache, whatever the stream length
            runner = runner_for(model)
            runner.allocate(1, T + out_len)
            caches = runner.state.passes
        else:
            caches = model.generation_caches(1, T, out_len)
    core = config.stack(config.n_layer)
    rows = [("model", "config FLOPs/token", "measured FLOPs/token", f"generation KV state T={T}+{out_len}"),
            (f"{config.family} ({preset})", f"{flops.training_flops_per_token(config, T):.4g}",
             _measured(model, T, measure), f"{_cache_bytes(caches, nbytes) / 2**20:.2f} MiB"),
            ("core as a plain decoder (one pass)", f"{flops.training_flops_per_token(core, T):.4g}", "-",
             f"{flops.kv_cache_bytes(core, T, out_len, nbytes) / 2**20:.2f} MiB")]
    footnote = ("config: steady-state training FLOPs per token (the core once per pass, full windows, cache/memory "
                "projections); measured: 3 x one forward from an empty stream under torch FlopCounterMode; state: "
                "the static caches generation allocates per slot (a staircase's is bounded by S and the cache).")
    return Report(rows, footnote)
