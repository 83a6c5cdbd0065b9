"""Sampling and batched generation: padding-independence, stopping, seeding, streaming, limits."""

from __future__ import annotations

import pytest
import torch

from blockloop.errors import BlockloopError
from blockloop.families import build_model, from_name
from blockloop.serve.generate import generate


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(from_name("tiny")).double().eval()


def naive_greedy(model, prompt, n):
    """Re-run the full forward for every token: no cache, no padding."""
    idx = torch.tensor([prompt])
    for _ in range(n):
        logits, _ = model(idx)
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], 1)
    return idx[0, len(prompt) :].tolist()


def test_batched_greedy_with_mixed_prompt_lengths_equals_uncached_per_row(model):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 258, (n,), generator=g).tolist() for n in (3, 11, 7)]
    batched = generate(model, prompts, 9, temperature=0)
    assert batched == [naive_greedy(model, p, 9) for p in prompts]


def test_each_row_stops_at_eos(model):
    prompts = [[5, 6, 7], [9, 10]]
    free = generate(model, prompts, 12, temperature=0)
    eos = free[0][3]  # make the 4th token of row 0 the end-of-text token
    stopped = generate(model, prompts, 12, temperature=0, eos_id=eos)
    assert stopped[0] == free[0][: free[0].index(eos)]
    cut = free[1].index(eos) if eos in free[1] else len(free[1])
    assert stopped[1] == free[1][:cut]


def test_seeded_sampling_is_reproducible_and_seeds_differ(model):
    prompts = [[1, 2, 3]] * 4
    a = generate(model, prompts, 20, temperature=1.0, seed=7)
    b = generate(model, prompts, 20, temperature=1.0, seed=7)
    c = generate(model, prompts, 20, temperature=1.0, seed=8)
    assert a == b
    assert a != c
    assert len({tuple(r) for r in a}) > 1  # rows sample independently


def test_streaming_callback_sees_every_returned_token_in_order(model):
    seen: dict[int, list[int]] = {0: [], 1: []}
    out = generate(model, [[4, 5], [6]], 10, temperature=0.7, seed=3, on_token=lambda r, t: seen[r].append(t))
    assert [seen[0], seen[1]] == out


def test_prompt_longer_than_context_is_a_clear_error(model):
    with pytest.raises(BlockloopError, match="exceeds the model context of 128"):
        generate(model, [[1] * 120], 10)
    with pytest.raises(BlockloopError, match="non-empty"):
        generate(model, [[]], 10)
    with pytest.raises(BlockloopError, match="no prompts given"):
        generate(model, [], 10)
    with pytest.raises(BlockloopError, match="seed must be an integer, got 'a'"):
        generate(model, [[1, 2]], 3, seed="a")
    # a block model counts its padded prompt against the context, and says so beside the prompt's own length
    block = build_model(from_name("tiny-block")).eval()
    with pytest.raises(BlockloopError, match=r"prompt of 122 tokens \(124 once left-padded to whole blocks\) plus 8"):
        generate(block, [[1] * 122], 8)


def test_generate_sizes_the_cache_to_its_requests_not_the_context(model, monkeypatch):
    """Every decode step reads the whole cache: slots of the full context would make each step read all of it."""
    import blockloop.serve.generate as generate_module

    sizes = []

    class Recorded(generate_module.Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            sizes.append(self.runner.state.cache.max_len)

    monkeypatch.setattr(generate_module, "Engine", Recorded)
    out = generate(model, [[1, 2, 3], [4, 5]], 5, temperature=0)
    assert sizes == [3 + 5] and sizes[0] < model.config.context_length
    assert out == [naive_greedy(model, [1, 2, 3], 5), naive_greedy(model, [4, 5], 5)]


def test_a_batch_tensor_is_read_row_by_row_and_other_shapes_are_refused(model):
    prompts = [[5, 6, 7], [9, 10, 11]]
    assert generate(model, torch.tensor(prompts), 4, temperature=0) == generate(model, prompts, 4, temperature=0)
    for bad, says in ((torch.tensor([5, 6, 7]), r"shape \(batch, length\), got \(3,\)"),
                      ([5, 6, 7], "one per row"), ("hello", "one per row"), ([[5], "ab"], "one per row")):
        with pytest.raises(BlockloopError, match=says):
            generate(model, bad, 4)
    with pytest.raises(BlockloopError, match="whole number, at least 1; got 2.5"):
        generate(model, prompts, 2.5)


def test_an_eos_id_outside_the_vocabulary_is_refused(model):
    """It could never be generated, so no row would stop: the caller passed another tokenizer's id."""
    vocab = model.config.vocab_size
    for bad in (vocab, -1, 2.0):
        with pytest.raises(BlockloopError, match="is not a token of the model's vocabulary"):
            generate(model, [[5, 6]], 2, eos_id=bad)
    assert len(generate(model, [[5, 6]], 2, eos_id=vocab - 1, temperature=0)[0]) <= 2
