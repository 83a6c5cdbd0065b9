"""What the engine's window (``sync_every`` decode steps between host copies of the tokens) costs on CPU, where
the host is the device: a window of 1 (the CPU default, :func:`blockloop.serve.engine.default_sync_every`)
against 8 (the GPU default, and the CPU default before), on the same engine and model, alternating run by run.

Two loads, SmolLM2-135M-Instruct:

- a Poisson stream of corpus prompts (``bench.stream.run_stream``, greedy, EOS off): TTFT, inter-token latency,
  end-to-end latency and throughput. A window delays the first token to its end and hands tokens over in bursts.
- chat answers that end at the end-of-turn token, one question at a time on a one-slot engine as ``blockloop chat``
  answers (the chat template's prompts, greedy): seconds to answer and the decode steps spent. A request that
  reaches its EOS inside a window keeps stepping to the window's end.

    .venv/bin/python benchmarks/sync_window.py --threads 2 --record

Writes ``sync_window_cpu.json`` to runs/bench/ (``--out-dir DIR`` elsewhere, ``--record`` into
benchmarks/results/) and prints it.
"""

from __future__ import annotations

import json
import time

import torch

from blockloop.bench.records import (
    add_output_arguments,
    environment,
    environment_line,
    output_dir,
    run_script,
)
from blockloop.bench.stream import corpus_prompts, run_stream
from blockloop.cli import Parser
from blockloop.cli.common import add_threads, int_range, number, positive_int, set_threads
from blockloop.convert.smollm2 import import_smollm2
from blockloop.data.pretrained import SMOLLM2_GGUF
from blockloop.data.tokenizers import build_tokenizer
from blockloop.nn.linear import packed_linears
from blockloop.serve.engine import Engine
from blockloop.serve.http.chat import chat_template_for
from blockloop.serve.requests import SamplingParams

