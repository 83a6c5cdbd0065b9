"""Recursive and Relaxed Recursive Transformers: tying orders, shared storage, conversion inits, LoRA and
prefix relaxation, per-row loops, cached = uncached, early-exit and distillation losses, CLI round trip."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from blockloop.cli import EXIT_USER_ERROR, main
from blockloop.convert.to_recursive import shared_layer_sources, vanilla_to_recursive
from blockloop.errors import BlockloopError, ConfigError
from blockloop.families import build_model, from_name
from blockloop.models.recursive import layer_order
from blockloop.nn.distill import forward_kl
from blockloop.nn.lora import LoopLoRALinear
from blockloop.serve.generate import generate
from blockloop.serve.runners import runner_for
from blockloop.train.distill import Distillation


def vanilla(n_layer=4, mlp="swiglu", perturb_norms=False):
    """A tiny full-size decoder in float64 with non-trivial weights."""
    torch.manual_seed(0)
    model = build_model(from_name("tiny", n_layer=n_layer, mlp=mlp, bias=mlp == "gelu")).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.add_(0.02 * torch.randn_like(p))
            elif perturb_norms or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def tokens(batch=2, length=12, seed=1):
    return torch.randint(0, 258, (batch, length), generator=torch.Generator().manual_seed(seed))


def recursive(**overrides):
    torch.manual_seed(0)
    return build_model(from_name("tiny-recursive", **overrides)).double().eval()


# ---------------------------------------------------------------- tying (appendix D)
def test_tying_strategies_execution_orders():
    assert layer_order(3, 2, "cycle") == [0, 1, 2, 0, 1, 2]
    assert layer_order(3, 2, "sequence") == [0, 0, 1, 1, 2, 2]
    assert layer_order(3, 2, "cycle_rev") == [0, 1, 2, 2, 1, 0]
    assert layer_order(2, 3, "cycle_rev") == [0, 1, 0, 1, 1, 0]


@pytest.mark.parametrize("tying", ["cycle", "sequence", "cycle_rev"])
def test_forward_runs_the_shared_layers_in_the_tying_order(tying):
    model = recursive(n_layer=3, loops=2, tying=tying)
    calls = []
    hooks = [b.register_forward_hook(lambda m, i, o, j=j: calls.append(j)) for j, b in enumerate(model.body.blocks)]
    model(tokens())
    for h in hooks:
        h.remove()
    assert calls == layer_order(3, 2, tying)


def test_tied_layers_share_storage_and_parameters_count_once():
    model = recursive(n_layer=2, loops=3, lora_rank=0)
    flat = build_model(from_name("tiny", n_layer=2)).double()
    assert len(model.body.blocks) == 2
    assert model.num_parameters() == flat.num_parameters()  # 6 looped layers cost 2 layers of weights
    # The same tensors are used at every depth position: hook the weight seen at each call.
    seen = []
    hook = model.body.blocks[0].attn.qkv.register_forward_pre_hook(lambda m, i: seen.append(m.weight.data_ptr()))
    model(tokens())
    hook.remove()
    assert len(seen) == 3 and len(set(seen)) == 1
    state = model.state_dict()
    assert all(".blocks.2." not in k for k in state)  # nothing stored per loop
    cache = model.allocate_cache(2, 16)
    assert len(cache.layers) == 6  # but each depth position caches its own keys/values


# --------------------------------------------------------- generation and per-row loops
@pytest.mark.parametrize("overrides", [{}, {"lora_rank": 4}, {"prefix_len": 3}, {"tying": "sequence", "n_layer": 2}])
def test_cached_generation_equals_the_full_forward(overrides):
    model = recursive(**overrides)
    if overrides.get("lora_rank"):
        with torch.no_grad():
            for lora in model.lora_layers():
                lora.lora_B.normal_(0, 0.1)  # non-zero deltas, so each loop really differs
    idx = tokens(length=20)
    full, _ = model(idx)
    runner = runner_for(model)
    runner.allocate(2, 20)
    steps = [runner.prefill_batch(idx[:, :6], torch.ones(2, 6, dtype=torch.bool))]
    for t in range(6, 19):
        steps.append(runner.decode_step(idx[:, t]))
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 5:19], atol=1e-10, rtol=1e-10)


def test_left_padded_batch_generates_like_each_prompt_alone():
    model = recursive(lora_rank=2, prefix_len=2)
    prompts = [[5, 6, 7, 8, 9], [11, 12]]
    batched = generate(model, prompts, 6, temperature=0)
    alone = [generate(model, [p], 6, temperature=0)[0] for p in prompts]
    assert batched == alone


def test_generate_serves_depth_wise_with_an_exit_rule():
    """generate() and `generate --exit` batch a looped model depth-wise as serve and chat do: without exits it is
    the full-depth answer; with every token leaving after loop 1, the answer of the first loop's exit head."""
    from blockloop.serve.runners import ExitRule

    model = recursive(loops=3)
    prompts = [[5, 6, 7, 8, 9], [11, 12]]
    assert generate(model, prompts, 6, temperature=0, exit_rule=ExitRule("none")) == generate(model, prompts, 6,
                                                                                              temperature=0)
    first_loop = []
    for prompt in prompts:  # greedy from loop 1's exit logits, re-reading the whole sequence each token
        idx = torch.tensor([prompt])
        for _ in range(6):
            nxt = model.loop_logits(idx)[0][:, -1, :model.config.vocab_size].argmax(-1, keepdim=True)
            idx = torch.cat([idx, nxt], 1)
        first_loop.append(idx[0, len(prompt):].tolist())
    assert generate(model, prompts, 6, temperature=0, exit_rule=ExitRule("max_prob", 0.0)) == first_loop


