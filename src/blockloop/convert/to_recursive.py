"""Convert a full-size decoder into a (Relaxed) Recursive Transformer (Bae et al. 2024, sections 2.2-2.3).

The full model has L layers; the recursive one keeps K = L / B shared layers looped B times. Each shared
layer is initialised from the full model's layers (section 2.2, Figure 2, appendix I):

* ``stepwise``: layer round(j (L-1)/(K-1)) of the full model, j = 0..K-1: intervals that keep the first
  and the last layer ("fixed-ends", which appendix I finds best);
* ``average``: the mean of the full layers tied to it (the depth positions that run it), norms included;
* ``lower`` / ``upper``: the first / last K layers;
* ``random``: nothing from the full model (a reduced-size model with recursion, the paper's baseline).

Embeddings (learned positions included), final norm and LM head are copied (except under ``random``).
With ``lora_rank`` r, the LoRA module of each depth position ℓ gets the truncated SVD of the residual W_ℓ - W'_shared (equation 4),
for each shared matrix on its own (the fused q/k/v projection's W^Q, W^K and W^V apart, as the paper relaxes them):
B = U_r Σ_r / s, A = V_r^T, where s = alpha / r is the LoRA scaling, so s B A is the best rank-r
approximation of the residual and the relaxed model starts as close to the full one as r allows
(equation 5; exactly equal at full rank). Where the shared weight equals W_ℓ (the layer stepwise/lower
took it from), and for ``lora_init="zero"``, the module gets the standard zero init (appendix E).

Given ``calibration`` tokens the SVD is activation-aware: what a truncated residual costs is its error on
the layer's inputs, not on the weights, and a pretrained LLM's inputs have a few huge outlier channels. So
the full model runs once on the calibration tokens, s is the RMS of each input channel of each linear at
each depth position, and the SVD is of E diag(s): B = U_r Σ_r / scaling, A = V_r^T diag(1/s), the best
rank-r fit of E on inputs of that scale (still exact at full rank). On SmolLM2-135M it is what makes the
relaxation improve with the rank (benchmarks/results/recursive_smollm2_rank_sweep_cpu.md).

With ``loop_norms`` (the default) every norm of a shared layer keeps one gain per loop
(:class:`~blockloop.nn.norm.LoopNorm`), and each depth position's gain is copied from the layer it
replaces; with LoRA, linear biases get a delta per loop too (b_ℓ - b'). Then nothing tied is left that
LoRA cannot reach, and equation 4 as printed is exact at full rank for every architecture: pre-norms,
Gemma's q/k and sandwich norms (which sit after the linears), LayerNorm and linear biases. Tied norms
(``loop_norms=False``) keep the paper's parameter count but leave a gap no rank closes (SmolLM2-135M at
full rank: perplexity 9,884 against the original's 150.2, which per-loop norms reproduce). Below full rank
the weight-space SVD is not monotone in rank on SmolLM2 with either
(benchmarks/results/recursive_smollm2_rank_sweep_cpu.md).

Sliding-window layers: depth position p attends as the full model's layer p did. A shared layer whose
positions agree takes their type (``local_layers``); otherwise the positions keep theirs (``local_depths``).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch
from torch import nn

from blockloop import progress
from blockloop.choices import LOOP_INITS, LORA_INITS, TYING_STRATEGIES
from blockloop.config import DecoderConfig
from blockloop.errors import BlockloopError
from blockloop.families.recursive import RecursiveConfig, full_lora_rank, linear_shapes
from blockloop.models.decoder import Decoder
from blockloop.models.recursive import RecursiveDecoder, layer_order
from blockloop.nn.lora import LoopLoRALinear
from blockloop.nn.norm import LoopNorm


def recursive_config_from_vanilla(
    config: DecoderConfig,
    *,
    loops: int,
    tying: str = "cycle",
    lora_rank: int = 0,
    lora_alpha: float | None = None,
    prefix_len: int = 0,
    loop_norms: bool = True,
) -> RecursiveConfig:
    """The recursive config of ``config``'s shape with L / ``loops`` shared layers; impossible requests fail here."""
    if loops < 1 or config.n_layer % loops:
        divisors = [b for b in range(1, config.n_layer + 1) if config.n_layer % b == 0]
        problem = "is not a loop count" if loops < 1 else f"does not divide the model's {config.n_layer} layers"
        raise BlockloopError(f"--loops {loops} {problem}; choose one of {divisors}")
    full = full_lora_rank(config)
    if lora_rank > full:
        widest = ", ".join(f"{name} {out}x{in_}" for name, (out, in_) in linear_shapes(config).items()
                           if min(out, in_) == full)
        raise BlockloopError(f"--lora-rank {lora_rank} exceeds the rank of every shared weight matrix: the largest "
                             f"min(in, out) is {full} ({widest}: full rank); give at most {full}")
    if tying not in TYING_STRATEGIES:
        raise BlockloopError(f"tying strategy {tying!r} is unknown; choose one of {TYING_STRATEGIES}")
    own = ("name", "n_layer", "local_layers")
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(DecoderConfig) if f.name not in own}
    return RecursiveConfig(
        **fields, name=f"{config.name}-recursive{loops}", n_layer=config.n_layer // loops, loops=loops, tying=tying,
        lora_rank=lora_rank, lora_alpha=lora_alpha, prefix_len=prefix_len, loop_norms=loop_norms,
        **local_attention(config, loops, tying),
    )


