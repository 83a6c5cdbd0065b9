"""The library behind the CLI: what a training request means, early-exit options, conversion targets, reports."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from blockloop.bench.reports import flops_report, preset_sizes
from blockloop.convert.checkpoints import convert_checkpoint, to_recursive_checkpoint
from blockloop.convert.targets import TARGETS
from blockloop.errors import BlockloopError
from blockloop.families import from_name
from blockloop.train import checkpoint as ckpt
from blockloop.train.eval_checkpoint import EvalRequest, evaluate_checkpoint
from blockloop.train.run import load_trained
from blockloop.train.setup import EarlyExit, TrainRequest, apply_early_exit, plan_run, start_training

TINY = dict(steps=2, batch_size=2, seq_len=32, warmup_steps=1, log_interval=1, eval_interval=2, eval_batches=1,
            ckpt_interval=2, device="cpu", progress=False)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("setup") / "run"
    plan = plan_run(TrainRequest(out, preset="tiny", train_overrides=TINY))
    _, trainer = start_training(plan)
    trainer.fit()
    return out


def test_a_fresh_request_takes_the_defaults(tmp_path):
    plan = plan_run(TrainRequest(tmp_path / "run", train_overrides={"steps": 7}, model_overrides={"n_layer": 1}))
    assert (plan.spec.preset, plan.spec.data, plan.spec.tokenizer) == ("demo", "shakespeare", "byte")
    assert plan.spec.model_overrides == {"n_layer": 1} and plan.source is plan.spec
    assert plan.config.steps == 7 and not plan.resume
    with pytest.raises(BlockloopError, match="--task brings its own data"):
        plan_run(TrainRequest(tmp_path / "run", task="random-walk", data="shakespeare"))
    # --dropout sets the embeddings' rate too, as its help says (a preset's own embed_dropout was kept), unless
    # --set embed_dropout gives it apart
    staircase = plan_run(TrainRequest(tmp_path / "run", preset="staircase-reddit", dropout=0.05))
    assert staircase.spec.model_overrides == {"dropout": 0.05, "embed_dropout": 0.05}
    apart = plan_run(TrainRequest(tmp_path / "run", preset="staircase-reddit", dropout=0.05,
                                  model_overrides={"embed_dropout": 0.3}))
    assert apart.spec.model_overrides == {"dropout": 0.05, "embed_dropout": 0.3}
    # from Python: a str folder is a folder, and a misspelt setting is named (both were TypeErrors)
    assert plan_run(TrainRequest(str(tmp_path / "run"), preset="tiny")).out == tmp_path / "run"
    with pytest.raises(BlockloopError, match=r"train_overrides names no training setting stepz; the settings are .*steps"):
        TrainRequest(tmp_path / "run", train_overrides={"stepz": 2})


def test_the_default_seq_len_fits_the_model_context(tmp_path):
    """Without --seq-len a fresh run trains on the default 256-token window, or on the longest whole number of
    blocks / chunks the context holds when that is shorter; a given --seq-len is left to the trainer's check."""
    fields = {k: v for k, v in TINY.items() if k != "seq_len"}
    for preset, expected in (("tiny", 128), ("tiny-block", 128), ("demo", 256)):
        plan = plan_run(TrainRequest(tmp_path / preset, preset=preset, train_overrides=fields))
        assert plan.fit_seq_len
        _, trainer = start_training(plan)
        assert trainer.config.seq_len == expected == min(256, from_name(preset).context_length), preset
    with pytest.raises(BlockloopError, match=r"a training window \(--seq-len\) of 256 tokens exceeds the model context of 128"):
        start_training(plan_run(TrainRequest(tmp_path / "given", preset="tiny", train_overrides={**fields, "seq_len": 256})))


def test_a_run_shorter_than_its_warm_up_is_warned_about(tmp_path, capsys):
    start_training(plan_run(TrainRequest(tmp_path / "short", preset="tiny", train_overrides={**TINY, "warmup_steps": 100})))
    (warning,) = [line for line in capsys.readouterr().err.splitlines() if "warm-up" in line]  # one line
    assert warning.startswith("warning: --steps 2 ends inside the 100-step warm-up") and "peaks at 2e-05" in warning
    start_training(plan_run(TrainRequest(tmp_path / "long", preset="tiny", train_overrides=TINY)))
    assert "warm-up" not in capsys.readouterr().err