@pytest.mark.parametrize("overrides", [{"lora_rank": 3}, {"prefix_len": 2}, {"lora_rank": 2, "prefix_len": 2}])
def test_rows_at_different_loops_in_one_call_equal_each_loop_run_alone(overrides):
    model = recursive(loops=3, **overrides)
    with torch.no_grad():
        for lora in model.lora_layers():
            lora.lora_B.normal_(0, 0.1)
    x = torch.randn(4, 7, 64, dtype=torch.float64)
    loops = torch.tensor([2, 0, 1, 0])
    inputs = model.loop_inputs(x)
    batched = model.run_loop(x, loops, inputs)
    for row, loop in enumerate(loops.tolist()):
        alone = model.run_loop(x[row : row + 1], loop, inputs)
        torch.testing.assert_close(batched[row : row + 1], alone, atol=1e-12, rtol=1e-12)


def test_per_row_loops_need_cycle_tying():
    model = recursive(n_layer=2, tying="sequence")
    x = torch.randn(2, 3, 64, dtype=torch.float64)
    with pytest.raises(ValueError, match="cycle"):
        model.run_loop(x, torch.tensor([0, 1]), model.loop_inputs(x))


# --------------------------------------------------------------- conversion (section 2.2)
def test_shared_layer_sources_of_each_init():
    order = layer_order(3, 2, "cycle")
    assert shared_layer_sources(6, 2, "stepwise", order) == [[0], [3], [5]]  # first and last kept
    assert shared_layer_sources(30, 2, "stepwise", layer_order(15, 2, "cycle"))[-1] == [29]
    assert shared_layer_sources(6, 2, "average", order) == [[0, 3], [1, 4], [2, 5]]
    assert shared_layer_sources(6, 2, "average", layer_order(3, 2, "sequence")) == [[0, 1], [2, 3], [4, 5]]
    assert shared_layer_sources(6, 2, "lower", order) == [[0], [1], [2]]
    assert shared_layer_sources(6, 2, "upper", order) == [[3], [4], [5]]


@pytest.mark.parametrize("init", ["stepwise", "average", "lower", "upper"])
def test_one_loop_is_the_original_model(init):
    full = vanilla(n_layer=3, perturb_norms=True)
    idx = tokens()
    converted = vanilla_to_recursive(full, loops=1, init=init)
    torch.testing.assert_close(converted(idx)[0], full(idx)[0], atol=1e-12, rtol=1e-12)


