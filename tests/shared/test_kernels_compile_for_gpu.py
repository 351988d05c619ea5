"""Every Triton kernel compiles for real GPUs (sm_80, sm_90) exactly as its wrapper launches it, on CPU.

The interpreter tests check what the kernels compute, but the interpreter accepts programs the
compiler rejects: a variable whose shape changes inside a loop ran under TRITON_INTERPRET=1 and
failed to compile. tests/shared/gpu_aot_compile.py runs the full pipeline down to a cubin with Triton's
bundled ptxas, in a process without the interpreter, and reports registers, spills and PTX facts.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from processes import run_children

pytestmark = [pytest.mark.triton, pytest.mark.slow]
triton = pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("gpu_aot_compile.py")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
KERNELS = {
    "_xe_forward_kernel", "_xe_backward_kernel", "_bprmax_forward_kernel", "_bprmax_backward_kernel",
    "_target_rank_kernel", "_sparse_adagrad_momentum_kernel",
    "_hstu_output_fwd_kernel", "_hstu_output_bwd_kernel",
    "_hstu_fwd_kernel", "_hstu_bwd_dkdv_kernel", "_hstu_bwd_dq_kernel",
    "_dot_interaction_fwd_kernel", "_dot_interaction_bwd_kernel",
}  # fmt: skip
# Ampere (A100/A30, where the reference GRU4Rec speed figures were taken) and Hopper (H100/H200)
ARCHS = (80, 90)
# A few bytes of stack are a call frame; a spilling tile costs hundreds to thousands per thread.
MAX_STACK_BYTES = 64


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    if not PTXAS.exists():
        pytest.skip(f"Triton's bundled ptxas is missing ({PTXAS}): cannot compile for a GPU here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, stated (silences its warning)
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    # one process per target, side by side: each compile is one core's work
    launches = []
    for done in run_children([[sys.executable, str(SCRIPT), str(arch)] for arch in ARCHS], env=env, timeout=600):
        assert done.returncode == 0, done.stderr[-4000:]
        launches += json.loads(done.stdout.strip().splitlines()[-1])["launches"]
    return launches


def test_every_kernel_and_variant_compiles_to_a_cubin(compiled):
    assert {r["launch"].rsplit("/", 1)[1] for r in compiled} == KERNELS
    # per arch, loss: 2 dtypes x 2 variants x (forward, backward) x 2 losses; rank: 2 B x 2 dtypes x
    # bias; optimizer: 2 widths x momentum on/off; HSTU output: 2 widths x dropout on/off x
    # (forward, backward); HSTU attention: 3 head dims x (forward, dK/dV, dQ); DLRM dot interaction:
    # 4 (F, d, dtype, diagonal) cases x (forward, backward)
    assert len(compiled) == len(ARCHS) * (16 + 8 + 4 + 8 + 9 + 8)
    assert {r["arch"] for r in compiled} == set(ARCHS)
    assert all(r["cubin_bytes"] > 0 for r in compiled)


def test_no_kernel_spills_registers(compiled):
    if any(r["stack_bytes"] is None for r in compiled):
        pytest.skip("Triton's bundled cuobjdump is missing: no resource usage to read")
    spilling = {r["launch"]: r["stack_bytes"] for r in compiled if r["stack_bytes"] > MAX_STACK_BYTES}
    assert not spilling


def test_optimizer_kernel_rounds_like_the_reference(compiled):
    # IEEE division and square root, no fused multiply-add: the update rounds op for op like
    # torch's CUDA ops (the interpreter cannot show this: numpy never fuses)
    steps = [r for r in compiled if r["launch"].endswith("_sparse_adagrad_momentum_kernel")]
    assert steps and all(r["div_rn_f32"] and r["sqrt_rn_f32"] and not r["fma_f32"] for r in steps)
