"""Encoder-decoder baseline: span corruption, PrefixLM collation, bidirectional encoder, cached = full forward."""

from __future__ import annotations

import pytest
import torch

from blockloop.data.collate import step_generator
from blockloop.data.span_corruption import span_corrupt, span_counts
from blockloop.families import build_model, collate_for, from_name
from blockloop.serve.generate import generate
from blockloop.serve.runners import runner_for

VOCAB = 258


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(from_name("tiny-encdec")).double().eval()


def reconstruct(encoder_row: list[int], decoder_row: list[int]) -> list[int]:
    """Put each sentinel's span (from the decoder input) back where the encoder has the sentinel."""
    spans, current = {}, None
    for tok in decoder_row:
        if tok >= VOCAB:
            current = spans.setdefault(tok, [])
        else:
            current.append(tok)
    return [t for tok in encoder_row for t in (spans[tok] if tok >= VOCAB else [tok])]


def test_span_corruption_uses_sentinels_corrupts_15_percent_and_is_reconstructable():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (8, 200), generator=g)
    out = span_corrupt(tokens, rate=0.15, mean_span=3.0, first_sentinel=VOCAB, n_sentinels=32, generator=g)
    n_noise, n_spans = span_counts(200, 0.15, 3.0, 32)
    assert n_noise == 30 and n_spans == 10
    assert out["idx"].shape == (8, 200 - n_noise + n_spans)
    assert out["decoder_idx"].shape == out["targets"].shape == (8, n_noise + n_spans)
    assert torch.equal(out["targets"][:, :-1], out["decoder_idx"][:, 1:])  # teacher forcing: shifted by one
    assert (out["targets"][:, -1] == VOCAB + n_spans).all()  # closing sentinel
    for row in range(8):
        enc, dec = out["idx"][row].tolist(), out["decoder_idx"][row].tolist()
        assert [t for t in enc if t >= VOCAB] == list(range(VOCAB, VOCAB + n_spans))  # sentinels in order
        assert reconstruct(enc, dec) == tokens[row].tolist()
        corrupted = sum(1 for t in dec if t < VOCAB)
        assert corrupted / 200 == pytest.approx(0.15)
    assert not torch.equal(out["idx"][0], out["idx"][1])  # each row has its own spans


def test_span_count_is_capped_by_the_sentinels():
    n_noise, n_spans = span_counts(2048, 0.15, 3.0, 32)
    assert n_noise == 307 and n_spans == 31


def test_prefix_lm_routes_the_prefix_to_the_encoder_and_scores_the_suffix(model):
    inputs, targets = torch.randint(0, VOCAB, (2, 50)), torch.randint(0, VOCAB, (2, 50))
    batch = collate_for(model.config, "prefix_lm")(inputs, targets, step_generator(0, 3))
    b = batch["idx"].shape[1]
    assert torch.equal(torch.cat([batch["idx"], batch["decoder_idx"]], 1), inputs)
    assert torch.equal(batch["targets"], targets[:, b:])
    # the same breakpoint as every other family at the same step
    decoder_batch = collate_for(from_name("tiny"), "prefix_lm")(inputs, targets, step_generator(0, 3))
    assert (decoder_batch["targets"] != -100).sum() == batch["targets"].numel()


def test_encoder_is_bidirectional_and_decoder_is_causal(model):
    enc, dec = torch.randint(0, VOCAB, (1, 12)), torch.randint(0, VOCAB, (1, 8))
    base, _ = model(enc, decoder_idx=dec)
    enc2 = enc.clone()
    enc2[0, -1] = (enc[0, -1] + 1) % VOCAB
    changed, _ = model(enc2, decoder_idx=dec)
    assert not torch.allclose(base[:, 0], changed[:, 0])  # every decoder position sees the whole encoder
    dec2 = dec.clone()
    dec2[0, 5:] = (dec[0, 5:] + 1) % VOCAB
    later, _ = model(enc, decoder_idx=dec2)
    assert torch.allclose(base[:, :5], later[:, :5], atol=1e-12)


def test_cached_generation_logits_equal_the_full_forward(model):
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 4, 1)]  # 1: nothing to encode
    outs = generate(model, prompts, 6, temperature=0)
    for prompt, out in zip(prompts, outs):
        idx = torch.tensor([prompt])
        runner = runner_for(model)
        runner.allocate(1, idx.shape[1] + 6)
        logits = runner.prefill_batch(idx, torch.ones_like(idx, dtype=torch.bool))
        steps = [logits[0]] + [runner.decode_step(torch.tensor([t]))[0] for t in out[:-1]]
        full, _ = model(torch.tensor([prompt[:-1]], dtype=torch.long), decoder_idx=torch.tensor([prompt[-1:] + out[:-1]]))
        assert torch.allclose(torch.stack(steps), full[0], atol=1e-10)


def test_attn_scalar_scales_cross_attention_scores_too():
    """``attn_scalar`` replaces head_dim^-1/2 in every attention of the model, the decoder's cross-attention
    included: its output equals a softmax over q k^T attn_scalar^-1/2 written out."""
    model = build_model(from_name("tiny-encdec", attn_scalar=3.0)).double().eval()
    cross = model.decoder[0].cross
    torch.manual_seed(0)
    x, memory = torch.randn(2, 5, model.config.d_model).double(), torch.randn(2, 7, model.config.d_model).double()
    k, v = cross.keys(memory)
    q = cross.q(x).view(2, 5, cross.n_head, cross.head_dim).transpose(1, 2)
    group = cross.n_head // cross.n_kv_head
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    weights = torch.softmax(q @ k.transpose(-1, -2) * 3.0**-0.5, dim=-1)
    expected = cross.proj((weights @ v).transpose(1, 2).flatten(2))
    with torch.no_grad():
        assert torch.allclose(cross(x, cross.keys(memory), None), expected, atol=1e-12)