def test_stepwise_average_and_lower_copy_the_right_weights():
    full = vanilla(n_layer=4, perturb_norms=True)
    w = [b.attn.qkv.weight for b in full.body.blocks]
    stepwise = vanilla_to_recursive(full, loops=2, init="stepwise")
    assert torch.equal(stepwise.body.blocks[0].attn.qkv.weight, w[0])
    assert torch.equal(stepwise.body.blocks[1].attn.qkv.weight, w[3])
    average = vanilla_to_recursive(full, loops=2, init="average")
    torch.testing.assert_close(average.body.blocks[1].attn.qkv.weight, (w[1] + w[3]) / 2)
    gains = [full.body.blocks[i].norm1.weight for i in (0, 2)]  # per loop: the gain of the layer it replaces
    assert torch.equal(average.body.blocks[0].norm1.weight, torch.stack(gains))
    tied = vanilla_to_recursive(full, loops=2, init="average", loop_norms=False)
    torch.testing.assert_close(tied.body.blocks[0].norm1.weight, (gains[0] + gains[1]) / 2)
    lower = vanilla_to_recursive(full, loops=2, init="lower")
    assert torch.equal(lower.body.blocks[1].mlp.proj.weight, full.body.blocks[1].mlp.proj.weight)
    assert torch.equal(lower.embed.weight, full.embed.weight) and torch.equal(lower.norm.weight, full.norm.weight)


@pytest.mark.parametrize("init", ["stepwise", "average", "lower", "upper"])
@pytest.mark.parametrize("tying", ["cycle", "sequence", "cycle_rev"])
def test_full_rank_svd_lora_reproduces_the_original_logits(init, tying):
    full = vanilla(n_layer=4)  # norms at identity: equation 4's residual is the whole difference
    idx = tokens()
    relaxed = vanilla_to_recursive(full, loops=2, init=init, tying=tying, lora_rank=64, lora_alpha=16.0)
    torch.testing.assert_close(relaxed(idx)[0], full(idx)[0], atol=1e-9, rtol=1e-9)


def delta_weight(lora, loop: int) -> torch.Tensor:
    """The (out, in) weight delta a LoRA adds at ``loop``, read through its forward (bias delta removed)."""
    eye = torch.eye(lora.in_features, dtype=lora.weight.dtype)
    return (lora.delta(eye[None], loop)[0] - lora.delta(0 * eye[None, :1], loop)[0]).T


def best_rank(matrix: torch.Tensor, r: int) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    return (u[:, :r] * s[:r]) @ vh[:r]  # Eckart-Young: the best rank-r approximation


def test_svd_init_folds_the_lora_scaling_and_zero_inits_where_weights_already_match():
    full = vanilla(n_layer=4)
    relaxed = vanilla_to_recursive(full, loops=2, init="stepwise", lora_rank=8, lora_alpha=32.0)
    proj = relaxed.body.blocks[1].attn.proj  # shared layer 1 = full layer 3 (stepwise); loop 0 is full layer 1
    assert proj.scaling == 4.0
    assert torch.count_nonzero(proj.lora_B[1]) == 0 and torch.count_nonzero(proj.lora_A[1]) > 0  # equal: zero init
    residual = full.body.blocks[1].attn.proj.weight - proj.weight
    torch.testing.assert_close(delta_weight(proj, 0), best_rank(residual, 8), atol=1e-10, rtol=1e-8)


def test_the_fused_projection_relaxes_w_q_w_k_and_w_v_each_at_the_rank():
    """Equation 4 per shared matrix, as the paper relaxes W^Q, W^K and W^V: each block of rows of the fused q/k/v
    weight gets its own best rank-r delta, a closer fit than one rank-r delta over the stacked weight."""
    full = vanilla(n_layer=4)
    relaxed = vanilla_to_recursive(full, loops=2, init="average", lora_rank=4)
    qkv = relaxed.body.blocks[0].attn.qkv  # loop 1 relaxes it towards full layer 2
    assert len(qkv.splits) == 3 and qkv.ranks == (4, 4, 4) and qkv.lora_A.shape[1] == 12
    residual = full.body.blocks[2].attn.qkv.weight - qkv.weight
    per_matrix = torch.cat([best_rank(residual[m.rows], 4) for m in qkv.matrices()])
    torch.testing.assert_close(delta_weight(qkv, 1), per_matrix, atol=1e-10, rtol=1e-8)
    assert (residual - per_matrix).norm() < 0.99 * (residual - best_rank(residual, 4)).norm()


