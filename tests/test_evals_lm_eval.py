"""The lm-eval bridge, offline: a local YAML task over a local JSON file, run through lm-eval's Python API on
a blockloop model, gives the accuracy blockloop's own evaluator gives on the same items."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")

import torch

from blockloop.data.tokenizers import ByteTokenizer
from blockloop.evals.harness import BenchmarkRequest, run_benchmarks
from blockloop.evals.lm_eval_bridge import BlockloopLM
from blockloop.evals.scoring import encode_request, score
from blockloop.evals.tasks import TASKS, build_questions
from blockloop.families import build_model
from blockloop.serve.generate import generate
from small_presets import small_variant

# PIQA's lm-eval definition (lm_eval/tasks/piqa/piqa.yaml) over a local file
TASK_YAML = """\
task: local_piqa
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {path}
output_type: multiple_choice
validation_split: validation
doc_to_text: "Question: {{{{goal}}}}\\nAnswer:"
doc_to_target: label
doc_to_choice: "{{{{[sol1, sol2]}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""

WORDS = "salt sugar water stone glass paper wood iron milk sand cloth rope".split()
ROWS = [{"goal": f"How do you clean {WORDS[i]}?", "sol1": f"Rub it with {WORDS[(i + 3) % 12]}.",
         "sol2": f"Soak it in {WORDS[(i + 5) % 12]} for a day.", "label": i % 2} for i in range(12)]


@pytest.fixture(scope="module")
def byte_model():
    torch.manual_seed(0)
    tok = ByteTokenizer()
    config = small_variant("tiny").replace(vocab_size=tok.vocab_size, padded_vocab_size=320, context_length=256)
    return build_model(config).double().eval(), tok  # float64: batches of different sizes agree to 1e-9


def test_lm_eval_on_a_local_task_matches_the_builtin_evaluator(byte_model, tmp_path):
    from lm_eval.tasks import TaskManager

    model, tok = byte_model
    data = tmp_path / "piqa.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "local_piqa.yaml").write_text(TASK_YAML.format(path=data))
    out = lm_eval.simple_evaluate(model=BlockloopLM(model=model, tokenizer=tok, batch_size=4), tasks=["local_piqa"],
                                  task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False), num_fewshot=0,
                                  log_samples=True)
    theirs = out["results"]["local_piqa"]
    ours = run_benchmarks(model, tok, BenchmarkRequest(["piqa"]), rows=lambda dataset: ROWS)["results"]
    # the same strings scored: every choice's log-likelihood equal, item by item
    questions = build_questions(TASKS["piqa"], ROWS)
    mine = score(model, [[encode_request(tok, c, x) for c, x in q.pairs] for q in questions]).loglikelihood[:, 0]
    assert len(out["samples"]["local_piqa"]) == len(ROWS)
    for sample in out["samples"]["local_piqa"]:
        lls = [float(ll) for ll, _ in sample["filtered_resps"]]
        assert lls == pytest.approx(mine[2 * sample["doc_id"] : 2 * sample["doc_id"] + 2].tolist(), abs=1e-9)
    for r in ours:
        assert theirs[f"{r['metric']},none"] == pytest.approx(r["value"], abs=1e-12)
        assert theirs[f"{r['metric']}_stderr,none"] == pytest.approx(r["stderr"], abs=1e-12)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A trained run folder (byte tokenizer, the tiny preset, two steps), as `blockloop train` leaves one."""
    from blockloop.cli import main

    out = tmp_path_factory.mktemp("lm_eval") / "run"
    assert main(["train", "--preset", "tiny", "--steps", "2", "--warmup-steps", "1", "--batch-size", "2", "--seq-len",
                 "32", "--device", "cpu", "--no-progress", "--out", str(out)]) == 0
    return out


def test_lm_eval_loads_a_checkpoint_by_name_and_matches_the_builtin_evaluator(tiny_run, tmp_path):
    """The README's registration path: lm-eval builds the model itself from model="blockloop" and
    model_args="checkpoint=RUN,...", and scores each choice as blockloop's evaluator does on that checkpoint."""
    from lm_eval.tasks import TaskManager

    from blockloop.train.run import load_trained

    data = tmp_path / "piqa.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "local_piqa.yaml").write_text(TASK_YAML.format(path=data))
    out = lm_eval.simple_evaluate(model="blockloop", model_args=f"checkpoint={tiny_run},device=cpu,batch_size=3",
                                  tasks=["local_piqa"], num_fewshot=0, log_samples=True,
                                  task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False))
    trained = load_trained(tiny_run, "cpu")
    model, tok = trained.model.eval(), trained.tokenizer
    assert tok.name == "byte"
    questions = build_questions(TASKS["piqa"], ROWS)
    mine = score(model, [[encode_request(tok, c, x) for c, x in q.pairs] for q in questions]).loglikelihood[:, 0]
    samples = out["samples"]["local_piqa"]
    assert sorted(s["doc_id"] for s in samples) == list(range(len(ROWS)))
    # the checkpoint's weights, not a fresh model: every choice's log-likelihood equal, up to float32 rounding
    # (the checkpoint is float32, and lm-eval's requests reach score() in other batches than these)
    for sample in samples:
        lls = [float(ll) for ll, _ in sample["filtered_resps"]]
        assert lls == pytest.approx(mine[2 * sample["doc_id"] : 2 * sample["doc_id"] + 2].tolist(), abs=1e-4, rel=0)
    theirs = out["results"]["local_piqa"]
    ours = run_benchmarks(model, tok, BenchmarkRequest(["piqa"]), rows=lambda dataset: ROWS)["results"]
    assert [r["metric"] for r in ours] == ["acc", "acc_norm"]
    for r in ours:
        assert theirs[f"{r['metric']},none"] == pytest.approx(r["value"], abs=1e-12)
        assert theirs[f"{r['metric']}_stderr,none"] == pytest.approx(r["stderr"], abs=1e-12)


