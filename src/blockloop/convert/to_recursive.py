"""Convert a full-size decoder into a (Relaxed) Recursive Transformer (Bae et al. 2024, sections 2.2-2.3).

The full model has L layers; the recursive one keeps K = L / B shared layers looped B times. Each shared
layer is initialised from the full model's layers (section 2.2, Figure 2, appendix I):

* ``stepwise``: layer round(j (L-1)/(K-1)) of the full model, j = 0..K-1: intervals that keep the first
  and the last layer ("fixed-ends", which appendix I finds best);
* ``average``: the mean of the full layers tied to it (the depth positions that run it), norms included;
* ``lower`` / ``upper``: the first / last K layers;
* ``random``: nothing from the full model (a reduced-size model with recursion, the paper's baseline).

Embedding, final norm and LM head are copied (except under ``random``). With ``lora_rank`` r, the LoRA
module of each depth position ℓ gets the truncated SVD of the residual W_ℓ - W'_shared (equation 4):
B = U_r Σ_r / s, A = V_r^T, where s = alpha / r is the LoRA scaling, so s B A is the best rank-r
approximation of the residual and the relaxed model starts as close to the full one as r allows
(equation 5; exactly equal at full rank). Where the shared weight equals W_ℓ (the layer stepwise/lower
took it from), and for ``lora_init="zero"``, the module gets the standard zero init (appendix E).

LoRA relaxes linear weights, while the pre-norms in front of them are tied too, so ``svd`` (equation 4
as printed) reproduces the full model at full rank only where the tied norm gains agree with the layer's.
``svd_effective`` takes the SVD of the effective residual instead: a norm's gain g scales the input of
the next linear, so for the linears fed by a tied pre-norm (q/k/v from ``norm1``, the MLP's input from
``norm2``) E = W_ℓ diag(g_ℓ) - W' diag(g') and A = V_r^T diag(1/g'). Full rank then reproduces the full
model even where averaged gains differ, but at low rank it weights channels by their gain, and in a
pretrained LLM the outlier channels (huge activations, small gains) make that the worse fit: on
SmolLM2-135M it starts worse than ``svd`` below full rank (benchmarks/results/recursive_smollm2_*). What
LoRA cannot absorb stays shared either way: LayerNorm and linear biases, Gemma's q/k and post norms.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from blockloop.choices import LOOP_INITS, LORA_INITS
from blockloop.config import DecoderConfig
from blockloop.errors import BlockloopError
from blockloop.families.recursive import RecursiveConfig
from blockloop.models.decoder import Decoder
from blockloop.models.recursive import RecursiveDecoder
from blockloop.nn.lora import LoopLoRALinear

# The pre-norm whose gain scales each linear's input (see the module docstring).
INPUT_NORMS = {"attn.qkv": "norm1", "mlp.fc": "norm2", "mlp.gate": "norm2", "mlp.up": "norm2"}


def recursive_config_from_vanilla(
    config: DecoderConfig,
    *,
    loops: int,
    tying: str = "cycle",
    lora_rank: int = 0,
    lora_alpha: float | None = None,
    prefix_len: int = 0,
) -> RecursiveConfig:
    """The recursive config of ``config``'s shape with L / ``loops`` shared layers; impossible requests fail here."""
    if loops < 1 or config.n_layer % loops:
        divisors = [b for b in range(1, config.n_layer + 1) if config.n_layer % b == 0]
        raise BlockloopError(
            f"--loops {loops} does not divide the model's {config.n_layer} layers; choose one of {divisors}"
        )
    max_rank = min(min(shape) for shape in linear_shapes(config).values())
    if lora_rank > max_rank:
        smallest = min(linear_shapes(config).items(), key=lambda item: min(item[1]))
        raise BlockloopError(
            f"--lora-rank {lora_rank} exceeds the rank of the shared weights: {smallest[0]} is {smallest[1][0]}x"
            f"{smallest[1][1]}, so at most min(in, out) = {max_rank}"
        )
    if config.local_layers:
        raise BlockloopError(
            f"{config.name} mixes sliding-window local layers {config.local_layers} with global ones; tied layers "
            "must attend alike, so recursive conversion supports models without local layers"
        )
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(DecoderConfig) if f.name not in ("name", "n_layer")}
    return RecursiveConfig(
        **fields, name=f"{config.name}-recursive{loops}", n_layer=config.n_layer // loops, loops=loops, tying=tying,
        lora_rank=lora_rank, lora_alpha=lora_alpha, prefix_len=prefix_len,
    )