def test_error_of_svd_init_falls_as_rank_grows():
    full = vanilla(n_layer=4)
    idx = tokens()
    weight_errors, logit_errors = [], []
    for rank in (1, 8, 32, 64):
        model = vanilla_to_recursive(full, loops=2, init="average", lora_rank=rank)
        qkv = model.body.blocks[0].attn.qkv  # loop 1 relaxes it towards full layer 2
        approx = qkv.weight + delta_weight(qkv, 1)
        weight_errors.append((approx - full.body.blocks[2].attn.qkv.weight).norm().item())
        logit_errors.append((model(idx)[0] - full(idx)[0]).abs().max().item())
    assert all(a > b for a, b in itertools.pairwise(weight_errors)), weight_errors
    assert logit_errors[-1] < 1e-9 < logit_errors[0]


def test_full_rank_relaxes_the_biases_too():
    full = vanilla(n_layer=4, mlp="gelu")  # perturbed biases differ between the tied layers
    idx = tokens()
    relaxed = vanilla_to_recursive(full, loops=2, init="average", lora_rank=64)
    fc = relaxed.body.blocks[0].mlp.fc
    torch.testing.assert_close(fc.bias + fc.lora_bias[1], full.body.blocks[2].mlp.fc.bias, atol=1e-15, rtol=0)
    torch.testing.assert_close(relaxed(idx)[0], full(idx)[0], atol=1e-9, rtol=1e-9)


def test_rank_zero_and_zero_init_lora_equal_the_plain_recursive_model():
    full = vanilla(n_layer=4)
    idx = tokens()
    plain = vanilla_to_recursive(full, loops=2, init="average")
    zero = vanilla_to_recursive(full, loops=2, init="average", lora_rank=4, lora_init="zero")
    assert plain.config.lora_rank == 0 and not plain.lora_layers()
    torch.testing.assert_close(zero(idx)[0], plain(idx)[0], atol=0, rtol=0)
    assert zero.num_parameters() > plain.num_parameters()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"loops": 3}, "--loops 3 does not divide the model's 4 layers"),
        ({"loops": 0}, r"--loops 0 is not a loop count; choose one of \[1, 2, 4\]"),
        ({"loops": 2, "lora_rank": 65}, "exceeds the rank"),
        ({"loops": 2, "init": "middle"}, "unknown looped-layer init 'middle'"),
        ({"loops": 2, "tying": "zigzag"}, "tying strategy 'zigzag' is unknown"),
        ({"loops": 2, "lora_rank": 2, "lora_init": "pissa"}, "unknown LoRA init 'pissa'"),
    ],
)
def test_impossible_conversions_raise_clear_errors(kwargs, message):
    with pytest.raises(BlockloopError, match=message):
        vanilla_to_recursive(vanilla(n_layer=4), **kwargs)


def test_config_validation():
    with pytest.raises(ConfigError, match="exit_loss 'sum' is unknown"):
        from_name("tiny-recursive", exit_loss="sum")
    with pytest.raises(ConfigError, match="loops must be at least 1"):
        from_name("tiny-recursive", loops=0)


def test_loss_and_lora_weights_the_model_never_reads_are_refused():
    """A config (``--set``, a config.json) may not carry a weight its model ignores: it would be saved with the run
    as if it had trained the model."""
    with pytest.raises(ConfigError, match="exit_kd_weight=0.5 weighs the early-exit loss's distillation, and "):
        from_name("tiny-recursive", exit_kd_weight=0.5)
    with pytest.raises(ConfigError, match="lora_alpha=16.0 scales LoRA modules, and lora_rank=0 adds none"):
        from_name("tiny-recursive", lora_alpha=16.0)
    assert from_name("tiny-recursive", exit_loss="weighted", exit_kd_weight=0.5).exit_kd_weight == 0.5
    with pytest.raises(ConfigError, match="exit_coefficient=0.3 weighs the intermediate loops of the aggressive"):
        from_name("tiny-recursive", exit_loss="weighted", exit_coefficient=0.3)
    with pytest.raises(ConfigError, match="exit_loss='weighted' trains the exits after loops 1 .. B-1, which loops=1"):
        from_name("tiny-recursive", loops=1, exit_loss="weighted")
    # Each shared weight takes min(rank, in, out): past the widest full rank (64 here) a rank only misleads.
    with pytest.raises(ConfigError, match=r"lora_rank=65 exceeds the rank .* is 64, full rank\); give at most 64"):
        from_name("tiny-recursive", lora_rank=65)
    assert from_name("tiny-recursive", lora_rank=64).lora_rank == 64
    assert from_name("tiny-recursive", lora_rank=2, lora_alpha=16.0).lora_scaling == 8.0