def test_chat_templated_prompts_are_scored_through_the_models_template(byte_model, tmp_path):
    """lm-eval's apply_chat_template (an Instruct model's usual setting) needs the model's template; a byte model
    has the plain one, as `chat` and `serve` render it, and each choice is scored after that prompt."""
    from lm_eval.tasks import TaskManager

    from blockloop.serve.http.chat import plain_template

    model, tok = byte_model
    data = tmp_path / "piqa.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "local_piqa.yaml").write_text(TASK_YAML.format(path=data))
    lm = BlockloopLM(model=model, tokenizer=tok, batch_size=4)
    assert lm.tokenizer_name == "byte" and lm.chat_template(True) == ""
    out = lm_eval.simple_evaluate(model=lm, tasks=["local_piqa"], num_fewshot=0, log_samples=True,
                                  apply_chat_template=True,
                                  task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False))
    for sample in out["samples"]["local_piqa"]:
        row = ROWS[sample["doc_id"]]
        prompt = plain_template().render([{"role": "user", "content": f"Question: {row['goal']}\nAnswer:"}])
        assert [a[0] for a in sample["arguments"]] == [prompt, prompt]
        mine = score(model, [[encode_request(tok, prompt, a[1]) for a in sample["arguments"]]]).loglikelihood[:, 0]
        assert [float(ll) for ll, _ in sample["filtered_resps"]] == pytest.approx(mine.tolist(), abs=1e-9)


