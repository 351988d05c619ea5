"""Compile every Triton kernel, launched as its wrapper launches it, for a real GPU target, no GPU needed.

Run as a script (``python tests/shared/gpu_aot_compile.py [ARCH ...]``, default ``90``) in a process
*without* ``TRITON_INTERPRET`` (tests/shared/test_kernels_compile_for_gpu.py does that): the kernels must
be real ``JITFunction`` objects. Each kernel object in the Triton modules is swapped for a recorder,
the public wrappers are called on small CPU tensors with GPU-sized tiles passed explicitly, and
every recorded launch is compiled with ``triton.compile`` for ``GPUTarget("cuda", ARCH, 32)``
through Triton's bundled ptxas: the whole pipeline down to a cubin. The interpreter tests check
what a kernel computes; this checks that what it says can be compiled for a GPU at all.

Prints one JSON object: per launch, the kernel, the target, registers and stack (spill) bytes per
thread, and a few facts read off the PTX (fused multiply-adds, IEEE division and square root).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("run without TRITON_INTERPRET: the kernels must compile, not interpret")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from recforge.kernels import dot_interaction_triton as dot_inter  # noqa: E402
from recforge.kernels.dot_interaction import n_pairs  # noqa: E402
from recforge.kernels import hstu_attention_triton as hstu_attn  # noqa: E402
from recforge.kernels import hstu_output_triton as hstu_out  # noqa: E402
from recforge.kernels import rowwise_adagrad_triton as rowwise  # noqa: E402
from recforge.kernels import sampled_loss_triton as sampled  # noqa: E402
from recforge.kernels import target_rank_triton as ranking  # noqa: E402

LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion")
POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.int64: "*i64",
    torch.int32: "*i32",
}


class Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self, name: str, fn) -> None:
        self.name, self.fn, self.calls = name, fn, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def _type_of(value) -> str:
    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot type kernel argument {value!r}")


def _source(recorder: Recorder, args, kwargs, overrides: dict) -> tuple[ASTSource, dict]:
    """The compile inputs of one recorded launch; ``overrides`` replace what differs on a GPU."""
    names = recorder.fn.arg_names
    kwargs = {**kwargs, **overrides}
    constexprs = {k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS}
    signature = {}
    runtime = iter(args)
    for name, param in zip(names, recorder.fn.params):
        signature[name] = "constexpr" if param.is_constexpr else _type_of(next(runtime))
    options = {k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs}
    return ASTSource(fn=recorder.fn, signature=signature, constexprs=constexprs), options


def _launches() -> list[tuple[str, Recorder, tuple, dict, dict]]:
    """Call every wrapper the way a GPU run would, recording each kernel launch."""
    recorders = {}
    for module in (sampled, ranking, rowwise, hstu_out, hstu_attn, dot_inter):
        for name in dir(module):
            obj = getattr(module, name)
            if isinstance(obj, triton.runtime.JITFunction) and name.endswith("_kernel"):
                recorders[name] = Recorder(name, obj)
                setattr(module, name, recorders[name])
    cases = []

    def record(label: str, call, **overrides) -> None:
        before = {name: len(r.calls) for name, r in recorders.items()}
        call()
        for name, r in recorders.items():
            for args, kwargs in r.calls[before[name]:]:
                cases.append((f"{label}/{name}", r, args, kwargs, overrides))

    gen = torch.Generator().manual_seed(0)
    # Training loss: B=32 rows, 32 + 2048 columns; on a GPU the tile spans the row (<= 2048).
    block_c = min(2048, triton.next_power_of_2(2080))
    for dtype in (torch.float32, torch.bfloat16):
        scores = torch.randn(32, 2080, generator=gen).to(dtype)
        log_q = torch.randn(2080, generator=gen)
        scale = torch.ones(1)
        for lq in (log_q, None):
            record(
                f"xe/{dtype}/logq={lq is not None}",
                lambda: sampled.softmax_xe_backward(
                    scores, lq, 1.0, *sampled.softmax_xe_forward(scores, lq, 1.0, block_c=block_c)[1:],
                    scale, block_c=block_c,
                ),
            )
        for elu in (0.5, 0.0):
            record(
                f"bprmax/{dtype}/elu={elu}",
                lambda: sampled.bprmax_backward(
                    scores, 0.5, elu, sampled.bprmax_forward(scores, 0.5, elu, block_c=block_c)[1],
                    scale, block_c=block_c,
                ),
            )
    # Ranking: the GPU tiles for 512 and 32 query rows; fp32 upcasts, matching bf16 goes to tl.dot as is.
    # Each dtype meets all four bias x exclusion variants across the two row counts (the launch
    # count stays two per row count and dtype); B=512 takes the heaviest of each (no bias without
    # exclusions spilled most before exclusions existed). Exclusions: 7 ids per row, one repeated.
    for n_rows, variants in ((512, ((False, False), (True, True))), (32, ((True, False), (False, True)))):
        for dtype, upcast in ((torch.float32, True), (torch.bfloat16, False)):
            blocks = ranking._block_sizes(n_rows, 100, on_gpu=True, upcast=upcast)
            q = torch.randn(n_rows, 100, generator=gen).to(dtype)
            w = torch.randn(1000, 100, generator=gen).to(dtype)
            targets = torch.zeros(n_rows, dtype=torch.long)
            exclude = {
                "exclude_items": torch.tensor([5, 900, 1, 130, 900, 600, 7]).repeat(n_rows),
                "exclude_offsets": torch.arange(0, 7 * n_rows + 1, 7),
            }
            for with_bias, with_exclusions in variants:
                bias = torch.randn(1000, generator=gen).to(dtype) if with_bias else None
                record(
                    f"rank/B={n_rows}/{dtype}/bias={with_bias}/exclude={with_exclusions}",
                    lambda: ranking.target_rank_counts_triton(
                        q, w, bias, targets, n_splits=4, block_sizes=blocks,
                        **(exclude if with_exclusions else {}),
                    ),
                    UPCAST=upcast,
                    num_warps=ranking._num_warps(on_gpu=True, upcast=upcast, exclude=with_exclusions),
                )  # fmt: skip
    # Optimizer: GRU4Rec's item table (d=100) and its bias column (d=1), with and without momentum.
    for width in (100, 1):
        for momentum in (0.2, 0.0):
            table, acc = torch.zeros(50, width), torch.zeros(50, width)
            velocity = torch.zeros(50, width) if momentum else None
            rows = torch.randint(0, 50, (70,), generator=gen)
            values = torch.randn(70, width, generator=gen)
            record(
                f"adagrad/d={width}/momentum={momentum}",
                lambda: rowwise.sparse_adagrad_momentum_triton_(
                    table, acc, velocity, rows, values, lr=0.1, momentum=momentum, eps=1e-6
                ),
                num_warps=rowwise._num_warps(triton.next_power_of_2(width), on_gpu=True),
            )
    # HSTU output (LN(attn) * u, dropout; the addmm is torch's): ml-1m's E = 50 and a wide E = 512,
    # dropout on and off, forward and backward (recomputing y for d_weight), with GPU tiles.
    for width in (50, 512):
        bm, _, warps = hstu_out._tiles(width, on_gpu=True, block_m=None)
        attn = torch.randn(64, 2 * width, generator=gen)[:, :width]  # strided rows, as sliced from uvqk
        u, dy = torch.randn(64, width, generator=gen), torch.randn(64, width, generator=gen)
        for p in (0.2, 0.0):
            record(
                f"hstu_output/E={width}/p={p}",
                lambda: hstu_out.hstu_output_backward(
                    attn, u, dy, *hstu_out.hstu_output_forward(attn, u, p, 7, 1e-6)[1:], p, 7, True
                ),
                BLOCK_M=bm, num_warps=warps,
            )  # fmt: skip
    # HSTU attention (jagged, causal, in-kernel relative bias): forward, dK/dV (with the bias
    # gradients) and dQ, launched by the autograd function with its GPU settings, at the configs'
    # head dims 25 (4 warps) and 50 (padded to 64, 8 warps) and at 128, the widest it supports.
    for dim in (25, 50, 128):
        lens = torch.tensor([0, 1, 200, 37])
        n_tok = int(lens.sum())
        q, k, v = (torch.randn(n_tok, 2, dim, generator=gen).requires_grad_() for _ in range(3))
        pos_w, time_w = torch.zeros(2 * 211 - 1, requires_grad=True), torch.zeros(129, requires_grad=True)
        times = torch.arange(n_tok)
        offsets = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
        config = hstu_attn._config(dim, dim, on_gpu=True)
        record(
            f"hstu_attention/d={dim}",
            lambda: hstu_attn.hstu_attention_triton(
                q, k, v, offsets, 200, pos_w, time_w, times, times + 1, 211, config=config
            ).backward(torch.randn(n_tok, 2, dim, generator=gen)),
        )
    # DLRM dot interaction (Gram matrix, triangle and concat; backward (G + Gᵀ) T): 26 tables at the
    # Kaggle d = 16 (fp32), MLPerf's d = 128 with the diagonal (fp32) and d = 64 in bf16 (tensor
    # cores), and the largest tiles the kernels take (F = MAX_F, d = MAX_D), forward and backward.
    for n_emb, dim, dtype, itself in (
        (26, 16, torch.float32, False), (26, 128, torch.float32, True), (26, 64, torch.bfloat16, False),
        (dot_inter.MAX_F - 1, dot_inter.MAX_D, torch.float32, True),
    ):  # fmt: skip
        dense = torch.randn(8, dim, generator=gen).to(dtype)
        emb = torch.randn(8, n_emb, dim, generator=gen).to(dtype)
        grad = torch.randn(8, dim + n_pairs(n_emb + 1, itself), generator=gen).to(dtype)
        config = dot_inter._config(n_emb + 1, dim, on_gpu=True)
        record(
            f"dot_interaction/F={n_emb + 1}/d={dim}/{dtype}/itself={itself}",
            lambda: (
                dot_inter.dot_interaction_forward(dense, emb, itself, config),
                dot_inter.dot_interaction_backward(grad, dense, emb, itself, config),
            ),
        )
    return cases


def _resource_usage(cubin: bytes) -> dict:
    """Registers and stack (spill) bytes per thread, read by Triton's bundled cuobjdump."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return {"regs": None, "stack_bytes": None}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
    return {"regs": int(regs.group(1)) if regs else None, "stack_bytes": int(stack.group(1)) if stack else None}


def main(archs: list[int]) -> None:
    results = []
    launches = _launches()  # once: it swaps the kernels for recorders
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        for label, recorder, args, kwargs, overrides in launches:
            source, options = _source(recorder, args, kwargs, overrides)
            options.setdefault("num_warps", 4)
            compiled = triton.compile(source, target=target, options=options)
            ptx = compiled.asm["ptx"]
            results.append({
                "launch": label,
                "arch": arch,
                "cubin_bytes": len(compiled.asm["cubin"]),
                **_resource_usage(compiled.asm["cubin"]),
                "fma_f32": "fma.rn.f32" in ptx,
                "div_rn_f32": "div.rn.f32" in ptx,
                "sqrt_rn_f32": "sqrt.rn.f32" in ptx,
            })  # fmt: skip
    print(json.dumps({"triton": triton.__version__, "launches": results}))


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [90])