# ------------------------------------------------------- early exit and distillation (3.7, M)
def test_early_exit_weights():
    weighted = recursive(loops=3, exit_loss="weighted").exit_weights()
    assert weighted == pytest.approx([1 / 6, 2 / 6, 3 / 6]) and sum(weighted) == pytest.approx(1.0)
    assert recursive(loops=3, exit_loss="aggressive", exit_coefficient=0.1).exit_weights() == [0.1, 0.1, 1.0]


def test_early_exit_loss_combines_every_loop_and_trains_intermediate_exits():
    idx = tokens()
    model = recursive(loops=2, exit_loss="aggressive", exit_coefficient=0.25)
    logits = model.loop_logits(idx)
    expected = 0.25 * model.loss(logits[0], idx) + model.loss(logits[1], idx)
    _, loss = model(idx, idx)
    torch.testing.assert_close(loss, expected)
    # The first exit's loss reaches the shared block through loop 1 only: its gradient is non-zero.
    model.zero_grad()
    model.loss(model.loop_logits(idx)[0], idx).backward()
    assert model.body.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
    # KD from the detached final loop adds weight * KL for intermediate loops and leaves the final loop alone.
    kd = recursive(loops=2, exit_loss="aggressive", exit_coefficient=0.25, exit_kd_weight=2.0)
    _, kd_loss = kd(idx, idx)
    torch.testing.assert_close(kd_loss, expected + 0.25 * 2.0 * forward_kl(logits[1], logits[0], idx))
    kd.zero_grad()
    kd_loss.backward()
    assert all(p.grad is not None for p in kd.parameters())


def test_kd_is_zero_when_student_equals_teacher_and_positive_otherwise():
    model = recursive()
    idx = tokens()
    logits, loss = model(idx, idx)
    hook = Distillation(model, weight=0.5)
    torch.testing.assert_close(hook({"idx": idx, "targets": idx}, logits, loss), loss, atol=1e-12, rtol=0)
    other = recursive(loops=3)
    assert hook({"idx": idx, "targets": idx}, other(idx)[0], loss) > loss
    assert not any(p.requires_grad for p in model.parameters())  # the teacher is frozen


# --------------------------------------------------------------- CLI round trip and training
TRAIN = ["--steps", "16", "--batch-size", "4", "--seq-len", "32", "--warmup-steps", "2", "--lr", "3e-3",
         "--log-interval", "4", "--eval-interval", "16", "--eval-batches", "2", "--ckpt-interval", "16",
         "--device", "cpu", "--no-progress"]


