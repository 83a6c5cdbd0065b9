"""oneDNN-packed linear weights for CPU inference: the same products as ``F.linear``, used only where they may
be and where measured faster, released afterwards, and wired into generation and evaluation. The kernel timing
is replaced here (``packed_wins``), so what is checked does not depend on this machine's BLAS."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blockloop.evals.scoring import Request, score
from blockloop.families import build_model, from_name
from blockloop.nn import linear as linear_module
from blockloop.nn.linear import Linear, packed_faster, packed_linears
from blockloop.serve.engine import Engine
from blockloop.serve.generate import generate

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")

PACKED_OP = "mkldnn::_linear_pointwise"


@pytest.fixture(autouse=True)
def packed_wins(monkeypatch):
    """The packed kernel measures faster at every row count (the test below changes that); no choice cached."""
    timed: list[tuple[tuple[int, ...], int]] = []
    monkeypatch.setattr(linear_module, "_choices", {})
    monkeypatch.setattr(linear_module, "packed_is_faster", lambda weight, rows: timed.append((tuple(weight.shape), rows)) or True)
    return timed


def ops_run(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@pytest.fixture
def linear() -> Linear:
    torch.manual_seed(0)
    return Linear(48, 80)


@pytest.mark.parametrize("shape", [(5, 48), (2, 7, 48), "transposed", "strided"])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_product_equals_f_linear_and_is_the_onednn_kernel(shape, bias):
    torch.manual_seed(0)
    layer = Linear(48, 80, bias=bias)
    if shape == "transposed":
        x = torch.randn(7, 3, 48).transpose(0, 1)
    elif shape == "strided":
        x = torch.randn(3, 96)[:, ::2]
    else:
        x = torch.randn(*shape)
    with packed_linears(layer) as n, torch.no_grad():
        assert n == 1 and layer.packed is not None
        ops = ops_run(lambda: layer(x))
        out = layer(x)
    assert PACKED_OP in ops
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert layer.packed is None  # released on leaving


def test_autograd_uses_the_plain_weight(linear):
    x = torch.randn(4, 48)
    with packed_linears(linear):
        ops = ops_run(lambda: linear(x))
        out = linear(x)
    assert PACKED_OP not in ops
    assert torch.equal(out, F.linear(x, linear.weight, linear.bias))
    out.sum().backward()
    assert linear.weight.grad is not None


def test_a_weight_changed_in_place_is_not_read_from_its_stale_packing(linear):
    x = torch.randn(4, 48)
    with packed_linears(linear), torch.no_grad():
        linear.weight.mul_(-2.0)
        out = linear(x)
    assert torch.equal(out, F.linear(x, linear.weight, linear.bias))


def test_float64_and_bfloat16_where_unsupported_stay_unpacked(linear):
    linear.double()
    with packed_linears(linear) as n:
        assert n == 0 and linear.packed is None


def test_bfloat16_packs_where_the_cpu_has_bf16_kernels(linear):
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no oneDNN bf16 kernels")
    linear.bfloat16()
    x = torch.randn(3, 48, dtype=torch.bfloat16)
    with packed_linears(linear) as n, torch.no_grad():
        out = linear(x)
    assert n == 1
    torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), rtol=2e-2, atol=2e-2)


def test_nested_contexts_keep_the_outer_packing(linear):
    with packed_linears(linear) as outer:
        packed = linear.packed
        with packed_linears(linear) as inner:
            pass
        assert (outer, inner) == (1, 0) and linear.packed is packed
    assert linear.packed is None


def test_packing_leaves_the_state_dict_alone():
    torch.manual_seed(0)
    model = build_model(from_name("tiny")).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with packed_linears(model) as n:
        inside = model.state_dict()
    assert n == sum(isinstance(m, Linear) for m in model.modules())
    assert inside.keys() == before.keys() and all(torch.equal(inside[k], before[k]) for k in before)


@pytest.mark.parametrize("preset,overrides", [("tiny", {}), ("tiny-recursive", {"lora_rank": 4})])
def test_a_model_under_packing_gives_the_same_logits(preset, overrides):
    """Every linear of the model (LoRA's base included) goes through the packed kernel, within float32 rounding."""
    torch.manual_seed(0)
    model = build_model(from_name(preset, **overrides)).eval()
    idx = torch.randint(0, 258, (2, 17))
    with torch.no_grad():
        reference, _ = model(idx)
        with packed_linears(model):
            ops = ops_run(lambda: model(idx))
            packed, _ = model(idx)
    assert PACKED_OP in ops
    torch.testing.assert_close(packed, reference, rtol=1e-4, atol=1e-4)


def test_generation_scoring_and_the_engine_run_on_packed_weights_and_release_them():
    torch.manual_seed(0)
    model = build_model(from_name("tiny")).eval()
    assert PACKED_OP in ops_run(lambda: generate(model, [[1, 2, 3]], 4, temperature=0.0))
    assert PACKED_OP in ops_run(lambda: score(model, [[Request((1, 2, 3), (4, 5))]]))
    assert all(m.packed is None for m in model.modules() if isinstance(m, Linear))
    for drive in (Engine.run, lambda engine: list(engine.stream())):  # an engine driven directly packs too
        engine = Engine(model, 2, max_len=16)
        engine.submit([1, 2, 3], 4)
        assert PACKED_OP in ops_run(lambda: drive(engine))
        assert all(m.packed is None for m in model.modules() if isinstance(m, Linear))


def test_a_compiled_forward_inside_the_context_traces_the_plain_weight_in_one_graph():
    torch.manual_seed(0)
    model = build_model(from_name("tiny")).eval()
    idx = torch.randint(0, 258, (2, 9))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")  # a graph break fails the call
    with torch.no_grad():
        reference, _ = model(idx)
        with packed_linears(model):
            out, _ = compiled(idx)
    torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-6)