def test_resume_continues_the_saved_run_and_refuses_new_model_choices(trained):
    plan = plan_run(TrainRequest(trained, resume=True, train_overrides={"steps": 5}))
    assert plan.resume and plan.spec.preset == "tiny" and plan.config.steps == 5 and plan.config.seq_len == 32
    assert plan.source.init_from is not None and plan.source.init_from.endswith("step_0000002")
    _, trainer = start_training(plan)
    assert trainer.step == 2
    with pytest.raises(BlockloopError, match="--resume continues the saved run with its own model, data, order and loss; drop --preset, --set, --early-exit"):
        plan_run(TrainRequest(trained, resume=True, preset="tiny", model_overrides={"n_layer": 1},
                              early_exit=EarlyExit(exit_loss="weighted")))
    with pytest.raises(BlockloopError, match="model, data, order and loss; drop --objective$"):  # even the run's own
        plan_run(TrainRequest(trained, resume=True, train_overrides={"objective": "lm"}))
    # another seed would reshuffle the epoch the saved position points into: windows seen twice, others never
    with pytest.raises(BlockloopError, match="order and loss; drop --seed$"):
        plan_run(TrainRequest(trained, resume=True, train_overrides={"seed": 3}))
    saved_seed = plan.config.seed
    assert plan_run(TrainRequest(trained, resume=True, train_overrides={"seed": saved_seed})).config.seed == saved_seed
    with pytest.raises(BlockloopError, match="give one of them"):
        plan_run(TrainRequest(trained, resume=True, init_from=str(trained)))
    with pytest.raises(BlockloopError, match="already holds a run"):
        plan_run(TrainRequest(trained))


def test_a_corpus_path_is_saved_absolute_so_the_run_reads_it_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert plan_run(TrainRequest(tmp_path / "r1", data="notes.jsonl")).spec.data == str(tmp_path / "notes.jsonl")
    assert plan_run(TrainRequest(tmp_path / "r2", data="shakespeare")).spec.data == "shakespeare"  # a builtin name


def test_a_resume_reads_a_moved_corpus_from_data_and_checks_it_is_the_same_text(tmp_path):
    """The run saves its corpus by path; after the file moved, --resume names the gap and the fix, --data gives the
    new place (the checkpoint's fingerprint refuses other text), and the resumed run ends as an uninterrupted one."""
    text = "".join(f"line {i} of a corpus that moves between two folders\n" for i in range(400))
    for name in ("old", "whole"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "corpus.txt").write_text(text)
    whole = tmp_path / "whole-run"
    start_training(plan_run(TrainRequest(whole, preset="tiny", data=str(tmp_path / "whole" / "corpus.txt"),
                                         train_overrides={**TINY, "steps": 4})))[1].fit()
    run = tmp_path / "run"

    def killed(step: int, metrics: dict) -> None:
        if step == 3:
            raise KeyboardInterrupt  # after step 3; the last checkpoint is step 2

    with pytest.raises(KeyboardInterrupt):
        start_training(plan_run(TrainRequest(run, preset="tiny", data=str(tmp_path / "old" / "corpus.txt"),
                                             train_overrides={**TINY, "steps": 4})))[1].fit(on_step=killed)
    (tmp_path / "new").mkdir()
    (tmp_path / "old" / "corpus.txt").rename(tmp_path / "new" / "corpus.txt")
    with pytest.raises(BlockloopError, match=r"corpus .*old/corpus.txt is gone; if it moved, name it with --data"):
        plan_run(TrainRequest(run, resume=True, train_overrides={"steps": 4}))
    with pytest.raises(BlockloopError, match="not a task; drop --task-dir"):
        plan_run(TrainRequest(run, resume=True, task_dir=str(tmp_path)))
    (tmp_path / "other.txt").write_text(text.replace("corpus", "CORPUS"))
    with pytest.raises(BlockloopError, match="other.txt is not the data .* was trained on"):
        start_training(plan_run(TrainRequest(run, resume=True, data=str(tmp_path / "other.txt"))))
    plan = plan_run(TrainRequest(run, resume=True, data=str(tmp_path / "new" / "corpus.txt")))
    assert plan.spec.data == str(tmp_path / "new" / "corpus.txt")
    _, trainer = start_training(plan)
    assert trainer.step == 2
    trainer.fit()

    def losses(out: Path) -> list[float]:
        return [m.get("loss", m.get("val_loss")) for m in ckpt.read_metrics(out / "metrics.jsonl")]

    assert [m["step"] for m in ckpt.read_metrics(run / "metrics.jsonl")] == [1, 2, 2, 3, 4, 4]  # train, val lines
    assert losses(run) == pytest.approx(losses(whole), abs=1e-6)
    assert ckpt.read_saved_state(ckpt.resolve_checkpoint(run))["run"]["data"] == plan.spec.data  # the next resume


