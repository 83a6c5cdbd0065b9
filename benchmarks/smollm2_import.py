"""SmolLM2-135M imported into blockloop vs the same GGUF in transformers: logit parity and perplexity.

Both models are built from ``SmolLM2-135M-Instruct.Q4_1.gguf`` (dequantised by transformers; blockloop
takes transformers' tensors through its Llama key map) and score the same windows of the built-in
corpus's validation split, tokenized with the ``smollm2`` tokenizer. Reported: the max abs logit
difference over all positions, both models' perplexity on those windows, top-1 agreement, and the forward
time of each (transformers is the baseline timed in the same run; CPU numbers are not a speed claim).

    .venv/bin/python benchmarks/smollm2_import.py --windows 8 --seq-len 512 --record

Writes ``smollm2_import_cpu.json`` to runs/bench/ (``--out-dir DIR`` elsewhere, ``--record`` into
benchmarks/results/, beside the hand-written reading of it, ``smollm2_import_cpu.md``) and prints it.
"""

from __future__ import annotations

import json
import math
import time

import torch
import torch.nn.functional as F

from blockloop.bench.records import (
    add_output_arguments,
    environment,
    environment_line,
    output_dir,
    run_script,
)
from blockloop.cli import Parser
from blockloop.cli.common import positive_int
from blockloop.convert.hf import from_hf_model, load_hf_model
from blockloop.data.dataset import prepare_tokens
from blockloop.data.loader import PackedSequences
from blockloop.data.pretrained import SMOLLM2_GGUF, smollm2_files
from blockloop.data.tokenizers import build_tokenizer


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="shakespeare", help="built-in corpus whose val split is scored")
    parser.add_argument("--windows", type=positive_int, default=8, help="validation windows to score")
    parser.add_argument("--seq-len", type=positive_int, default=512, help="tokens per window")
    add_output_arguments(parser)
    args = parser.parse_args()
    out = output_dir(args)

    hf = load_hf_model(smollm2_files(), gguf_file=SMOLLM2_GGUF)
    ours = from_hf_model(hf, name="SmolLM2-135M-Instruct.Q4_1")
    tokenizer = build_tokenizer("smollm2")
    val = PackedSequences(prepare_tokens(args.data, tokenizer, show_progress=False).val, args.seq_len)
    count = min(args.windows, len(val))
    max_diff, agree, positions = 0.0, 0, 0
    nll = {"blockloop": 0.0, "transformers": 0.0}
    seconds = {"blockloop": 0.0, "transformers": 0.0}
    with torch.no_grad():
        for i in range(count):
            window = torch.from_numpy(val[i])[None]
            x, y = window[:, :-1], window[:, 1:]
            start = time.perf_counter()
            theirs = hf(x).logits
            seconds["transformers"] += time.perf_counter() - start
            start = time.perf_counter()
            mine, _ = ours(x)
            seconds["blockloop"] += time.perf_counter() - start
            max_diff = max(max_diff, (mine - theirs).abs().max().item())
            agree += (mine.argmax(-1) == theirs.argmax(-1)).sum().item()
            positions += y.numel()
            for name, logits in (("blockloop", mine), ("transformers", theirs)):
                nll[name] += F.cross_entropy(logits[0], y[0], reduction="sum").item()
    result = {
        "model": SMOLLM2_GGUF, "data": f"{args.data} val", "windows": count, "seq_len": args.seq_len,
        "tokens": positions, "max_abs_logit_diff": max_diff, "top1_agreement": agree / positions,
        "perplexity": {k: math.exp(v / positions) for k, v in nll.items()},
        "forward_s_per_window": {k: v / count for k, v in seconds.items()},
        **environment("cpu"),
    }
    (out / "smollm2_import_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(environment_line(result))


if __name__ == "__main__":
    run_script(main)