def test_lm_eval_command_line_runs_the_blockloop_model(tiny_run, tmp_path):
    """lm-eval's own command line finds a model only by import: `python -m blockloop.evals.lm_eval_cli` is it with
    the bridge imported, and gives what the Python API gives; a missing checkpoint is one line, exit 2."""
    import subprocess
    import sys

    data = tmp_path / "piqa.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "local_piqa.yaml").write_text(TASK_YAML.format(path=data))
    command = [sys.executable, "-m", "blockloop.evals.lm_eval_cli", "run", "--model", "blockloop", "--tasks",
               "local_piqa", "--include_path", str(tmp_path), "--num_fewshot", "0", "--output_path", str(tmp_path / "out")]
    done = subprocess.run([*command, "--model_args", f"checkpoint={tiny_run},device=cpu"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (written,) = (tmp_path / "out").rglob("results_*.json")
    theirs = json.loads(written.read_text())["results"]["local_piqa"]
    from lm_eval.tasks import TaskManager

    api = lm_eval.simple_evaluate(model="blockloop", model_args=f"checkpoint={tiny_run},device=cpu", tasks=["local_piqa"],
                                  num_fewshot=0, task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False))
    for metric in ("acc,none", "acc_norm,none"):
        assert theirs[metric] == pytest.approx(api["results"]["local_piqa"][metric], abs=1e-12)
    missing = subprocess.run([*command, "--model_args", f"checkpoint={tmp_path / 'nowhere'},device=cpu"], capture_output=True,
                             text=True, timeout=300)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr[-2000:]
    assert missing.stderr.strip().splitlines()[-1].startswith("lm-eval (blockloop model): error: checkpoint not found")


def test_answers_too_long_are_refused_per_task_before_any_scoring(byte_model, monkeypatch):
    from blockloop.errors import BlockloopError
    from blockloop.evals import lm_eval_bridge

    model, tok = byte_model
    monkeypatch.setattr(lm_eval_bridge, "score", lambda *a, **k: pytest.fail("scored before the check"))
    asked = [("short_task", "Q:", " yes"), ("long_task", "Q:", " y" * 200), ("long_task", "Q:", " no")]
    requests = [type("R", (), {"args": (c, x), "task_name": t})() for t, c, x in asked]
    with pytest.raises(BlockloopError, match=r"^long_task: 1 of its 2 requests have an answer too long to fit the "
                       r"model context of 256 tokens \(the longest: 400\)"):
        BlockloopLM(model=model, tokenizer=tok).loglikelihood(requests)


def test_rolling_log_likelihood_and_greedy_generation(byte_model):
    model, tok = byte_model
    lm = BlockloopLM(model=model, tokenizer=tok)
    text = "To be, or not to be, that is the question. " * 8  # longer than one 256-token window
    (total,) = lm.loglikelihood_rolling([type("R", (), {"args": (text,)})()])
    ids = [tok.eos_id] + tok.encode(text)
    expected = 0.0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, 256):  # disjoint windows, each conditioned on what precedes it
            n = min(256, len(ids) - 1 - start)
            window = torch.tensor([ids[max(0, start + 1 + n - 257) : start + 1 + n]])
            logp = torch.log_softmax(model(window[:, :-1])[0], -1)[0]
            expected += logp[-n:].gather(1, window[0, -n:, None]).sum().item()
    assert total == pytest.approx(expected, rel=1e-5)
    (text_out,) = lm.generate_until([type("R", (), {"args": ("ROMEO:", {"until": ["\n"], "max_gen_toks": 12})})()])
    assert "\n" not in text_out and len(tok.encode(text_out)) <= 12
    # an empty stop string stops nothing (lm-eval's models skip it) rather than failing the whole run
    (unstopped,) = lm.generate_until([type("R", (), {"args": ("ROMEO:", {"until": ["", "\n"], "max_gen_toks": 12})})()])
    assert unstopped == text_out
    # a batch decodes together and each answer is its greedy continuation alone, cut at its first stop string
    asked = [("ROMEO:", ["\n"], 12), ("To be", [" ", "e"], 20), ("", ["zzz"], 5), ("JULIET: O", [], 9)]
    answers = BlockloopLM(model=model, tokenizer=tok, batch_size=3).generate_until(
        [type("R", (), {"args": (context, {"until": until, "max_gen_toks": n})})() for context, until, n in asked])
    for (context, until, n), answer in zip(asked, answers, strict=True):
        (alone,) = generate(model, [tok.encode(context) or [tok.eos_id]], n, temperature=0.0, eos_id=tok.eos_id)
        text = tok.decode(alone)
        cuts = [text.index(stop) for stop in until if stop in text]
        assert answer == (text[: min(cuts)] if cuts else text)


def test_loops_are_checked_and_generation_refuses_a_fixed_exit():
    from blockloop.errors import BlockloopError

    torch.manual_seed(0)
    tok = ByteTokenizer()
    model = build_model(small_variant("tiny-recursive").replace(vocab_size=tok.vocab_size, padded_vocab_size=320)).eval()
    asked = [type("R", (), {"args": ("The cat", " sat")})()]
    first, last = (BlockloopLM(model=model, tokenizer=tok, loops=k).loglikelihood(asked) for k in (1, "2"))
    assert last == BlockloopLM(model=model, tokenizer=tok).loglikelihood(asked) and first != last
    for loops, says in (("0", r"loops=0 is not one of the model's loops \(1..2\)"), ("3", r"loops=3 is not one of"),
                        ("-1", "not a loop number"), ("x", "not a loop number")):
        with pytest.raises(BlockloopError, match=says):  # model_args' words, not eval's --loops
            BlockloopLM(model=model, tokenizer=tok, loops=loops)
    plain = build_model(small_variant("tiny").replace(vocab_size=tok.vocab_size, padded_vocab_size=320)).eval()
    with pytest.raises(BlockloopError, match=r"loops=1 is not one of the model's loops \(it has none; leave loops out"):
        BlockloopLM(model=plain, tokenizer=tok, loops=1)
    with pytest.raises(BlockloopError, match="needs checkpoint=RUN"):
        BlockloopLM(device="cpu", batch_size=4)  # lm_eval.simple_evaluate(model="blockloop") without model_args
    with pytest.raises(BlockloopError, match="batch_size=0 must be at least 1"):
        BlockloopLM(model=model, tokenizer=tok, batch_size=0)
    with pytest.raises(BlockloopError, match="generation runs the whole model"):
        BlockloopLM(model=model, tokenizer=tok, loops=1).generate_until(
            [type("R", (), {"args": ("The cat", {"until": ["\n"], "max_gen_toks": 4})})()])