def losses(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("recursive") / "teacher"
    assert main(["train", "--preset", "tiny", "--set", "n_layer=4", *TRAIN, "--out", str(out)]) == 0
    return out


def test_convert_uptrain_with_distillation_and_evaluate_per_loop(teacher_run, tmp_path, capsys):
    converted = tmp_path / "relaxed"
    assert main(["convert", "--to", "recursive", "--checkpoint", str(teacher_run), "--out", str(converted),
                 "--loops", "2", "--init", "average", "--lora-rank", "8"]) == 0
    assert "uptrain with" in capsys.readouterr().out
    run = tmp_path / "uptrained"
    assert main(["train", "--init-from", str(converted), *TRAIN, "--distill-from", str(teacher_run),
                 "--distill-weight", "0.5", "--early-exit", "aggressive", "--exit-kd-weight", "1.0",
                 "--out", str(run)]) == 0
    started = capsys.readouterr().out
    assert (f"parameters, aggressive early-exit loss (coefficient 0.1) with exit distillation weight 1, distilling from "
            f"{teacher_run.resolve()}") in started, started
    curve = losses(run)
    assert curve[-1] < curve[0]
    saved = json.loads((run / "checkpoints" / "step_0000016" / "config.json").read_text())
    assert saved["family"] == "recursive" and saved["exit_loss"] == "aggressive" and saved["lora_rank"] == 8
    state = json.loads((run / "checkpoints" / "step_0000016" / "train_state.json").read_text())
    # pinned: the teacher's checkpoint folder at the start, by absolute path (not the run's moving `latest`)
    assert state["train_config"]["distill_from"] == str((teacher_run / "checkpoints" / "step_0000016").resolve())
    from safetensors import safe_open

    with safe_open(str(run / "checkpoints" / "step_0000016" / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert not any("teacher" in n for n in names) and len([n for n in names if "blocks." in n and "qkv.weight" in n]) == 2
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--per-loop", "--max-batches", "2", "--device", "cpu", "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    loops = metrics["loops"]
    assert [r["loop"] for r in loops] == [1, 2] and loops[-1]["agreement"] == 1.0
    assert sum(r["oracle_exit_share"] for r in loops) == pytest.approx(1.0)
    assert 1.0 <= metrics["mean_exit_loop"] <= 2.0
    # Going on from it: --early-exit none drops the exit loss with its distillation term (it was refused, naming an
    # exit_kd_weight no flag could clear), and a kept distillation weight is named in the start line.
    short = ["--steps", "1", "--eval-interval", "1", "--ckpt-interval", "1", "--no-progress"]
    assert main(["train", "--init-from", str(run), "--early-exit", "none", *short, "--out", str(tmp_path / "plain")]) == 0
    plain = json.loads((tmp_path / "plain" / "checkpoints" / "step_0000001" / "config.json").read_text())
    assert (plain["exit_loss"], plain["exit_kd_weight"]) == ("none", 0.0)
    capsys.readouterr()
    assert main(["train", "--init-from", str(run), "--early-exit", "weighted", *short, "--out", str(tmp_path / "w")]) == 0
    assert "weighted early-exit loss with exit distillation weight 1)" in capsys.readouterr().out


def test_a_distilling_run_whose_pinned_teacher_is_gone_names_it_again_on_resume(teacher_run, tmp_path, capsys):
    """The teacher's run keeps only its newest checkpoints: training it on removes the folder a student pinned,
    and the student could not be resumed at all (the teacher was "not found", --distill-from refused)."""
    import shutil

    teacher = shutil.copytree(teacher_run, tmp_path / "teacher")
    short = [*TRAIN, "--steps", "2", "--eval-interval", "2", "--ckpt-interval", "2"]
    run = tmp_path / "student"
    assert main(["train", "--preset", "tiny", "--distill-from", str(teacher), *short, "--out", str(run)]) == 0
    moved = teacher.rename(tmp_path / "teacher-moved")
    capsys.readouterr()
    assert main(["train", "--resume", "--steps", "4", "--no-progress", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"the teacher this run distils from, {teacher.resolve()}/checkpoints/step_0000016, is gone" in err
    assert "train --resume --distill-from TEACHER_RUN" in err
    assert main(["train", "--resume", "--steps", "4", "--no-progress", "--distill-from", str(moved), "--out", str(run)]) == 0
    state = json.loads((run / "checkpoints" / "step_0000004" / "train_state.json").read_text())
    assert state["train_config"]["distill_from"] == str((moved / "checkpoints" / "step_0000016").resolve())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("step") == 4 and "loss" in r for r in rows)  # the resumed steps trained
    # while the pinned teacher is there, another one would change the loss mid-run: refused, the same one is not
    other = shutil.copytree(teacher_run, tmp_path / "other-teacher")
    assert main(["train", "--resume", "--steps", "5", "--no-progress", "--distill-from", str(other), "--out", str(run)]) == 2
    assert f"distils from the run's own teacher, {(moved / 'checkpoints' / 'step_0000016').resolve()}, which is still " \
        "there; drop --distill-from" in capsys.readouterr().err
    # a run written before distillation had its own fields holds its teacher in train_config's "extra": it resumes
    for saved in (run / "checkpoints").glob("*/train_state.json"):
        old = json.loads(saved.read_text())
        config = old["train_config"]
        config["extra"] = {"distill_from": config.pop("distill_from"), "distill_weight": config.pop("distill_weight")}
        saved.write_text(json.dumps(old))
    assert main(["train", "--resume", "--steps", "5", "--no-progress", "--out", str(run)]) == 0
    resumed = json.loads((run / "checkpoints" / "step_0000005" / "train_state.json").read_text())["train_config"]
    assert "extra" not in resumed and resumed["distill_weight"] == 1.0
    assert resumed["distill_from"] == str((moved / "checkpoints" / "step_0000016").resolve())
    assert main(["train", "--resume", "--steps", "5", "--no-progress", "--distill-from", str(moved), "--out", str(run)]) == 0
    assert main(["train", "--resume", "--steps", "6", "--no-progress", "--distill-weight", "5", "--out", str(run)]) == 2
    assert "drop --distill-weight" in capsys.readouterr().err  # not "add --distill-from": the run has its teacher
    # a run that does not distill is not turned into one on resume
    assert main(["train", "--resume", "--steps", "6", "--no-progress", "--distill-from", str(moved),
                 "--out", str(teacher_run)]) == 2
    assert "--resume continues the saved run with its own model, data, order and loss; drop --distill-from" in capsys.readouterr().err
    assert main(["train", "--resume", "--out", str(tmp_path / "nothing-here")]) == 2
    assert "--out " + str(tmp_path / "nothing-here") + " holds no run to resume; drop --resume" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--preset", "tiny-block"], "the student (block family) does not predict the next token at each position"),
    (["--preset", "tiny-encdec"], "the student (encoder_decoder family) does not predict the next token"),
    (["--preset", "tiny", "--tokenizer", "bpe:300"], "reads text with tokenizer byte, the student with bpe:300"),
    (["--preset", "demo", "--seq-len", "200"], "has a context of 128 tokens, shorter than the --seq-len 200"),
])
def test_a_teacher_the_student_cannot_read_alike_is_refused_before_training(teacher_run, tmp_path, capsys, argv, says):
    """A KL between other tokens or other positions would train on without a word."""
    train = [a for a in TRAIN if a not in ("--seq-len", "32")] if "--seq-len" in argv else TRAIN
    assert main(["train", *argv, *train, "--distill-from", str(teacher_run), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # (a BPE run logs its tokenizing first)
    assert says in err[-1] and sum("error" in line for line in err) == 1, err
    assert not (tmp_path / "x" / "checkpoints").exists()


def test_recursive_preset_trains_and_its_loss_falls(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny-recursive", *TRAIN, "--out", str(run)]) == 0
    curve = losses(run)
    assert curve[-1] < curve[0] - 0.3


def test_cli_errors_are_one_line(teacher_run, tmp_path, capsys):
    for argv, match in [
        (["--loops", "3"], "does not divide"),
        (["--lora-rank", "1000"], "exceeds the rank"),
        (["--init", "middle"], "argument --init: invalid choice: 'middle'"),
        (["--strategy", "zigzag"], "argument --strategy: invalid choice: 'zigzag'"),
        (["--lora-rank", "2", "--lora-init", "pissa"], "argument --lora-init: invalid choice: 'pissa'"),
        (["--relax", "prefix"], "--relax prefix needs --prefix-len"),
        (["--loops", "1", "--strategy", "sequence", "--lora-rank", "8"],
         "--strategy, --lora-rank do not apply to --loops 1 (no layer is shared); leave them out, or give --loops 2"),
    ]:
        code = main(["convert", "--to", "recursive", "--checkpoint", str(teacher_run), "--out", str(tmp_path / "x"), *argv])
        err = capsys.readouterr().err.strip()
        assert code == EXIT_USER_ERROR and len(err.splitlines()) == 1 and match in err, err
    # a bad choice is named before an --out that is taken: one fix at a time, not one error hiding the next
    code = main(["convert", "--to", "recursive", "--checkpoint", str(teacher_run), "--out", str(teacher_run),
                 "--init", "middle"])
    assert code == EXIT_USER_ERROR and "invalid choice: 'middle'" in capsys.readouterr().err
    code = main(["train", "--preset", "tiny", "--early-exit", "weighted", *TRAIN, "--out", str(tmp_path / "y")])
    assert code == EXIT_USER_ERROR and "recursive models" in capsys.readouterr().err


def test_flops_count_the_looped_depth(capsys):
    from blockloop.families import spec_of

    config = from_name("tiny-recursive", loops=3)
    assert spec_of(config).training_flops(config, 64) == spec_of(config.stack(3)).training_flops(config.stack(3), 64)
    assert main(["flops", "--preset", "tiny-recursive"]) == 0
    out = capsys.readouterr().out
    assert "2-layer looped depth" in out and "recursive (tiny-recursive)" in out  # named as itself, not "decoder"


def test_a_config_json_written_before_the_unread_weight_refusals_still_loads():
    """``convert --to recursive --lora-alpha A`` without a rank (or ``--set exit_kd_weight=W``) wrote these before
    the refusals: the model never read them, so the checkpoint loads without them, not refused at load."""
    from blockloop.families import config_from_dict

    saved = {**from_name("tiny-recursive").to_dict(), "lora_alpha": 4.0, "exit_kd_weight": 0.5}
    config = config_from_dict(saved)
    assert config.lora_alpha is None and config.exit_kd_weight == 0.0
    kept = config_from_dict({**saved, "lora_rank": 2, "exit_loss": "weighted"})
    assert kept.lora_alpha == 4.0 and kept.exit_kd_weight == 0.5
    # a run that left the aggressive loss kept its coefficient, unread
    left = config_from_dict({**saved, "exit_loss": "weighted", "exit_coefficient": 0.2})
    assert left.exit_coefficient == 0.1
    # an exit loss on one loop (plain cross-entropy), and a rank past every matrix's full rank (64 here: each took
    # min(rank, in, out)), were accepted: the same model loads, with the same weight shapes and LoRA scaling
    one = config_from_dict({**saved, "loops": 1, "exit_loss": "aggressive", "exit_coefficient": 0.3})
    assert (one.exit_loss, one.exit_kd_weight, one.exit_coefficient) == ("none", 0.0, 0.1)
    for alpha in (None, 50.0):
        wide = {**saved, "lora_rank": 100, "lora_alpha": alpha}
        capped = config_from_dict(wide)
        assert capped.lora_rank == 64 and capped.lora_scaling == pytest.approx((alpha or 100) / 100)
        old_model = build_model(from_name("tiny-recursive", lora_rank=64))  # rank 100 built these shapes too
        assert [p.shape for p in build_model(capped).parameters()] == [p.shape for p in old_model.parameters()]


def test_a_checkpoint_with_one_lora_over_the_fused_projection_loads_as_the_same_model(tmp_path):
    """Checkpoints written before per-matrix LoRA hold one rank-r (A, B) over the stacked q/k/v weight: loading
    rewrites them exactly into W^Q, W^K, W^V's own factors (ranks 4 over a 16-wide key projection here)."""
    from blockloop.train.checkpoint import load_model_state, save_model_files

    model = recursive(lora_rank=4)
    state = model.state_dict()
    fused = {}
    for name, lora in model.named_modules():
        if isinstance(lora, LoopLoRALinear) and len(lora.splits) > 1:
            loops, _, width = lora.lora_A.shape
            a, b = torch.randn(loops, 4, width).double(), 0.1 * torch.randn(loops, lora.out_features, 4).double()
            state[f"{name}.lora_A"], state[f"{name}.lora_B"] = a, b
            fused[name] = [lora.scaling * b[loop] @ a[loop] for loop in range(loops)]
    assert fused  # the model has fused projections to rewrite
    save_model_files(tmp_path, model, model.config, state)
    loaded = build_model(model.config).double()
    load_model_state(tmp_path, loaded)
    for name, deltas in fused.items():
        lora = loaded.get_submodule(name)
        for loop, delta in enumerate(deltas):
            torch.testing.assert_close(delta_weight(lora, loop), delta, atol=1e-12, rtol=1e-10)
