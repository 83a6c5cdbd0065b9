"""Per-loop evaluation agrees with the plain evaluation of the same recursive model."""

import numpy as np
import pytest
import torch

from blockloop.data.loader import PackedSequences
from blockloop.families import build_model, from_name
from blockloop.train.evaluate import evaluate
from blockloop.train.exit_eval import evaluate_loops


def test_the_last_loops_loss_is_the_evaluation_loss_with_padding_rows_in_the_head():
    """The head has rows past the tokenizer (vocab 200, 256 rows): both evaluations take the softmax over all of
    them, as training does, so `eval --per-loop`'s last loop reports the loss `eval` reports."""
    torch.manual_seed(0)
    model = build_model(from_name("tiny-recursive", vocab_size=200, padded_vocab_size=256))
    with torch.no_grad():  # the padding rows' logits must matter: give them weight
        model.lm_head.weight[200:].normal_(0, 1.0)
    tokens = np.random.default_rng(0).integers(0, 200, size=4 * 32 + 1)
    windows = PackedSequences(tokens, 32)
    loops = evaluate_loops(model, windows, batch_size=2)
    plain = evaluate(model, windows, batch_size=2)
    assert loops["tokens"] == plain["tokens"] == 4 * 32
    assert loops["loops"][-1]["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert loops["loops"][0]["loss"] != pytest.approx(plain["loss"], rel=1e-3)  # the first loop is another model
