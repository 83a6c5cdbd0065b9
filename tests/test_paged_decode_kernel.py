"""The Triton paged decode kernel (issue 12: a kernel of our own where FlexAttention left half the bandwidth), checked
on CPU in Triton's interpreter against the mask FlexAttention gets for the same step over a real paged cache, and
as the engine's paged read (``Paging(..., read="kernel")``) against the static cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from blockloop.nn.paged_decode import default_splits, paged_decode_attention

CHECKS = Path(__file__).with_name("paged_decode_checks.py")


TOLERANCE = {"float16": 2e-3, "bfloat16": 2e-2}  # the output's own rounding; float32 pools: 1e-5


def run_checks(device: str, env: dict[str, str]) -> dict[str, dict[str, object]]:
    done = subprocess.run([sys.executable, str(CHECKS), "--device", device], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    checks = json.loads(done.stdout)
    assert len(checks["attention"]) == 9 and len(checks["engine"]) == 6, checks
    for name, error in checks["attention"].items():
        assert error < next((tol for kind, tol in TOLERANCE.items() if name.startswith(kind)), 1e-5), (name, error)
    assert all(checks["engine"].values()), checks["engine"]
    assert checks["edges"] and all(error == 0 for error in checks["edges"].values()), checks["edges"]
    assert checks["pool past 2^31 elements"]
    return checks


def test_the_kernel_equals_the_pools_reference_and_serves_every_paged_family_in_tritons_interpreter():
    run_checks("cpu", {**os.environ, "TRITON_INTERPRET": "1"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_compiled_kernel_equals_the_pools_reference_and_serves_every_paged_family_on_cuda():
    run_checks("cuda", {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})


@pytest.mark.skipif(bool(triton.knobs.runtime.interpret), reason="this process runs Triton's interpreter")
def test_the_kernel_says_where_it_runs_and_what_it_takes():
    q, pool = torch.randn(2, 2, 1, 4), torch.randn(1, 1, 8, 4)
    table, reserved = torch.ones(2, 2, dtype=torch.long), torch.full((2,), 2)
    query, valid = torch.tensor([1, 2]), torch.ones(2, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        paged_decode_attention(q, pool, pool, table, reserved, query, valid, page_size=4)
    with pytest.raises(ValueError, match="one query per row, got 3"):
        paged_decode_attention(torch.randn(2, 2, 3, 4), pool, pool, table, reserved, query, valid, page_size=4)
    with pytest.raises(ValueError, match="3 key/value heads do not divide 2"):
        paged_decode_attention(q, torch.randn(1, 3, 8, 4), torch.randn(1, 3, 8, 4), table, reserved, query, valid,
                               page_size=4)
    with pytest.raises(ValueError, match="power of two of at least 16 keys .* got 8"):
        paged_decode_attention(q, pool, pool, table, reserved, query, valid, page_size=4, tile=8)
    with pytest.raises(ValueError, match="table of 2 pages of 2 does not cover the 8 slots"):
        paged_decode_attention(q, pool, pool, table, reserved, query, valid, page_size=2)
    with pytest.raises(ValueError, match="window of at least one slot, got 0"):
        paged_decode_attention(q, pool, pool, table, reserved, query, valid, page_size=4, local=torch.ones(2, dtype=bool))


def sass_of(dtype: str, groups: int, dim: int, window: bool, splits: int) -> tuple[str, str]:
    """The kernel compiled for an H100 (sm_90) with the compiler, assembler and disassembler a triton wheel ships,
    as the launcher specializes it at run time (16-byte aligned pointers and strides): its PTX and machine code."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from blockloop.nn.paged_decode import _paged_decode

    constants = {"GROUPS": groups, "GROUPS_PAD": max(16, triton.next_power_of_2(groups)), "HEAD_DIM": dim,
                 "HEAD_DIM_PAD": max(16, triton.next_power_of_2(dim)), "PAGE": 16, "TILE": 64, "HAS_WINDOW": window,
                 "SPLITS": splits, "WIDEN": False}
    out = dtype if splits == 1 else "fp32"  # split: each split's output and log-sum-exp in float32
    pointers = {"Q": f"*{dtype}", "K": f"*{dtype}", "V": f"*{dtype}", "Out": f"*{out}", "Lse": f"*{out}",
                "Table": "*i64", "Reserved": "*i64", "Query": "*i64", "Valid": "*u8", "Local": "*u8"}
    kinds = {**pointers, "scale_log2": "fp32", **dict.fromkeys(constants, "constexpr")}
    signature = {name: kinds.get(name, "i32") for name in _paged_decode.arg_names}  # the rest: strides, window
    aligned = [*pointers, "stride_qb", "stride_qh", "stride_kh", "stride_kp", "stride_ob", "stride_oh"]
    attrs = {(_paged_decode.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    kernel = triton.compile(ASTSource(fn=_paged_decode, signature=signature, constexprs=constants, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32))
    assert kernel.asm["cubin"] and ".target sm_90" in kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        disassembler = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
        sass = subprocess.run([str(disassembler), str(cubin)], capture_output=True, text=True, check=True).stdout
    return kernel.asm["ptx"], sass


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")  # triton 3.9's notice of a coming default
@pytest.mark.parametrize("dtype, groups, dim, window, splits", [
    ("bf16", 1, 64, False, 1),  # pythia-85m
    ("fp16", 3, 64, True, 4),  # SmolLM2-135M's grouping, a sliding window, flash-decoding
    ("bf16", 8, 128, False, 1),  # a Llama-sized head, 8 query heads per key head
])
def test_the_kernel_compiles_for_an_h100_into_a_pipelined_tensor_core_loop(dtype, groups, dim, window, splits):
    """Triton's interpreter runs Python and forgives what its compiler refuses, and says nothing of speed: the kernel
    is compiled here to an H100's machine code, so a GPU session neither finds a kernel that cannot build nor times
    one that cannot keep the memory busy. A decode step is a read of the cache: the keys and values must come in
    through asynchronous copies the compiler pipelines across tiles (``LDGSTS``, PTX's ``cp.async``), the products
    run on tensor cores (``HMMA``), and the loop's state must live in registers: a per-head (TILE, D) product in
    float32, as a first version built it, spilled kilobytes per program at 8 heads of 128 (``STL``)."""
    ptx, sass = sass_of(dtype, groups, dim, window, splits)
    assert "LDGSTS" in sass and "cp.async" in ptx
    assert "HMMA" in sass
    assert sass.count(" STL") <= 1, "the kernel spills its loop's registers to local memory"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="this process runs Triton's interpreter")
def test_the_kernel_read_is_refused_on_cpu_outside_the_interpreter():
    from blockloop.errors import BlockloopError
    from blockloop.nn.paged_cache import KVPages

    with pytest.raises(BlockloopError, match="runs on CUDA .* use read 'gather' on CPU"):
        KVPages(2, 16, 4, 4, device="cpu", read="kernel")


def test_rows_are_split_until_an_h100_has_about_two_programs_per_multiprocessor():
    assert default_splits(256 * 12, 132) == 1  # pythia-85m at batch 256: the rows fill it
    assert default_splits(8 * 12, 132) == 3 and default_splits(12, 132) == 16  # batch 1: capped
    assert default_splits(12, 0) == 1  # no GPU
