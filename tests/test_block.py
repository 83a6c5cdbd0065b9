"""Block Transformer: masking, random-length padding, cached = uncached, uptraining init, presets, training."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from blockloop.convert.to_block import vanilla_to_block
from blockloop.data.block_padding import random_length_padding
from blockloop.errors import BlockloopError, ConfigError
from blockloop.families import build_model, collate_for, from_name
from blockloop.families.block import BlockTransformerConfig
from blockloop.serve.generate import generate
from blockloop.serve.runners import runner_for

VARIANTS = list(itertools.product(["lookup", "encoder", "cls"], ["prefix", "sum", "cross"]))


def block_model(embedder="lookup", token_decoder="prefix", **overrides):
    torch.manual_seed(0)
    embed_dim = None if embedder == "lookup" else 32
    config = from_name("tiny-block", embedder=embedder, token_decoder=token_decoder, embed_dim=embed_dim, **overrides)
    return build_model(config).double().eval()


@pytest.mark.parametrize("embedder, token_decoder", VARIANTS)
def test_cached_generation_logits_equal_the_full_forward(embedder, token_decoder):
    model = block_model(embedder, token_decoder)
    idx = torch.randint(0, 258, (2, 24), generator=torch.Generator().manual_seed(1))
    full, _ = model(idx)
    runner = runner_for(model)
    runner.allocate(2, 24)
    steps = [runner.prefill_batch(idx[:, :8], torch.ones(2, 8, dtype=torch.bool))]
    for t in range(8, 23):
        steps.append(runner.decode_step(idx[:, t]))
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 8:], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("embedder, token_decoder", VARIANTS)
def test_no_position_sees_its_own_or_later_tokens(embedder, token_decoder):
    """Position t predicts token t: its logits may depend on tokens < t only (earlier blocks and the block so far)."""
    model = block_model(embedder, token_decoder)
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 258, (1, 16), generator=g)
    base, _ = model(idx)
    for t in range(4, 16):
        changed = idx.clone()
        changed[:, t:] = torch.randint(0, 258, (1, 16 - t), generator=g)
        logits, _ = model(changed)
        torch.testing.assert_close(logits[:, : t + 1], base[:, : t + 1], atol=1e-12, rtol=1e-12)
    # ...and the last block really does read the earlier blocks.
    changed = idx.clone()
    changed[:, 0] = (idx[:, 0] + 1) % 258
    assert not torch.allclose(model(changed)[0][:, 12:], base[:, 12:])


def test_first_block_is_not_predicted():
    model = block_model()
    idx = torch.randint(0, 258, (2, 12))
    logits, _ = model(idx)
    assert torch.all(logits[:, :4] == 0)
    batch = collate_for(model.config)(idx, idx, torch.Generator().manual_seed(0))
    assert torch.all(batch["targets"][:, :4] == -100)


def test_a_one_block_window_has_zero_logits_and_is_refused_for_training():
    """A window of a single block has no context embedding: its logits are block 0's zeros (no reshape error), and
    a batch of such windows, where nothing is scored, is refused with a sentence instead of training on a NaN loss."""
    for token_decoder in ("prefix", "sum", "cross"):
        model = block_model(token_decoder=token_decoder)
        logits, _ = model(torch.randint(0, 258, (2, 4)))
        assert logits.shape == (2, 4, model.config.padded_vocab_size) and torch.all(logits == 0)
    idx = torch.randint(0, 258, (2, 4))
    with pytest.raises(ConfigError, match="at least 8"):
        collate_for(model.config)(idx, idx, torch.Generator().manual_seed(0))


def test_random_length_padding_keeps_documents_in_their_own_blocks():
    eos, pad, block = 0, 0, 4
    g = torch.Generator().manual_seed(3)
    window = torch.randint(1, 50, (6, 65), generator=g)
    for row in window:  # documents of random lengths, each ending in EOS
        row[torch.randint(0, 65, (5,), generator=g)] = eos
    idx, real = random_length_padding(window, block, eos_id=eos, pad_id=pad, length=64, generator=g)
    assert idx.shape == real.shape == (6, 64)
    leads = []
    for row, keep, source in zip(idx, real, window):
        # Real tokens come out in order, as a prefix of the source window.
        kept = row[keep]
        assert torch.equal(kept, source[: len(kept)])
        for b in range(16):
            blk, blk_real = row[4 * b : 4 * b + 4], keep[4 * b : 4 * b + 4]
            # A block never continues after a real end-of-document token: documents never share a block.
            ends = [i for i in range(4) if blk_real[i] and blk[i] == eos]
            assert all(not blk_real[i + 1 :].any() for i in ends)
        starts = [i for i in range(64) if keep[i] and (i == 0 or not keep[i - 1])]
        leads += [s % block for s in starts]
    # Documents start after 0..L_B-1 pads, and every offset occurs.
    assert set(leads) == {0, 1, 2, 3}
    assert not torch.equal(idx, random_length_padding(window, block, eos_id=eos, pad_id=pad, length=64,
                                                      generator=torch.Generator().manual_seed(4))[0])


def test_collation_scores_every_real_token_after_the_first_block_and_no_pad():
    model = block_model()
    window = torch.randint(1, 200, (3, 33))
    window[:, 10] = model.config.pad_id  # a document boundary (pad id = end-of-text)
    batch = collate_for(model.config)(window[:, :-1], window[:, 1:], torch.Generator().manual_seed(0))
    idx, real = random_length_padding(window, 4, eos_id=model.config.pad_id, pad_id=model.config.pad_id, length=32,
                                      generator=torch.Generator().manual_seed(0))
    assert torch.equal(batch["idx"], idx)
    expected = idx.masked_fill(~real, -100)
    expected[:, :4] = -100
    assert torch.equal(batch["targets"], expected)
    assert (batch["targets"] == model.config.pad_id).sum() <= 3  # only the real end-of-text tokens


def test_left_padded_batch_matches_each_prompt_alone():
    model = block_model()
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]
    together = generate(model, prompts, 10, temperature=0)
    alone = [generate(model, [p], 10, temperature=0)[0] for p in prompts]
    assert together == alone


def test_generation_respects_sampling_and_stopping():
    model = block_model()
    a = generate(model, [[1, 2, 3]] * 3, 9, temperature=1.0, seed=5)
    assert a == generate(model, [[1, 2, 3]] * 3, 9, temperature=1.0, seed=5)
    free = generate(model, [[1, 2, 3]], 12, temperature=0)[0]
    stopped = generate(model, [[1, 2, 3]], 12, temperature=0, eos_id=free[5])[0]
    assert stopped == free[: free.index(free[5])]
    with pytest.raises(BlockloopError, match="exceeds the model context"):
        generate(model, [[1] * 125], 4)  # 125 pads up to 128, leaving no room


def test_kv_cache_is_a_block_per_entry_and_the_token_cache_one_block():
    model = block_model()
    runner = runner_for(model)
    runner.allocate(2, 64 + 32)
    runner.prefill_batch(torch.ones(2, 64, dtype=torch.long), torch.ones(2, 64, dtype=torch.bool))
    state = runner.state
    assert state.block_cache.layers[0].k.shape[2] == (64 + 32) // 4
    assert state.token_cache.layers[0].k.shape[2] == model.config.n_lead + model.config.block_len - 1


def test_uptraining_init_follows_appendix_n():
    torch.manual_seed(0)
    vanilla = build_model(from_name("tiny-neox")).double().eval()
    block = vanilla_to_block(vanilla, block_len=4, prefix_len=2, pad_id=256).double().eval()
    c = block.config
    assert (c.block_n_layer, c.token_n_layer, c.block_d_model) == (1, 1, 64)
    # Layers split in half: lower -> block decoder, upper -> token decoder.
    for name, tensor in vanilla.body.blocks[0].state_dict().items():
        assert torch.equal(block.block_decoder.blocks[0].state_dict()[name], tensor)
    for name, tensor in vanilla.body.blocks[1].state_dict().items():
        assert torch.equal(block.token_decoder.body.blocks[0].state_dict()[name], tensor)
    assert torch.equal(block.token_decoder.lm_head.weight, vanilla.lm_head.weight)
    # Block embedding = average of the block's token embeddings; prefix = copies of the context.
    tokens = torch.randint(0, 258, (1, 2, 4))
    torch.testing.assert_close(block.embedder(tokens), vanilla.embed(tokens).mean(2))
    context = torch.randn(3, 64, dtype=torch.float64)
    torch.testing.assert_close(block.token_decoder.context_vectors(context), context[:, None].expand(3, 2, 64))


def test_uptraining_conversion_rejects_impossible_requests():
    with pytest.raises(BlockloopError, match="multiple of --block-len"):
        vanilla_to_block(build_model(from_name("tiny")), block_len=3)
    with pytest.raises(BlockloopError, match="cannot be split"):
        vanilla_to_block(build_model(from_name("tiny", n_layer=1)))
    with pytest.raises(BlockloopError, match="one block, and the first block is never predicted"):  # context 128
        vanilla_to_block(build_model(from_name("tiny")), block_len=128)
    with pytest.raises(BlockloopError, match="not recursive models"):  # a Decoder subclass, but looped
        vanilla_to_block(build_model(from_name("tiny-recursive")))
    # what a Block Transformer's layers cannot hold is named, not dropped (GPT-2's positions, Gemma's norms)
    for changes, named in (({"learned_positions": True, "rotary_pct": 0.0}, "learned positions"),
                           ({"qk_norm": True, "sandwich_norm": True}, "q/k norms, sandwich norms"),
                           ({"embed_scale": True, "logit_softcap": 30.0}, "embedding scaling, logit soft-capping"),
                           ({"sliding_window": 8, "local_layers": [0]}, "sliding-window layers"),
                           ({"head_dim": 32}, "head_dim 32 (not d_model / n_head)")):
        with pytest.raises(BlockloopError, match=f"uses {re.escape(named)}, which the Block Transformer does not have"):
            vanilla_to_block(build_model(from_name("tiny", **changes)))


@pytest.mark.parametrize(
    "name, non_embedding",
    [("block-5m", 4.87e6), ("block-85m", 86.2e6), ("block-1.2b", 1.217e9), ("megabyte-19m", 19.4e6)],
)
def test_paper_presets_have_the_tables_sizes(name, non_embedding):
    with torch.device("meta"):
        model = build_model(from_name(name))
    assert model.num_parameters(non_embedding=True) == pytest.approx(non_embedding, rel=0.01)
    assert model.config.context_length == 2048 and model.config.block_len == 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(context_length=130), "not a multiple of block_len"),
        (dict(embedder="conv"), "embedder='conv'"),
        (dict(token_decoder="mlp"), "token_decoder='mlp'"),
        (dict(token_decoder="prefix", prefix_len=0), "prefix_len"),
        (dict(block_d_model=100, block_n_head=3), "does not divide"),
    ],
)
def test_impossible_block_configs_fail_with_a_sentence(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        BlockTransformerConfig(**kwargs)


def test_training_lowers_the_loss(tmp_path):
    from blockloop.train.run import RunSpec, prepare_run, sequences
    from blockloop.train.trainer import TrainConfig, Trainer

    spec = RunSpec(preset="tiny-block", data="shakespeare", tokenizer="byte")
    run = prepare_run(spec, seed=0, show_progress=False)
    assert run.model_config.pad_id == run.tokenizer.eos_id
    config = TrainConfig(steps=40, batch_size=8, seq_len=32, lr=3e-3, warmup_steps=2, eval_interval=40, eval_batches=2,
                         log_interval=10, ckpt_interval=40, device="cpu", progress=False)
    trainer = Trainer(run.model, run.model_config, run.tokenizer, *sequences(run.splits, 32), config, tmp_path, run_info=spec.to_dict())
    before = trainer.validate()["val_loss"]
    assert trainer.fit()["val_loss"] < before - 1.0


def test_a_one_block_context_is_refused_by_the_config():
    with pytest.raises(ConfigError, match="one block of block_len=4, and needs at least two; a block_len that divides it into at least two blocks: 1, 2"):
        from_name("tiny-block", context_length=4)