def test_no_pack_keeps_one_copy_of_the_weights(monkeypatch, tmp_path):
    """``--no-pack`` (every verb that decodes or scores takes it) leaves generation and scoring on the stored
    weights: for models whose second copy would not fit in memory."""
    from blockloop.cli import EXIT_USER_ERROR, build_parser, main
    from blockloop.nn import linear as linear_module

    verbs = ["generate", "chat", "eval", "serve", "bench"]
    parser = build_parser(set(verbs))
    for verb in verbs:
        assert "--no-pack" in parser._subparsers._group_actions[0].choices[verb].format_help(), verb
    monkeypatch.setattr(linear_module, "_packing", True)  # restored after the test: the switch is per process
    assert main(["generate", "--checkpoint", str(tmp_path / "missing"), "--prompt", "a", "--no-pack"]) == EXIT_USER_ERROR
    torch.manual_seed(0)
    model = build_model(from_name("tiny")).eval()
    with packed_linears(model) as packed:
        assert packed == 0 and all(m.packed is None for m in model.modules() if isinstance(m, Linear))
    assert PACKED_OP not in ops_run(lambda: generate(model, [[1, 2, 3]], 4, temperature=0.0))
    assert PACKED_OP not in ops_run(lambda: score(model, [[Request((1, 2, 3), (4, 5))]]))


