"""The targets of ``blockloop convert --to``: what each makes and the options it takes.

A table of names and help, without torch, so that ``blockloop convert --help`` lists every target and flag
at once; :data:`blockloop.convert.checkpoints.CONVERTERS` performs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from blockloop.choices import LOOP_INITS, LORA_INITS, SAVE_DTYPES, TYING_STRATEGIES


@dataclass(frozen=True)
class Option:
    """A keyword option of a target (flag ``--name-with-dashes``); ``default`` None = the target decides."""

    name: str
    type: Callable[[str], Any]
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    positive: bool = False  # 0 is refused too (a scale that would erase what it scales)


@dataclass(frozen=True)
class Target:
    """``unread(given)``, for the options given (name -> value): those the others given make meaningless, the
    mode that ignores them and the other way out, so ``convert`` refuses them rather than convert without them."""

    title: str  # what the target makes, with its reference
    options: tuple[Option, ...]
    unread: Callable[[dict[str, Any]], tuple[list[str], str, str]] | None = None


def implied_relaxation(lora_rank: int | None, prefix_len: int | None) -> str:
    """The relaxation a conversion without ``--relax`` gets: the one whose size was given."""
    return "lora" if lora_rank else "prefix" if prefix_len else "none"


def _recursive_unread(given: dict[str, Any]) -> tuple[list[str], str, str]:
    """The LoRA init's options shape nothing without LoRA modules; calibration weights only the SVD init; the seed
    draws nothing in an unrelaxed conversion from a full model's layers (every weight a copy or an average). One
    loop shares no layer, so there is nothing to tie or relax (a per-loop LoRA would only add parameters)."""
    if given.get("loops") == 1:
        sharing = [name for name in ("strategy", "norms", "relax", "lora_rank", "lora_alpha", "lora_init",
                                     "calibration", "prefix_len") if name in given]
        if sharing:
            return sharing, "--loops 1 (no layer is shared)", ", or give --loops 2 or more"
    relax = given.get("relax") or implied_relaxation(given.get("lora_rank"), given.get("prefix_len"))
    if relax != "lora":
        lora = [name for name in ("lora_alpha", "lora_init", "calibration") if name in given]
        if lora:  # --lora-rank alone is refused beside --relax none/prefix: name the relaxation too where one was given
            add = "--relax lora --lora-rank R" if "relax" in given else "--lora-rank R"
            return lora, f"--relax {relax} (no LoRA modules)", f", or add {add}"
    elif given.get("lora_init") == "zero" and "calibration" in given:
        return ["calibration"], "--lora-init zero (it weights the SVD init)", ""
    init = given.get("init", "stepwise")
    if "seed" in given and relax == "none" and init != "random":
        return ["seed"], f"--init {init} without a relaxation (nothing in it is random)", ""
    return [], "", ""


SAVE_DTYPE = Option("save_dtype", str, "float32", "dtype of the weights --to hf, --to weights and --from-hf write "
                    "(default: float32; bfloat16 halves the size)", choices=SAVE_DTYPES)
TARGETS: dict[str, Target] = {
    "block": Target("Block Transformer (uptraining, Ho et al. 2024)", (
        Option("block_len", int, 4, "tokens per block L_B (default: 4)"),
        Option("prefix_len", int, None, "prefix tokens of the token decoder (default: 2)"),
    )),
    "recursive": Target("Relaxed Recursive Transformer (Bae et al. 2024, sections 2.2-2.3)", (
        Option("loops", int, 2, "loops B over L/B shared layers; must divide the depth (default: 2)"),
        Option("init", str, "stepwise", f"shared-layer init: {', '.join(LOOP_INITS)} (default: stepwise)",
               choices=LOOP_INITS),
        Option("strategy", str, "cycle", f"layer tying: {', '.join(TYING_STRATEGIES)} (default: cycle; only cycle "
               "serves depth-wise, --exit)", choices=TYING_STRATEGIES),
        Option("relax", str, None, "relaxation: per-loop LoRA (--lora-rank) or per-position prefix (--prefix-len); "
               "default: lora when --lora-rank is given, prefix when --prefix-len is, else none",
               choices=("none", "lora", "prefix")),
        Option("lora_rank", int, 0, "LoRA rank r per shared weight matrix (W^Q, W^K, W^V apart) and loop "
               "(default: 0, none)"),
        Option("lora_alpha", float, None, "LoRA alpha; scaling alpha/r (default: r, scaling 1)", positive=True),
        Option("lora_init", str, "svd", f"LoRA init: {', '.join(LORA_INITS)} (default: svd, equation 4's "
               "truncated SVD of each residual, weighted by --calibration's input activations)",
               choices=LORA_INITS),
        Option("norms", str, "per-loop", "norm gains of the shared layers: per-loop (one per loop, from the layer "
               "each depth position replaces; full-rank LoRA is then exact) or tied (default: per-loop)",
               choices=("per-loop", "tied")),
        Option("calibration", int, 8, "windows of 128 tokens of the source run's training data whose input "
               "activations weight the SVD init (activation-aware; 0: SVD of the weights alone; default: 8)"),
        Option("prefix_len", int, None, "learned prefix key/values per depth position; needed (at least 1) by --relax prefix"),
        Option("seed", int, 0, "seed of random and zero inits (default: 0)"),
    ), unread=_recursive_unread),
    "hf": Target("Hugging Face folder (export)", (SAVE_DTYPE,)),
    "weights": Target("the model alone, without optimizer state (export)", (SAVE_DTYPE,)),
}