def test_init_from_starts_a_new_run_from_the_saved_model(trained, tmp_path):
    plan = plan_run(TrainRequest(tmp_path / "fine", init_from=str(trained), train_overrides={"lr": 1e-4}))
    assert (plan.spec.preset, plan.spec.data) == ("tiny", "shakespeare") and not plan.resume
    assert plan.spec.init_from.endswith("step_0000002") and plan.config.lr == 1e-4
    assert plan_run(TrainRequest(tmp_path / "f2", init_from=str(trained), data="bytes:x")).spec.data == (
        f"bytes:{Path('x').resolve()}")
    with pytest.raises(BlockloopError, match="--init-from keeps the saved model and tokenizer; drop --mup-base-width"):
        plan_run(TrainRequest(tmp_path / "f3", init_from=str(trained), mup_base_width=32))
    # --dropout is how the saved model fine-tunes (it was refused): the same weights, built with the new rate
    run, _ = start_training(plan_run(TrainRequest(tmp_path / "f4", init_from=str(trained), dropout=0.25,
                                                  train_overrides={"steps": 1})))
    saved = load_trained(trained)
    assert run.model_config.dropout == run.model_config.embed_dropout == 0.25 and saved.config.dropout != 0.25
    attention = [m for m in run.model.modules() if hasattr(m, "dropout") and isinstance(m.dropout, float)]
    assert run.model.drop.p == 0.25 and attention and all(m.dropout == 0.25 for m in attention)
    assert all(torch.equal(a, b) for a, b in zip(run.model.state_dict().values(), saved.model.state_dict().values()))


def test_a_run_from_init_from_draws_its_dropout_from_its_seed(tmp_path):
    """The weights come from the checkpoint, but dropout draws from the seeded generator: the same --seed gives
    the same losses, another seed other ones."""
    fields = {**TINY, "steps": 1, "ckpt_interval": 1}
    start_training(plan_run(TrainRequest(tmp_path / "base", preset="tiny", dropout=0.3, train_overrides=fields)))[1].fit()

    def first_losses(name: str, seed: int) -> list[float]:
        _, trainer = start_training(plan_run(TrainRequest(
            tmp_path / name, init_from=str(tmp_path / "base"), train_overrides={**fields, "steps": 3, "seed": seed})))
        trainer.fit()
        return [m["loss"] for m in ckpt.read_metrics(tmp_path / name / "metrics.jsonl") if "loss" in m]

    torch.manual_seed(123)  # what ran before must not matter
    same = first_losses("a", 5)
    torch.rand(7)
    assert first_losses("b", 5) == same
    assert first_losses("c", 6) != same


def test_early_exit_options_need_a_looped_model():
    assert apply_early_exit(from_name("tiny"), EarlyExit()) == from_name("tiny")
    with pytest.raises(BlockloopError, match="--early-exit and --exit-\\* train recursive models, not decoder models"):
        apply_early_exit(from_name("tiny"), EarlyExit(exit_loss="weighted"))
    looped = apply_early_exit(from_name("tiny-recursive"), EarlyExit(exit_loss="aggressive", exit_coefficient=0.2))
    assert (looped.exit_loss, looped.exit_coefficient) == ("aggressive", 0.2)
    # Going on without the aggressive loss drops its coefficient, so a later aggressive run starts from the default
    # (it was carried, unread and unnamed, from run to run).
    weighted = apply_early_exit(looped, EarlyExit(exit_loss="weighted"))
    assert weighted.exit_coefficient == 0.1
    assert apply_early_exit(weighted, EarlyExit(exit_loss="aggressive")).exit_coefficient == 0.1
    assert apply_early_exit(looped, EarlyExit(exit_kd_weight=1.0)).exit_coefficient == 0.2  # still aggressive: kept


