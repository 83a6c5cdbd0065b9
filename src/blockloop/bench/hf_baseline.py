"""The Hugging Face ``generate()`` baseline: the same vanilla model converted to a ``transformers`` model
(:func:`blockloop.convert.hf.to_hf_model`, the export path) and decoded by ``generate()`` with the
paper's protocol (greedy, exactly ``gen_len`` tokens, no EOS)."""

from __future__ import annotations

import torch
from torch import nn

from blockloop.bench.throughput import ThroughputResult, check_repeats, run_tokens
from blockloop.bench.timing import timed
from blockloop.errors import BlockloopError


def hf_available() -> str | None:
    """None when the baseline can run, else why not (one line)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not installed (pip install 'blockloop[hf]')"
    try:
        from blockloop.convert.hf import to_hf_model  # noqa: F401
    except ImportError:
        return "blockloop.convert.hf.to_hf_model is not available in this build"
    return None


def to_hf_generator(model: nn.Module) -> nn.Module:
    """``model`` converted with :func:`blockloop.convert.hf.to_hf_model`, in its dtype, on its device. Raises for a
    model that does not export (not vanilla)."""
    reason = hf_available()
    if reason is not None:
        raise BlockloopError(f"the HF generate() baseline needs {reason}")
    from blockloop.convert.hf import to_hf_model
    from blockloop.data.pretrained import quiet_transformers

    weight = next(model.parameters())
    with quiet_transformers():
        return to_hf_model(model).to(device=weight.device, dtype=weight.dtype).eval()


@torch.no_grad()
def hf_generate(hf: nn.Module, ids: torch.Tensor, gen_len: int) -> torch.Tensor:
    """The paper's protocol in ``generate()``: greedy, exactly ``gen_len`` new tokens, EOS off."""
    return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_len, min_new_tokens=gen_len,
                       do_sample=False, eos_token_id=None, pad_token_id=0)


def hf_throughput(
    model: nn.Module, batch: int, prompt_len: int, gen_len: int, *, repeats: int = 3, warmup: int = 1, seed: int = 0,
    warmup_tokens: int | None = None,
) -> ThroughputResult:
    """Time ``transformers`` ``generate()`` on ``model`` converted by :func:`to_hf_generator`; a warm-up run
    generates ``warmup_tokens`` (default ``gen_len``), as :func:`~blockloop.bench.throughput.engine_throughput`."""
    check_repeats(repeats)
    hf = to_hf_generator(model)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    seconds = []
    for run in range(warmup + repeats):
        ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=generator).to(device)
        n_tokens = run_tokens(run, warmup, gen_len, warmup_tokens)
        with timed(device) as timer:
            hf_generate(hf, ids, n_tokens)
        if run >= warmup:
            seconds.append(timer.seconds)
    mean = sum(seconds) / len(seconds)
    return ThroughputResult("hf-generate", batch, prompt_len, gen_len, batch * gen_len / mean, float("nan"),
                            float("nan"), None, None, None, None)