def test_rolling_log_likelihood_of_an_encoder_decoder_starts_from_an_empty_encoder():
    torch.manual_seed(0)
    tok = ByteTokenizer()
    model = build_model(small_variant("tiny-encdec").replace(vocab_size=tok.vocab_size, padded_vocab_size=320)).double().eval()
    text = "To be, or not to be."
    (total,) = BlockloopLM(model=model, tokenizer=tok).loglikelihood_rolling([type("R", (), {"args": (text,)})()])
    ids = [tok.eos_id] + tok.encode(text)
    with torch.no_grad():  # one window: nothing before the text, so the decoder reads it all after an empty encoder
        logits, _ = model(torch.zeros(1, 0, dtype=torch.long), decoder_idx=torch.tensor([ids[:-1]]))
    expected = torch.log_softmax(logits[0], -1).gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
    assert total == pytest.approx(expected, abs=1e-9)


def test_a_model_that_reads_a_bos_gets_it_in_rolling_windows_and_generation_prompts():
    """Rolling log-likelihood starts from the BOS (lm-eval's prefix token, and the bridge's own empty-context
    loglikelihood), and generation prompts start with it, as `blockloop generate` reads them."""
    import tokenizers
    from tokenizers import models

    import blockloop.evals.lm_eval_bridge as bridge
    from blockloop.config import DecoderConfig
    from blockloop.data.tokenizers import HFTokenizer

    words = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<eos>", "<bos>", "the", "cat", "sat"])},
                                                  unk_token="<eos>"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = HFTokenizer(words, "words", eos_id=0, bos_id=1, add_bos=True)
    torch.manual_seed(0)
    model = build_model(DecoderConfig(vocab_size=5, context_length=32, n_layer=1, n_head=2, d_model=16)).double().eval()
    lm = BlockloopLM(model=model, tokenizer=tok)
    ((empty_context, _),) = lm.loglikelihood([type("R", (), {"args": ("", "the cat sat")})()])
    (rolling,) = lm.loglikelihood_rolling([type("R", (), {"args": ("the cat sat",)})()])
    assert rolling == pytest.approx(empty_context, abs=1e-12)
    prompts = []
    real = bridge.Engine.submit
    try:
        bridge.Engine.submit = lambda engine, p, n, **kw: (prompts.append(list(p)), real(engine, p, n, **kw))[1]
        lm.generate_until([type("R", (), {"args": ("the cat sat " * 20, {"until": ["\n"], "max_gen_toks": 4})})()])
    finally:
        bridge.Engine.submit = real
    assert prompts[0][0] == 1 and prompts[0][1:] == tok.encode("the cat sat " * 20)[-(len(prompts[0]) - 1):]


def test_requests_sharing_a_context_are_scored_batch_size_at_a_time(byte_model, monkeypatch):
    """lm-eval's acc_mutual_info asks ("", choice) for every choice of every document: one context shared by
    thousands of requests must still go through forwards of at most batch_size groups of batch_size rows."""
    from blockloop.evals import scoring

    model, tok = byte_model
    asked = [type("R", (), {"args": ("" if i % 3 else "Q:", f" answer {i}")})() for i in range(40)]
    expected = BlockloopLM(model=model, tokenizer=tok, batch_size=64).loglikelihood(asked)
    rows, real = [], scoring.LAYOUTS["cached"]
    monkeypatch.setitem(scoring.LAYOUTS, "cached", lambda m, groups, exits: (
        rows.append(sum(map(len, groups))), real(m, groups, exits))[1])
    got = BlockloopLM(model=model, tokenizer=tok, batch_size=2).loglikelihood(asked)
    assert max(rows) <= 4 and sum(rows) == len(asked)
    assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in expected], abs=1e-9)
    assert [g for _, g in got] == [g for _, g in expected]