def local_attention(config: DecoderConfig, loops: int, tying: str) -> dict[str, list[int]]:
    """Which attention each depth position keeps: depth position p is the full model's layer p. Where every
    position of a shared layer agrees, the shared layer takes the type (``local_layers``); where they do not
    (e.g. 2 loops over a model that is global every 6th layer), the positions keep theirs (``local_depths``)."""
    order = layer_order(config.n_layer // loops, loops, tying)
    kinds = [{p in config.local_layers for p, layer in enumerate(order) if layer == j} for j in range(max(order) + 1)]
    if all(len(kind) == 1 for kind in kinds):
        return {"local_layers": [j for j, kind in enumerate(kinds) if True in kind], "local_depths": []}
    return {"local_layers": [], "local_depths": sorted(config.local_layers)}


def shared_layer_sources(n_layer: int, loops: int, init: str, order: list[int]) -> list[list[int]]:
    """For each shared layer, the full model's layers whose weights it starts from (averaged when several)."""
    k = n_layer // loops
    if init == "stepwise":
        return [[int(j * (n_layer - 1) / (k - 1) + 0.5)] if k > 1 else [0] for j in range(k)]
    if init == "average":
        return [[p for p, layer in enumerate(order) if layer == j] for j in range(k)]
    if init == "lower":
        return [[j] for j in range(k)]
    if init == "upper":
        return [[n_layer - k + j] for j in range(k)]
    if init == "random":
        return [[] for _ in range(k)]
    raise BlockloopError(f"unknown looped-layer init {init!r}; choose one of {LOOP_INITS}")


@torch.no_grad()
def vanilla_to_recursive(
    vanilla: Decoder,
    *,
    loops: int,
    init: str = "stepwise",
    tying: str = "cycle",
    lora_rank: int = 0,
    lora_alpha: float | None = None,
    lora_init: str = "svd",
    prefix_len: int = 0,
    loop_norms: bool = True,
    calibration: torch.Tensor | None = None,
    seed: int = 0,
) -> RecursiveDecoder:
    """A Recursive (``lora_rank`` = 0) or Relaxed Recursive Transformer initialised from ``vanilla``; with
    ``loop_norms`` each loop's norm gains are those of the layer its depth position replaces; ``calibration``
    token ids ``(B, T)`` make the SVD init activation-aware (see the module docstring)."""
    if type(vanilla) is not Decoder:
        raise BlockloopError(f"only vanilla decoders convert to recursive models, not {vanilla.config.family} models")
    if init not in LOOP_INITS:
        raise BlockloopError(f"unknown looped-layer init {init!r}; choose one of {LOOP_INITS}")
    if lora_init not in LORA_INITS:
        raise BlockloopError(f"unknown LoRA init {lora_init!r}; choose one of {LORA_INITS}")
    if init == "random" and lora_rank and lora_init == "svd":
        # The SVD would fit the full layers' differences from random ones: neither the baseline nor the model.
        raise BlockloopError("--init random takes nothing from the full model, so its LoRA cannot start from the "
                             "full layers' residuals; add --lora-init zero, or choose another --init")
    config = recursive_config_from_vanilla(
        vanilla.config, loops=loops, tying=tying, lora_rank=lora_rank, lora_alpha=lora_alpha, prefix_len=prefix_len,
        loop_norms=loop_norms,
    )
    torch.manual_seed(seed)
    weight = vanilla.embed.weight
    model = RecursiveDecoder(config).to(device=weight.device, dtype=weight.dtype)
    full = vanilla.body.blocks
    if init != "random":
        # Everything outside the layers: embeddings (GPT-2's learned positions too), final norm, head.
        outside = {name: value for name, value in vanilla.state_dict().items() if not name.startswith("body.")}
        unexpected = model.load_state_dict(outside, strict=False).unexpected_keys
        assert not unexpected, unexpected
        for block, sources in zip(model.body.blocks, shared_layer_sources(vanilla.config.n_layer, loops, init, model.order)):
            states = [full[i].state_dict() for i in sources]
            mean = {name: torch.stack([s[name] for s in states]).mean(0) for name in states[0]}
            own = block.state_dict()  # a per-loop norm starts at the mean in every loop, then _init_loop_norms
            mean = {name: value.expand_as(own[name]) if name in own else value for name, value in mean.items()}
            unexpected = block.load_state_dict(mean, strict=False).unexpected_keys
            assert not unexpected, unexpected
        _init_loop_norms(model, full)
    if lora_rank:
        scales = input_scales(vanilla, calibration) if calibration is not None and lora_init == "svd" else {}
        _init_lora(model, full, lora_init, scales)
    return model


@torch.no_grad()
def input_scales(vanilla: Decoder, calibration: torch.Tensor, batch_size: int = 8) -> dict[tuple[int, str], torch.Tensor]:
    """(depth position, linear name) -> the RMS of each input channel of that linear over ``calibration``, read
    ``batch_size`` windows at a time (thousands of windows in one forward held every activation at once)."""
    squares: dict[tuple[int, str], torch.Tensor] = {}

    def record(key: tuple[int, str], module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        total = inputs[0].double().flatten(0, -2).pow(2).sum(0)
        squares[key] = squares[key] + total if key in squares else total

    hooks = [linear.register_forward_hook(partial(record, (position, name)))
             for position, block in enumerate(vanilla.body.blocks)
             for name, linear in block.named_modules() if isinstance(linear, nn.Linear)]
    was_training = vanilla.training
    batches = calibration.to(vanilla.embed.weight.device).split(batch_size)
    try:
        vanilla.eval()
        for batch in progress.bar(iterable=batches, desc="calibrating", unit="batch", leave=False, log_every=30):
            vanilla(batch)
    finally:
        vanilla.train(was_training)
        for hook in hooks:
            hook.remove()
    return {key: (total / calibration.numel()).sqrt() for key, total in squares.items()}  # one row per token


def _init_loop_norms(model: RecursiveDecoder, full: nn.ModuleList) -> None:
    """Each depth position's loop of a per-loop norm takes the gain (and bias) of the layer it replaces."""
    for position, (layer, occurrence) in enumerate(zip(model.order, model.occurrence)):
        for name, norm in model.body.blocks[layer].named_modules():
            if isinstance(norm, LoopNorm):
                source = full[position].get_submodule(name)
                norm.weight[occurrence] = source.weight
                if norm.bias is not None:
                    norm.bias[occurrence] = source.bias


def _init_lora(
    model: RecursiveDecoder, full: nn.ModuleList, lora_init: str, scales: dict[tuple[int, str], torch.Tensor]
) -> None:
    """Equation 4 per depth position: the LoRA of its shared layer's occurrence approximates W_ℓ - W' (weighted
    by the input channels' ``scales`` where given), and its bias delta is b_ℓ - b'."""
    positions = list(enumerate(zip(model.order, model.occurrence)))
    # One SVD per linear and depth position, in float64: minutes for a real model, so on a bar.
    for position, (layer, occurrence) in progress.bar(iterable=positions, desc="fitting LoRA", unit="layer",
                                                      leave=False, log_every=30, disable=lora_init == "zero"):
        source, shared = full[position], model.body.blocks[layer]
        for name, lora in shared.named_modules():
            if not isinstance(lora, LoopLoRALinear):
                continue
            lora.reset_lora(occurrence)
            if lora_init == "zero":
                continue
            original = source.get_submodule(name)
            if lora.lora_bias is not None:
                lora.lora_bias[occurrence] = original.bias - lora.bias
            scale = scales.get((position, name), original.weight.new_ones(original.weight.shape[1], dtype=torch.float64))
            scale = scale.clamp_min(scale.max().item() * 1e-6 if scale.any() else 1.0)  # no channel divides by 0
            for m in lora.matrices():  # W^Q, W^K, W^V of a fused projection each by its own SVD
                residual = original.weight[m.rows].double() - lora.weight[m.rows].double()  # equation 4
                if not residual.any():
                    continue
                u, s, vh = torch.linalg.svd(residual * scale, full_matrices=False)
                lora.factor_b(lora.lora_B[occurrence], m)[:] = (u[:, : m.rank] * s[: m.rank] / lora.scaling)
                lora.lora_A[occurrence, m.a] = (vh[: m.rank] / scale).to(lora.lora_A.dtype)