def test_conversion_targets_check_their_options_before_loading(tmp_path):
    assert set(TARGETS) == {"block", "recursive", "hf", "weights"}
    for target in ("hf", "weights"):
        with pytest.raises(BlockloopError, match="--save-dtype 'float16' is not one of float32, bfloat16"):
            convert_checkpoint(target, "/no/such/run", tmp_path / "x", save_dtype="float16")
    with pytest.raises(BlockloopError, match="--relax prefix needs --prefix-len"):
        to_recursive_checkpoint("/no/such/run", tmp_path / "x", relax="prefix")
    with pytest.raises(BlockloopError, match="--lora-rank is for --relax lora"):
        to_recursive_checkpoint("/no/such/run", tmp_path / "x", relax="none", lora_rank=4)
    with pytest.raises(BlockloopError, match="--prefix-len is for --relax prefix, not --relax lora"):
        to_recursive_checkpoint("/no/such/run", tmp_path / "x", lora_rank=4, prefix_len=2)
    with pytest.raises(BlockloopError, match="unknown conversion target 'gguf'"):
        convert_checkpoint("gguf", "/no/such/run", tmp_path / "x")
    with pytest.raises(BlockloopError, match="conversion to block takes no option loops; its options: block_len, "):
        convert_checkpoint("block", "/no/such/run", tmp_path / "x", loops=2)


def test_convert_to_block_writes_an_uptraining_checkpoint(trained, tmp_path):
    done = convert_checkpoint("block", trained, tmp_path / "block", block_len=4)
    assert (done.out / "model.safetensors").is_file() and "train --init-from" in done.hint
    assert plan_run(TrainRequest(tmp_path / "up", init_from=str(done.out))).spec.preset == "tiny"


def test_a_size_given_alone_chooses_its_relaxation(trained, tmp_path):
    """As --lora-rank alone means --relax lora, --prefix-len alone means --relax prefix (it was refused)."""
    prefixed = load_trained(to_recursive_checkpoint(trained, tmp_path / "prefix", prefix_len=2).out).config
    assert (prefixed.prefix_len, prefixed.lora_rank) == (2, 0)
    lora = load_trained(to_recursive_checkpoint(trained, tmp_path / "lora", lora_rank=2).out).config
    assert (lora.prefix_len, lora.lora_rank) == (0, 2)


def test_a_conversion_is_scored_on_its_sources_windows_and_an_import_on_the_default_one(trained, tmp_path):
    """A one-loop recursive conversion is the source's model, so plain `eval` gives the same numbers on the same
    windows (the run's 32 tokens); a model that never trained here (no window saved) is scored on the default
    256-token window, not its whole context (8192 tokens for SmolLM2: gigabytes of logits)."""
    converted = to_recursive_checkpoint(trained, tmp_path / "rec", loops=1).out
    request = EvalRequest(max_batches=2)
    source = evaluate_checkpoint(trained, request, "cpu")
    same = evaluate_checkpoint(converted, request, "cpu")
    assert same["tokens"] == source["tokens"] == 2 * 8 * 32 and same["loss"] == pytest.approx(source["loss"], abs=1e-5)
    state = ckpt.read_json(converted / "train_state.json")
    del state["train_config"]  # as an import writes it
    ckpt.write_json_atomic(converted / "train_state.json", state)
    assert evaluate_checkpoint(converted, EvalRequest(max_batches=1), "cpu")["tokens"] == 8 * 128  # tiny's context
    wide = tmp_path / "wide"
    start_training(plan_run(TrainRequest(wide, preset="tiny", model_overrides={"context_length": 1024},
                                         train_overrides={**TINY, "steps": 1, "ckpt_interval": 1})))[1].fit()
    for step in (wide / "checkpoints").glob("step_*"):
        state = ckpt.read_json(step / "train_state.json")
        ckpt.write_json_atomic(step / "train_state.json", {"run": state["run"], "step": 1})
    assert evaluate_checkpoint(wide, EvalRequest(max_batches=1), "cpu")["tokens"] == 8 * 256