WINDOWS = (1, 8)
PROMPT_RANGE = (16, 64)  # tokens of each stream prompt, as http_serving_cpu's stream
QUESTIONS = [
    "What is the capital of France?", "Name three primary colours.", "What is 12 times 12?",
    "Who wrote Romeo and Juliet?", "Give me a synonym for happy.", "What planet is closest to the sun?",
    "How many legs does a spider have?", "What is the boiling point of water in Celsius?",
]


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per window size (after one warm-up)")
    parser.add_argument("--slots", type=positive_int, default=8, help="engine slots of the stream (blockloop serve's default: 8)")
    parser.add_argument("--requests", type=positive_int, default=24, help="requests in the stream")
    parser.add_argument("--rate", type=number(0, low_open=True, infinite=True), default=1.0, help="Poisson arrivals per second in the stream")
    parser.add_argument("--tokens-range", type=int_range, default="16,48", help="new tokens per stream request, MIN,MAX")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64, help="most tokens of a chat answer")
    add_threads(parser)
    add_output_arguments(parser)
    args = parser.parse_args()
    set_threads(args.threads)
    low, high = args.tokens_range
    model = import_smollm2().eval()
    tokenizer = build_tokenizer("smollm2")
    prompts = corpus_prompts(model.config.vocab_size, args.requests, *PROMPT_RANGE, seed=0, tokenizer=tokenizer)
    template = chat_template_for(tokenizer)
    questions = [tokenizer.encode(template.render([{"role": "user", "content": q}])) for q in QUESTIONS]
    stream: dict[int, list[dict[str, object]]] = {w: [] for w in WINDOWS}
    answers: dict[int, list[dict[str, object]]] = {w: [] for w in WINDOWS}
    for run in range(args.repeats + 1):
        for window in WINDOWS:
            metrics = run_stream(model, prompts, n_slots=args.slots, min_tokens=low, max_tokens=high, rate=args.rate,
                                 sync_every=window, seed=0)
            answer = answer_each(model, questions, window, args.max_new_tokens, tokenizer.eos_id)
            if run:  # the first round warms up
                stream[window].append(metrics)
                answers[window].append(answer)
                print(f"window {window}: stream TTFT p50 {ms(metrics['ttft_s']['median'])}, E2E p50 "
                      f"{ms(metrics['e2e_s']['median'])}, {metrics['throughput_tok_s']:.1f} tok/s; {len(questions)} chat answers "
                      f"one by one in {answer['seconds']:.2f} s ({answer['tokens']} tokens, {answer['steps']} decode "
                      "steps)", flush=True)
    result = {
        "model": SMOLLM2_GGUF, "slots": args.slots, "repeats": args.repeats,
        "stream": {"requests": args.requests, "rate": args.rate, "prompt_range": list(PROMPT_RANGE), "tokens_range": [low, high],
                   "summary": {w: stream_summary(stream[w]) for w in WINDOWS},
                   "runs": {w: [{k: v for k, v in m.items() if k != "outputs"} for m in stream[w]] for w in WINDOWS},
                   "same_tokens": all(m["outputs"] == stream[1][0]["outputs"] for w in WINDOWS for m in stream[w])},
        "answers": {"questions": QUESTIONS, "max_new_tokens": args.max_new_tokens,
                    "runs": answers, "same_tokens": all(a["outputs"] == answers[1][0]["outputs"]
                                                        for w in WINDOWS for a in answers[w])},
        **environment("cpu", torch.float32),
    }
    s = result["stream"]["summary"]
    seconds = {w: sum(a["seconds"] for a in answers[w]) / len(answers[w]) for w in WINDOWS}
    result["ratios_window_1_over_8"] = {
        "stream_ttft_p50": s[1]["ttft_p50_s"] / s[8]["ttft_p50_s"],
        "stream_e2e_p50": s[1]["e2e_p50_s"] / s[8]["e2e_p50_s"],
        "stream_itl_p99": s[1]["itl_p99_s"] / s[8]["itl_p99_s"],
        "stream_throughput": s[1]["throughput_tok_s"] / s[8]["throughput_tok_s"],
        "answer_seconds": seconds[1] / seconds[8],
    }
    out = output_dir(args)
    (out / "sync_window_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "stream"} | {"stream": s}, indent=2))
    print(environment_line(result))


def answer_each(model: torch.nn.Module, questions: list[list[int]], window: int, max_new_tokens: int,
                eos_id: int) -> dict[str, object]:
    """The questions one after another on a one-slot engine, as ``blockloop chat`` answers them (greedy, each
    answer ending at ``eos_id``): the seconds until each answer is complete on the host (its EOS read), summed;
    the decode steps, the tokens answered and the answers."""
    engine = Engine(model, 1, max_len=max(map(len, questions)) + max_new_tokens, sync_every=window)
    seconds, outputs = 0.0, []
    with torch.no_grad(), packed_linears(model, engine.step_rows):
        for question in questions:
            request = engine.submit(question, max_new_tokens, eos_id=eos_id, sampling=SamplingParams(temperature=0.0))
            start = time.perf_counter()
            while not engine.idle:
                engine.step()
            seconds += request.finish_time - start
            outputs.append(request.output)
    return {"seconds": seconds, "steps": engine.steps, "tokens": sum(map(len, outputs)), "outputs": outputs}


def stream_summary(runs: list[dict[str, object]]) -> dict[str, float]:
    """Means over runs of the stream's medians and tails."""
    def mean(key: str, stat: str | None = None) -> float:
        return sum((m[key][stat] if stat else m[key]) for m in runs) / len(runs)  # type: ignore[index]
    return {"ttft_p50_s": mean("ttft_s", "median"), "ttft_p99_s": mean("ttft_s", "p99"),
            "itl_p50_s": mean("itl_s", "median"), "itl_p99_s": mean("itl_s", "p99"),
            "e2e_p50_s": mean("e2e_s", "median"), "e2e_p99_s": mean("e2e_s", "p99"),
            "throughput_tok_s": mean("throughput_tok_s")}


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


if __name__ == "__main__":
    run_script(main)