def linear_shapes(config: DecoderConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of every linear weight in one layer."""
    qkv = (config.n_head + 2 * config.n_kv_head) * config.head_dim
    shapes = {"attn.qkv": (qkv, config.d_model), "attn.proj": (config.d_model, config.n_head * config.head_dim)}
    if config.mlp in ("gelu", "gelu_tanh"):
        return {**shapes, "mlp.fc": (config.d_ff, config.d_model), "mlp.proj": (config.d_model, config.d_ff)}
    return {**shapes, "mlp.gate": (config.d_ff, config.d_model), "mlp.up": (config.d_ff, config.d_model),
            "mlp.proj": (config.d_model, config.d_ff)}


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
    seed: int = 0,
) -> RecursiveDecoder:
    """A Recursive (``lora_rank`` = 0) or Relaxed Recursive Transformer initialised from ``vanilla``."""
    if type(vanilla) is not Decoder:
        raise BlockloopError(f"only vanilla decoders convert to recursive models, not {type(vanilla).__name__}")
    if init not in LOOP_INITS:
        raise BlockloopError(f"unknown looped-layer init {init!r}; choose one of {LOOP_INITS}")
    if lora_init not in LORA_INITS:
        raise BlockloopError(f"unknown LoRA init {lora_init!r}; choose one of {LORA_INITS}")
    config = recursive_config_from_vanilla(
        vanilla.config, loops=loops, tying=tying, lora_rank=lora_rank, lora_alpha=lora_alpha, prefix_len=prefix_len
    )
    torch.manual_seed(seed)
    weight = vanilla.embed.weight
    model = RecursiveDecoder(config).to(device=weight.device, dtype=weight.dtype)
    full = vanilla.body.blocks
    if init != "random":
        model.embed.weight.copy_(vanilla.embed.weight)
        model.norm.load_state_dict(vanilla.norm.state_dict())
        if not config.tie_embeddings:
            model.lm_head.weight.copy_(vanilla.lm_head.weight)
        for block, sources in zip(model.body.blocks, shared_layer_sources(vanilla.config.n_layer, loops, init, model.order)):
            states = [full[i].state_dict() for i in sources]
            mean = {name: torch.stack([s[name] for s in states]).mean(0) for name in states[0]}
            unexpected = block.load_state_dict(mean, strict=False).unexpected_keys
            assert not unexpected, unexpected
    if lora_rank:
        _init_lora(model, full, lora_init)
    return model


def _init_lora(model: RecursiveDecoder, full: nn.ModuleList, lora_init: str) -> None:
    """Equation 4 per depth position: the LoRA of its shared layer's occurrence approximates W_ℓ - W'."""
    for position, (layer, occurrence) in enumerate(zip(model.order, model.occurrence)):
        source, shared = full[position], model.body.blocks[layer]
        for name, lora in shared.named_modules():
            if not isinstance(lora, LoopLoRALinear):
                continue
            weight, target = lora.weight.double(), source.get_submodule(name).weight.double()
            gain = torch.ones(weight.shape[1], dtype=torch.float64, device=weight.device)
            if name in INPUT_NORMS and lora_init == "svd_effective":
                gain = _gain(shared.get_submodule(INPUT_NORMS[name]))
                target = target * _gain(source.get_submodule(INPUT_NORMS[name]))
            residual = target - weight * gain  # equation 4, or E = W_l diag(g_l) - W' diag(g')
            if lora_init == "zero" or not residual.any():
                lora.reset_lora(occurrence)
                continue
            u, s, vh = torch.linalg.svd(residual, full_matrices=False)
            r = lora.rank
            lora.lora_B[occurrence] = (u[:, :r] * s[:r] / lora.scaling).to(lora.lora_B.dtype)
            lora.lora_A[occurrence] = (vh[:r] / gain.where(gain != 0, 1.0)).to(lora.lora_A.dtype)


def _gain(norm: nn.Module) -> torch.Tensor:
    """The per-channel gain a norm multiplies the normalised input by (Gemma's 1 + w included)."""
    return norm.weight.double() + getattr(norm, "offset", 0.0)