def test_a_weight_is_packed_only_for_the_row_counts_where_the_packed_kernel_measured_faster(monkeypatch, packed_wins):
    """Where ``F.linear`` wins at one row (an Intel CPU's MKL) a lone decoding row takes it and a batch the packed
    kernel; where it wins at both, no copy is held at all. Each shape is timed once per process, on at most
    ``PROXY_OUTPUTS`` of its output features."""
    monkeypatch.setattr(linear_module, "packed_is_faster", lambda weight, rows: packed_wins.append(tuple(weight.shape)) or rows > 1)
    torch.manual_seed(0)
    layers = torch.nn.Sequential(Linear(48, 80), Linear(48, 80), Linear(48, linear_module.PROXY_OUTPUTS + 5))
    with packed_linears(layers) as n, torch.no_grad():
        assert n == 3 and all(layer.packed_for == (False, True) for layer in layers)
        for x, packed in ((torch.randn(1, 48), False), (torch.randn(1, 1, 48), False), (torch.randn(3, 48), True),
                          (torch.randn(2, 1, 48), True)):
            assert (PACKED_OP in ops_run(lambda: layers[0](x))) == packed
            torch.testing.assert_close(layers[0](x), F.linear(x, layers[0].weight, layers[0].bias), rtol=1e-5, atol=1e-5)
    assert packed_wins == [(80, 48), (80, 48), (linear_module.PROXY_OUTPUTS, 48), (linear_module.PROXY_OUTPUTS, 48)]
    monkeypatch.setattr(linear_module, "packed_is_faster", lambda weight, rows: False)
    monkeypatch.setattr(linear_module, "_choices", {})
    with packed_linears(layers) as n:
        assert n == 0 and all(layer.packed is None for layer in layers)
        assert PACKED_OP not in ops_run(lambda: layers[0](torch.randn(4, 48)))


def test_the_kernel_timing_compares_both_kernels_on_the_weight(monkeypatch):
    """The real timing (not replaced here) runs both kernels and answers which was faster; ``packed_faster``
    caches it per shape, dtype and thread count."""
    monkeypatch.undo()
    monkeypatch.setattr(linear_module, "_choices", {})
    weight = torch.randn(64, 32)
    ops = ops_run(lambda: linear_module.packed_is_faster(weight, 1))
    assert PACKED_OP in ops and "aten::linear" in ops
    choice = packed_faster(weight)
    assert len(choice) == 2 and all(isinstance(wins, bool) for wins in choice)
    assert packed_faster(torch.randn(64, 32)) is choice and len(linear_module._choices) == 1
    # the answer is the faster kernel's: the plain one slowed down loses, made free it wins
    import time
    from types import SimpleNamespace

    for plain, packed_wins in ((lambda x, w: time.sleep(0.002), True), (lambda x, w: None, False)):
        monkeypatch.setattr(linear_module, "F", SimpleNamespace(linear=plain))
        assert linear_module.packed_is_faster(weight, 1) is packed_wins


def test_a_caller_decoding_one_row_packs_only_weights_that_win_at_one_row(monkeypatch, packed_wins):
    """A batch-1 decode multiplies one row per step: a weight whose packed kernel wins only at more rows would be
    reordered for the prompt's prefill alone, which costs more than it saves, so it is left unpacked; at two rows
    (or a speculative round's drafts for one slot) it is packed as before."""
    torch.manual_seed(0)
    model = build_model(from_name("tiny")).eval()
    monkeypatch.setattr(linear_module, "packed_is_faster", lambda weight, rows: rows > 1)
    with packed_linears(model, step_rows=1) as n:
        assert n == 0
    with packed_linears(model, step_rows=2) as n:
        assert n > 0
    assert PACKED_OP not in ops_run(lambda: generate(model, [[1, 2, 3]], 4, temperature=0.0))
    assert PACKED_OP in ops_run(lambda: generate(model, [[1, 2, 3], [4, 5]], 4, temperature=0.0))
    monkeypatch.setattr(linear_module, "packed_is_faster", lambda weight, rows: rows == 1)
    monkeypatch.setattr(linear_module, "_choices", {})
    with packed_linears(model, step_rows=1) as n:
        assert n > 0
    assert PACKED_OP in ops_run(lambda: generate(model, [[1, 2, 3]], 4, temperature=0.0))


def test_an_engine_packs_for_the_rows_its_decode_steps_multiply():
    from blockloop.serve.runners import Speculation, runner_for

    torch.manual_seed(0)
    assert Engine(build_model(from_name("tiny")).eval(), 1, max_len=16).step_rows == 1
    assert Engine(build_model(from_name("tiny")).eval(), 3, max_len=16).step_rows == 3
    looped = build_model(from_name("tiny-recursive")).eval()
    assert Engine(runner_for(looped, speculation=Speculation(3)), 2, max_len=32).step_rows == 2 * 4
