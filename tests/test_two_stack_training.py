"""Training the two-stack families end to end: loss falls, PrefixLM phase from the CLI, muP, presets build."""

from __future__ import annotations

import json
import math

import pytest
import torch

from blockloop.cli import EXIT_USER_ERROR, main
from blockloop.families import PRESETS, build_model, from_name
from blockloop.train.optim import build_optimizer
from blockloop.train.run import RunSpec, prepare_run, sequences
from blockloop.train.trainer import TrainConfig, Trainer


@pytest.mark.parametrize("preset", ["tiny-double", "tiny-encdec"])
def test_loss_falls(tmp_path, preset):
    spec = RunSpec(preset=preset, data="shakespeare", tokenizer="byte")
    run = prepare_run(spec, seed=0, show_progress=False)
    config = TrainConfig(steps=40, batch_size=4, seq_len=64, lr=3e-3, warmup_steps=2, eval_interval=40, eval_batches=2,
                         log_interval=1, ckpt_interval=40, device="cpu", progress=False, seed=0)
    train, val = sequences(run.splits, config.seq_len)
    trainer = Trainer(run.model, run.model_config, run.tokenizer, train, val, config, tmp_path, run_info=spec.to_dict())
    before = trainer.validate()["val_loss"]
    after = trainer.fit()["val_loss"]
    assert after < before - 1.0


def test_prefix_lm_phase_from_the_cli(tmp_path, capsys):
    common = ["--steps", "3", "--batch-size", "2", "--seq-len", "32", "--warmup-steps", "1", "--eval-interval", "3",
              "--eval-batches", "1", "--device", "cpu", "--no-progress"]
    pre = tmp_path / "pre"
    assert main(["train", "--preset", "tiny-double", "--out", str(pre), *common]) == 0
    fine = tmp_path / "fine"
    assert main(["train", "--init-from", str(pre), "--objective", "prefix_lm", "--lr", "2e-4", "--out", str(fine), *common]) == 0
    state = json.loads((fine / "checkpoints" / "step_0000003" / "train_state.json").read_text())
    assert state["train_config"]["objective"] == "prefix_lm" and state["run"]["preset"] == "tiny-double"
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(fine), "--max-batches", "2", "--json", "--device", "cpu"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["objective"] == "prefix_lm" and math.isfinite(metrics["loss"])
    assert main(["generate", "--checkpoint", str(fine), "--prompt", "ab", "--max-new-tokens", "5", "--seed", "0",
                 "--device", "cpu"]) == 0
    code = main(["train", "--init-from", str(pre), "--preset", "tiny", "--out", str(tmp_path / "x"), *common])
    assert code == EXIT_USER_ERROR and "drop --preset" in capsys.readouterr().err


def test_eval_names_what_its_loss_scores_and_gives_span_corruption_no_bits_per_byte(tmp_path, capsys):
    """An encoder-decoder's own loss is span corruption's: its targets are spans and sentinels, so dividing it by the
    text's bytes gave a bits/byte (6.2 beside a decoder's 4.7 bits a token) that is no such thing."""
    from server_helpers import tiny_run

    for preset, says in (("tiny", "val, next token loss ("), ("tiny-encdec", "val, span corruption loss (")):
        capsys.readouterr()
        assert main(["eval", "--checkpoint", str(tiny_run(tmp_path, preset)), "--max-batches", "1", "--device", "cpu"]) == 0
        line = capsys.readouterr().out.strip().splitlines()[-1]
        assert says in line and ("bits/byte" in line) == (preset == "tiny"), line


@pytest.mark.parametrize("argv, match", [
    (["flops", "--preset", "tiny-double", "--seq-len", "1"], "--seq-len must be in"),
    (["flops", "--preset", "nope"], "unknown preset"),
    (["train", "--objective", "prefix_lm", "--init-from", "/nonexistent", "--out", "/tmp/x"], "not found"),
])
def test_bad_input_is_one_line(capsys, argv, match):
    assert main(argv) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err


def test_flops_command_prints_every_column(capsys):
    assert main(["flops", "--preset", "demo-double", "--measure"]) == 0
    out = capsys.readouterr().out
    assert "double_decoder (demo-double)" in out and "decoder-only, same width/depth" in out and "MiB" in out


def test_mup_scales_hidden_learning_rates_and_logits():
    config = from_name("tiny-double").replace(mup_base_width=16)
    assert config.hidden_lr_multiplier == 16 / 64 and config.logit_multiplier == pytest.approx(0.5)
    torch.manual_seed(0)
    model = build_model(config)
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), hidden_lr_scale=config.hidden_lr_multiplier)
    scale = {id(p): g["lr_scale"] for g in opt.param_groups for p in g["params"]}
    assert scale[id(model.generation[0].attn.cross_kv.weight)] == 0.25
    assert scale[id(model.context.blocks[0].mlp.up.weight)] == 0.25
    assert scale[id(model.embed.weight)] == 1.0 and scale[id(model.norm.weight)] == 1.0
    plain = build_model(config.replace(mup_base_width=None))
    plain.load_state_dict(model.state_dict())
    idx = torch.randint(0, 258, (1, 10))
    assert torch.allclose(model(idx)[0], 0.5 * plain(idx)[0], atol=1e-6)


def test_trainer_applies_the_group_learning_rate_scale(tmp_path):
    spec = RunSpec(preset="tiny", data="shakespeare", tokenizer="byte", model_overrides={"mup_base_width": 16})
    run = prepare_run(spec, seed=0, show_progress=False)
    config = TrainConfig(steps=1, batch_size=2, seq_len=16, lr=1e-2, warmup_steps=1, eval_interval=1, eval_batches=1,
                         ckpt_interval=1, device="cpu", progress=False)
    train, val = sequences(run.splits, 16)
    trainer = Trainer(run.model, run.model_config, run.tokenizer, train, val, config, tmp_path)
    trainer.fit()
    lrs = sorted(g["lr"] for g in trainer.optimizer.param_groups)
    assert lrs[0] == pytest.approx(1e-2 * 16 / 64) and lrs[-1] == pytest.approx(1e-2)


def test_every_preset_builds_and_counts_parameters():
    for name in PRESETS:
        with torch.device("meta"):
            model = build_model(from_name(name))
        assert 0 < model.num_parameters(non_embedding=True) < model.num_parameters()