def test_evaluate_checkpoint_refuses_no_batches_by_name(trained):
    """It said "evaluation saw no tokens; use a longer split", the wrong cause."""
    with pytest.raises(BlockloopError, match=r"max_batches \(--max-batches\) must be at least 1 or None \(all\), got 0"):
        evaluate_checkpoint(trained, EvalRequest(max_batches=0))


def test_evaluate_checkpoint_defaults_to_the_runs_data(trained):
    result = evaluate_checkpoint(trained, EvalRequest(max_batches=1), "cpu")
    assert (result["data"], result["split"], result["objective"]) == ("shakespeare", "val", "lm")
    with pytest.raises(BlockloopError, match="--batch-size must be at least 1"):
        evaluate_checkpoint(trained, EvalRequest(batch_size=0), "cpu")
    with pytest.raises(BlockloopError, match="--split test is for tasks"):
        evaluate_checkpoint(trained, EvalRequest(split="test"), "cpu")


def test_split_all_scores_a_held_out_file_whole(trained, tmp_path):
    """A text file that is one document is split 95/5 by position; --split all scores every one of its tokens
    (windows of the run's 32, the file's bytes and its end token), val only the last twentieth."""
    held_out = tmp_path / "held-out.txt"
    held_out.write_text("".join(f"a sentence the model never trained on, number {i}.\n" for i in range(50)))
    length = len(held_out.read_bytes()) + 1  # byte tokens and the end of the document
    whole = evaluate_checkpoint(trained, EvalRequest(data=str(held_out), split="all"), "cpu")
    assert (whole["split"], whole["tokens"]) == ("all", (length - 1) // 32 * 32)
    assert evaluate_checkpoint(trained, EvalRequest(data=str(held_out)), "cpu")["tokens"] < length // 10


def test_a_weights_export_evaluates_like_its_run(trained, tmp_path):
    """`convert --to weights` keeps the run's window and objective, so `eval` scores a float32 export exactly as
    it scores the run; the export still has no training state, so --resume refuses it even inside a run folder."""
    weights = convert_checkpoint("weights", trained, tmp_path / "weights").out
    request = EvalRequest(max_batches=1)
    assert evaluate_checkpoint(weights, request, device="cpu") == evaluate_checkpoint(trained, request, device="cpu")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    weights.rename(run / "checkpoints" / "step_0000002")
    (run / "checkpoints" / "latest").write_text("step_0000002")
    with pytest.raises(BlockloopError, match="without training state"):
        plan_run(TrainRequest(run, resume=True))


def test_a_damaged_training_state_is_named_as_such_not_taken_for_a_conversion(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    state_file = next((run / "checkpoints").glob("step_*/train_state.json"))
    state = json.loads(state_file.read_text())
    del state["train_config"]
    state_file.write_text(json.dumps(state))
    with pytest.raises(BlockloopError, match="train_state.json lacks train_config; the checkpoint is incomplete"):
        plan_run(TrainRequest(run, resume=True))


def test_reports_without_training():
    sizes = {s.name: s for s in preset_sizes()}
    pythia = sizes["pythia-85m"]
    assert pythia.non_embedding == pytest.approx(85.06e6, rel=1e-3) and pythia.non_embedding < pythia.total
    report = flops_report("tiny-recursive", seq_len=64, out_len=16)
    assert report.note is not None and "looped depth" in report.note
    assert report.rows[0][0] == "model" and len(report.rows) == 2 and "MiB" in report.rows[1][-1]
    assert flops_report("tiny-block", seq_len=64).note is None
    # the KV figure is appendix A.1's; the engine's allocation per slot is shown beside it (the encoder-decoder's
    # continuous batching holds max_len cross and max_len self K/V per slot: twice A.1's bytes)
    for preset, factor in (("tiny", 1), ("tiny-double", 1), ("tiny-recursive", 1), ("tiny-encdec", 2)):
        row = flops_report(preset, seq_len=64, out_len=64).rows[1]
        assert float(row[-1].split()[0]) == pytest.approx(factor * float(row[-2].split()[0]), rel=0.02)
    with pytest.raises(BlockloopError, match="not a multiple of the model.s block length 4"):
        flops_report("tiny-block", seq_len=30)
