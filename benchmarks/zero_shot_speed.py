"""What prefix reuse buys: multiple-choice scoring through the KV cache (the context once per question) against
scoring every choice from scratch (one causal forward over context + choice), same questions, same batches,
same process, alternating, so the ratio holds however loaded the machine is. Also checks that both agree.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/zero_shot_speed.py --checkpoint runs/smollm2 --tasks hellaswag,piqa,arc_easy --limit 24 --repeats 1 --record

Appends one JSON line per task, with the environment, to ``zero_shot_speed_<device>.jsonl`` in runs/bench/ (``--out-dir
DIR`` elsewhere, ``--record`` into benchmarks/results/).
"""

from __future__ import annotations

import json

import torch

from blockloop.bench.records import add_output_arguments, append_records, environment, output_dir, run_script
from blockloop.bench.timing import timed
from blockloop.cli import Parser
from blockloop.cli.common import add_threads, positive_int, set_threads
from blockloop.cli.common import device as device_name
from blockloop.device import resolve_device
from blockloop.evals.benchmarks_data import load_rows
from blockloop.evals.scoring import LAYOUTS, encode_request, score
from blockloop.evals.tasks import TASKS, build_questions, parse_tasks
from blockloop.families import spec_of
from blockloop.train.run import load_trained


def main() -> None:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--tasks", default="hellaswag,piqa,arc_easy")
    p.add_argument("--limit", type=positive_int, default=40)
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--repeats", type=positive_int, default=2)
    add_threads(p, default=1)
    p.add_argument("--device", type=device_name, default="cpu", help="cpu, cuda or auto (default: cpu); the file is named after it")
    add_output_arguments(p)
    args = p.parse_args()
    tasks = parse_tasks(args.tasks)  # a misspelt task stops here, before the model loads
    device = resolve_device(args.device)
    out = output_dir(args) / f"zero_shot_speed_{torch.device(device).type}.jsonl"
    set_threads(args.threads)
    trained = load_trained(args.checkpoint, device)
    model, tok = trained.model, trained.tokenizer
    if spec_of(model.config).scoring != "cached":
        raise SystemExit("this compares prefix reuse with scoring from scratch: give a model that scores 'cached'")
    from_scratch = LAYOUTS["causal"]
    for name in tasks:
        questions = build_questions(TASKS[name], load_rows(TASKS[name].dataset), limit=args.limit)
        groups = [[encode_request(tok, c, x) for c, x in q.pairs] for q in questions]
        groups.sort(key=lambda g: -max(len(r.context) + len(r.continuation) for r in g))  # both batch alike
        best = {"reuse": float("inf"), "scratch": float("inf")}
        for _ in range(args.repeats):
            with timed(torch.device(device)) as reuse:
                reused = score(model, groups, batch_size=args.batch_size).loglikelihood[:, 0]
            best["reuse"] = min(best["reuse"], reuse.seconds)
            with timed(torch.device(device)) as scratch_time, torch.no_grad():
                parts = [from_scratch(model, groups[i : i + args.batch_size], None)[0][:, 0]
                         for i in range(0, len(groups), args.batch_size)]
            best["scratch"] = min(best["scratch"], scratch_time.seconds)
        scratch = torch.cat(parts)
        tokens = sum(len(r.context) + len(r.continuation) for g in groups for r in g)
        row = {"task": name, "questions": len(groups), "requests": sum(map(len, groups)), "tokens": tokens,
               "reuse_s": round(best["reuse"], 2), "scratch_s": round(best["scratch"], 2),
               "speedup": round(best["scratch"] / best["reuse"], 2),
               "max_abs_diff": float((reused.cpu() - scratch.cpu()).abs().max()), **environment(device)}
        print(json.dumps(row), flush=True)
        append_records(out, [row])


if __name__ == "__main__":
    run_script(main)
