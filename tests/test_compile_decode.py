"""Every family's decode step under ``torch.compile(fullgraph=True)`` on CPU (issue 12, item 2).

Dynamo traces the step (``backend="eager"``: the graph capture is what is checked, not the code generator), so a
graph break (data-dependent Python, a host sync) fails the test. Each step's output must equal the same runner
run eagerly. The second test asks for no recompilation: a step that specialises on a host-side counter compiles
again at every phase (the static-shape, CUDA-graph form issue 12 wants has the counter on device). Steps are
compiled through ``Runner.compiled_step``: one graph per runner, except the Block Transformer's two (reading a
token inside a block, for every phase, and closing a block), chosen on a host schedule every row shares. A
staircase's per-row chunk phase is a device tensor and a chunk boundary's work is done every step and kept
where the phase says so (see those runners' docstrings).
The two rows are prefilled to different phases where the runner allows it (not a Block Transformer: its rows
share the phase), so some steps complete a staircase chunk in one row only."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.utils import run_and_get_code

from blockloop.families import build_model, from_name
from blockloop.nn.kv_cache import DecoderCache, KVCache
from blockloop.nn.paged_cache import PagedKVCache
from blockloop.serve.runners import ExitRule, Paging, Speculation, runner_for
from blockloop.serve.runners.base import StepOutput, keep_rebound_state
from blockloop.serve.sampling import SlotSampling

CASES = {
    "tiny": {}, "tiny-neox": {}, "tiny-recursive": {},
    "tiny-recursive depth-wise": {"exit_rule": ExitRule("max_prob", 0.5)},
    "tiny-recursive depth-wise blocks": {"exit_rule": ExitRule("max_prob", 0.5), "loop_read": "blocks"},
    "tiny-recursive speculative": {"speculation": Speculation(k=2, draft_loops=1)},
    "tiny-recursive speculative adaptive": {"speculation": Speculation(k=3, draft_loops=1, adaptive=True)},
    "tiny-block": {}, "tiny-double": {}, "tiny-encdec": {},
    "tiny-staircase": {}, "tiny-cached-staircase": {}, "tiny-global-staircase": {}, "tiny-feedback": {},
}
PAGED = {"tiny paged": {"paging": Paging(tokens=128, page_size=16)}}  # CUDA's Flex pages: a multiple of 16
STEPS = 9  # past two Block Transformer blocks and two staircase chunks


def twin_runners(name: str, device: str = "cpu", dtype: torch.dtype = torch.float64):
    """Two runners of one model (float64 on CPU by default) with the same two prefilled rows."""
    torch.manual_seed(0)
    model = build_model(from_name(name.split()[0])).to(device=device, dtype=dtype).eval()
    runners = [runner_for(model, **{**CASES, **PAGED}[name]) for _ in range(2)]
    for runner in runners:
        runner.sampling = SlotSampling.empty(2, torch.device(device))
        runner.allocate(2, 40)
        with torch.no_grad():
            runner.prefill_slot(0, torch.arange(1, 9, device=device))
            runner.prefill_slot(1, torch.arange(3, 11 + (runner.prompt_multiple == 1), device=device))
    return runners


def logits_of(out: torch.Tensor | StepOutput) -> torch.Tensor:
    return out.logits if isinstance(out, StepOutput) else out


def tokens(i: int) -> torch.Tensor:
    return torch.tensor([5 + i, 17 + 2 * i])


@pytest.mark.parametrize("name", CASES)
def test_decode_step_compiles_as_a_full_graph_and_equals_eager(name):
    eager, compiled = twin_runners(name)
    step = compiled.compiled_step(lambda f: torch.compile(f, fullgraph=True, backend="eager"))
    with torch.no_grad():
        for i in range(STEPS):
            torch.testing.assert_close(logits_of(step(tokens(i))), logits_of(eager.decode_step(tokens(i))),
                                       rtol=1e-12, atol=1e-12)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", [name for name in CASES if not name.endswith("adaptive")])
def test_decode_step_compiles_once_for_every_step(name):
    _, runner = twin_runners(name)
    step = runner.compiled_step(lambda f: torch.compile(f, fullgraph=True, backend="eager"))
    try:
        with torch.no_grad():
            step(tokens(0))
            with torch._dynamo.config.patch(error_on_recompile=True):
                for i in range(1, STEPS):
                    step(tokens(i))
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("name", ["tiny", "tiny-recursive", "tiny-recursive depth-wise", "tiny-recursive depth-wise blocks",
                                  "tiny-recursive speculative", "tiny-double", "tiny-block", "tiny-encdec",
                                  "tiny-staircase", "tiny-cached-staircase", "tiny-global-staircase", "tiny-feedback"])
def test_a_prefix_step_compiles_one_static_graph_per_row_count(name):
    """The engine steps only the busy first rows where the runner can (``prefix_steps``): steps over row 0 alone
    and over both rows are full graphs equal to eager, one graph per row count (and per static step: a Block
    Transformer has two), however the counts alternate."""
    eager, compiled = twin_runners(name)
    assert compiled.prefix_steps
    graphs = []

    def counting(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(graph)
        return graph.forward

    step = compiled.compiled_step(lambda f: torch.compile(f, fullgraph=True, backend=counting, dynamic=False))
    ready = torch.ones(2, dtype=torch.bool)  # depth-wise: rows inside a token are fed -1, as the engine does
    inside = 0  # steps that went on inside a token
    try:
        with torch.no_grad():
            for i in range(2 * STEPS):
                rows = 1 if i % 3 else 2
                fed = torch.where(ready[:rows], tokens(i)[:rows], -1)
                got, want = step(fed), eager.decode_step(fed)
                torch.testing.assert_close(logits_of(got), logits_of(want), rtol=1e-12, atol=1e-12)
                if isinstance(want, StepOutput):
                    assert torch.equal(got.ready, want.ready)
                    assert want.emitted is None or torch.equal(got.emitted, want.emitted)  # speculation
                    ready[:rows] = want.ready
                    inside += int((fed < 0).any())
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 2 * (2 if name == "tiny-block" else 1)
    assert inside > STEPS // 2 or "depth-wise" not in name


def in_place_updates_of_plain_tensors(found: list[str]):
    """A dynamo backend that records the graph inputs a step updates in place (after functionalisation, a
    ``copy_`` back into an input) that are not static addresses (``_dynamo_static_input_type``: module
    buffers, tensors marked with ``mark_static_address``): what makes cudagraph trees skip a graph."""

    def backend(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        static = [hasattr(t, "_dynamo_static_input_type") for t in example_inputs]
        names = [node.name for node in graph.graph.nodes if node.op == "placeholder"]

        def inspect(functional: torch.fx.GraphModule, inputs: list) -> object:
            index = {node: i for i, node in enumerate(n for n in functional.graph.nodes if n.op == "placeholder")}
            for node in functional.graph.nodes:
                if node.target is torch.ops.aten.copy_.default and node.args[0] in index:
                    i = index[node.args[0]]
                    if not static[i]:
                        found.append(names[i])
            return functional.forward

        return aot_autograd(fw_compiler=inspect, keep_inference_input_mutations=True)(graph, example_inputs)

    return backend


@pytest.mark.parametrize("name", CASES)
def test_no_decode_step_updates_a_plain_tensor_in_place(name):
    """CUDA graphs replay a step that mutates its inputs only where those have static addresses (the KV caches
    are module buffers; other state a step updates in place is marked, ``runners.base.static_state``); any
    other in-place update sends the step back to eager on every call. Checked here on CPU, on the graphs the
    GPU would capture (prefix steps over the first row too, where the runner has them)."""
    _, runner = twin_runners(name)
    found: list[str] = []
    step = runner.compiled_step(
        lambda f: torch.compile(f, fullgraph=True, backend=in_place_updates_of_plain_tensors(found), dynamic=False))
    try:
        with torch.no_grad():
            for i in range(STEPS):
                step(tokens(i)[: 1 if runner.prefix_steps and i % 2 else 2])
    finally:
        torch._dynamo.reset()
    assert not found, f"updated in place but not static: {sorted(set(found))}"


def test_adaptive_speculation_compiles_one_graph_per_draft_length():
    """Adaptive speculation drafts a different number of positions as acceptance moves: the host picks the
    length (from a copy it never waits for), and each length is one static graph, compiled once."""
    _, runner = twin_runners("tiny-recursive speculative adaptive")
    graphs, lengths = [], set()

    def counting(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(graph)
        return graph.forward

    step = runner.compiled_step(lambda f: torch.compile(f, fullgraph=True, backend=counting))
    try:
        with torch.no_grad():
            for i in range(3 * STEPS):
                lengths.add(runner.speculator._draft_length())
                step(tokens(i))
    finally:
        torch._dynamo.reset()
    assert len(lengths) > 1 and len(graphs) == len(lengths)


def tensor_fields(holder: object) -> dict[str, torch.Tensor]:
    return {name: value for name, value in vars(holder).items() if isinstance(value, torch.Tensor)}


@pytest.mark.parametrize("name", CASES)
def test_every_tensor_a_step_rebinds_is_in_a_declared_step_state(name):
    """``keep_rebound_state`` copies out of a CUDA graph's pool only the tensors of ``Runner.step_states()``: a
    state a step rebinds anywhere else (another dataclass of the runner's, its speculator's) would be read after
    the next replay overwrote it. Every dataclass the runner (or its speculator) holds is watched here."""
    _, runner = twin_runners(name)
    declared = {id(holder) for holder in runner.step_states()}
    holders = [h for owner in (runner, getattr(runner, "speculator", None)) if owner is not None
               for h in vars(owner).values() if dataclasses.is_dataclass(h) and not isinstance(h, type)]
    with torch.no_grad():
        for i in range(STEPS):
            before = [(h, {k: id(v) for k, v in tensor_fields(h).items()}) for h in holders]
            runner.decode_step(tokens(i))
            for holder, ids in before:
                rebound = [k for k, v in tensor_fields(holder).items() if ids.get(k) != id(v)]
                assert not rebound or id(holder) in declared, f"{type(holder).__name__}.{rebound} not in step_states()"
    assert any(id(h) in declared for h in holders)


def test_keep_rebound_state_copies_a_rebound_tensor_out_of_the_step_memory():
    """A graph-like step writes its output buffer before it reads its input, as a CUDA graph replay overwrites its
    pool: a state tensor left pointing at last call's output reads garbage; the copy keeps the right value. A
    tensor updated in place (a static buffer) keeps its identity."""

    @dataclasses.dataclass
    class State:
        position: torch.Tensor
        log: torch.Tensor

    class GraphLike:
        def __init__(self) -> None:
            self.state = State(torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
            self.pool = torch.empty(2, dtype=torch.long)

        def step_states(self) -> list[object]:
            return [self.state]

        def decode_step(self, tokens: torch.Tensor) -> torch.Tensor:
            self.pool.fill_(-100)  # the replay's output buffer, written before the input is read
            self.pool.copy_(self.state.position + tokens)
            self.state.position = self.pool
            self.state.log.add_(1)
            return self.pool

    runs = {}
    for keep in (False, True):
        runner = GraphLike()
        log = runner.state.log
        step = keep_rebound_state(runner, runner.decode_step) if keep else runner.decode_step
        for _ in range(3):
            step(torch.ones(2, dtype=torch.long))
        assert runner.state.log is log and log.tolist() == [3, 3]
        runs[keep] = runner.state.position.tolist()
    assert runs == {False: [-99, -99], True: [3, 3]}


def kv_caches(holder: object, seen: set[int] | None = None) -> list[KVCache | PagedKVCache]:
    """Every KV cache a runner holds, through its state dataclasses, lists and caches."""
    seen = set() if seen is None else seen
    if id(holder) in seen or isinstance(holder, (torch.Tensor, type)):
        return []
    seen.add(id(holder))
    if isinstance(holder, (KVCache, PagedKVCache)):
        return [holder]
    if isinstance(holder, DecoderCache):
        return list(holder.layers)
    if isinstance(holder, (list, tuple)):
        return [c for item in holder for c in kv_caches(item, seen)]
    if dataclasses.is_dataclass(holder) or type(holder).__module__.startswith("blockloop"):
        return [c for item in vars(holder).values() for c in kv_caches(item, seen)]
    return []


IN_PLACE_CASES = ["tiny", "tiny paged", "tiny-recursive depth-wise",
                  "tiny-recursive depth-wise blocks", "tiny-block", "tiny-double"]


@pytest.mark.parametrize("name", IN_PLACE_CASES)
def test_the_compiled_step_writes_its_kv_cache_in_place(name, device="cpu"):
    """A decode step reads every cache slot once; a copy of the cache on top of that multiplies the bytes a step
    moves. ``scatter_`` into a cache buffer did that under inductor: each layer's K and V were copied whole on
    every step (V twice, once out and once back), four times the traffic of the attention's own read; so did
    ``index_copy_`` into a view of a paged pool (``pool[0]``). The code inductor generates here (CPU; the
    reinplacing pass that left those copies is the same for every device) must allocate nothing the size of a
    cache buffer, in any shape."""
    if device == "cpu" and name.endswith("blocks") and torch.torch_version.TorchVersion(torch.__version__) < "2.13":
        pytest.skip("inductor's CPU FlexAttention kernel compiles this mask from torch 2.13 (2.11 refuses it)")
    _, runner = twin_runners(name, device, torch.float32 if device == "cpu" else torch.bfloat16)  # Flex on CPU: no float64
    sizes = {buffer.numel() for cache in kv_caches(runner) for buffer in (cache.k, cache.v)}
    assert sizes
    step = runner.compiled_step(lambda f: torch.compile(f, fullgraph=True, dynamic=False))
    try:
        with torch.no_grad():
            code = "\n".join(c for i in range(STEPS) for c in run_and_get_code(step, tokens(i).to(device))[1])
    finally:
        torch._dynamo.reset()
    allocated = [tuple(int(n) for n in shape.split(",") if n.strip())
                 for shape in re.findall(rf"empty_strided_{device}\(\(([\d, ]+)\)", code)]
    copies = [shape for shape in allocated if math.prod(shape) in sizes]
    assert allocated and not copies, f"cache-sized buffers allocated per step: {copies}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", IN_PLACE_CASES)
def test_the_compiled_cuda_step_writes_its_kv_cache_in_place(name):
    """The same on CUDA, in bf16 (the paged runner reads its pool through FlexAttention there)."""
    test_the_compiled_step_writes_its_kv_cache_in_place(name, device="cuda")
