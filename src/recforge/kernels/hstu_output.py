"""The output half of one HSTU layer (spec §1.3 steps 6-7): ``x + Linear(dropout(U ⊙ LN(A)))``.

With ``A`` the attention output and ``U`` the gated projection, both ``[T, E]`` (E = heads·dv),
and ``x`` the layer input ``[T, D]``:

    y = U ⊙ LayerNorm(A)                (over E, no affine parameters, eps 1e-6)
    out = x + dropout(y) @ weight.T + bias

``kernel="pytorch"`` is the reference below, plain differentiable torch ops (the CPU path and the
tests' oracle). ``kernel="triton"`` (:mod:`recforge.kernels.hstu_output_triton`) computes the norm,
gate and dropout in one row-wise kernel, keeps only two float32 numbers per row for backward, and
leaves the two GEMMs to torch. When Triton cannot run it falls back to the reference with one
warning per process.

Dropout is not ``torch.nn.functional.dropout``: both twins derive the mask from a counter-based
hash of ``(seed, t·E + e)`` (:func:`dropout_keep`), so the Triton kernel can regenerate it in
backward instead of storing it, and switching ``kernel`` never changes which elements drop.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from recforge.kernels.twin import KernelImpl, TritonTwin

__all__ = [
    "dropout_keep",
    "dropout_keep_reference",
    "dropout_key",
    "dropout_threshold",
    "hstu_output",
    "hstu_output_reference",
]

TRITON = TritonTwin("recforge.kernels.hstu_output_triton")

_M32 = 0xFFFFFFFF
# Multipliers of Wellons' "lowbias32" integer hash (xorshift-multiply, found by search for low
# avalanche bias); any odd constants would run, these make one round mix well enough that two
# keyed rounds give independent-looking bits for neighbouring counters.
_MUL_A = 0x7FEB352D
_MUL_B = 0x846CA68B
# The mask compares the hash's top 24 bits with an integer threshold: integers compare the same in
# torch and Triton, where a float comparison could round p differently in the two.
_UNIFORM_BITS = 24


def _mix32_int(x: int) -> int:
    """One hash round on a Python int holding a uint32 (host side: seeds to keys)."""
    x ^= x >> 16
    x = (x * _MUL_A) & _M32
    x ^= x >> 15
    x = (x * _MUL_B) & _M32
    return x ^ (x >> 16)


def _mul32(x: Tensor, c: int) -> Tensor:
    # (x·c) mod 2^32 for int64 x in [0, 2^32): the full product can pass 2^63, and signed overflow
    # is not something to lean on, so multiply 16-bit halves, each product staying below 2^48.
    low = (x & 0xFFFF) * c
    high = (((x >> 16) * c) & 0xFFFF) << 16
    return (low + high) & _M32


def _mix32(x: Tensor) -> Tensor:
    """One hash round on an int64 tensor holding uint32 values (the kernel's round on uint32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MUL_A)
    x = x ^ (x >> 15)
    x = _mul32(x, _MUL_B)
    return x ^ (x >> 16)


def dropout_key(seed: int) -> tuple[int, int]:
    """The two uint32 round keys of the mask hash for ``seed`` (any Python int, taken mod 2^64)."""
    seed &= (1 << 64) - 1
    # the high word is hashed first so seeds differing only there still get unrelated keys
    k0 = _mix32_int((seed & _M32) ^ _mix32_int((seed >> 32) ^ 0x243F6A88))
    k1 = _mix32_int(k0 ^ 0x9E3779B9)
    return k0, k1


def dropout_threshold(p: float) -> int:
    """Elements whose 24-bit hash is below this integer drop: a drop rate of p to within 2^-24."""
    return round(p * (1 << _UNIFORM_BITS))


def dropout_keep(
    n_rows: int, n_cols: int, p: float, seed: int, device: torch.device | str = "cpu"
) -> Tensor:
    """The keep mask ``[n_rows, n_cols]`` (bool): element ``(t, e)`` is kept or not as a function
    of ``(seed, t·n_cols + e)`` alone.

    Both twins compute exactly this: a keyed two-round hash of the flat index (low word, then high
    word), keep when its top 24 bits reach :func:`dropout_threshold`. On the CPU, masks of up to
    2^31 elements take :func:`_dropout_keep_int32` (the same bits, 8-11x faster);
    :func:`dropout_keep_reference` is the plain formulation and the oracle.
    """
    if torch.device(device).type == "cpu" and n_rows * n_cols <= _INT32_COUNTERS:
        return _dropout_keep_int32(n_rows, n_cols, p, seed)
    return dropout_keep_reference(n_rows, n_cols, p, seed, device)


def dropout_keep_reference(
    n_rows: int, n_cols: int, p: float, seed: int, device: torch.device | str = "cpu"
) -> Tensor:
    """:func:`dropout_keep` in int64 tensors holding uint32 values, any size and device."""
    k0, k1 = dropout_key(seed)
    idx = torch.arange(n_rows * n_cols, dtype=torch.int64, device=device).view(n_rows, n_cols)
    h = _mix32((idx & _M32) ^ k0)
    h = _mix32(h ^ (((idx >> 32) + k1) & _M32))
    return (h >> (32 - _UNIFORM_BITS)) >= dropout_threshold(p)


# Flat indices below 2^31 fit int32 counters: their high word is 0, so the second round's key is
# k1 itself. Chunks of 2^16 keep the two int32 work buffers in L2.
_INT32_COUNTERS = 1 << 31
_CHUNK = 1 << 16


def _signed32(v: int) -> int:
    """A uint32 as the int32 with the same bits."""
    return v - (1 << 32) if v >= (1 << 31) else v


def _mix32_int32_(x: Tensor, tmp: Tensor) -> None:
    """:func:`_mix32` in place on int32 holding uint32 bits. A shift right is arithmetic in int32,
    so the bits it brings in are masked off; int32 products wrap mod 2^32, which is exactly the
    uint32 product's bits (``dropout_keep_reference`` and the tests hold this to account)."""
    for shift, multiplier in ((16, _MUL_A), (15, _MUL_B), (16, None)):
        torch.bitwise_right_shift(x, shift, out=tmp)
        tmp &= (1 << (32 - shift)) - 1
        x ^= tmp
        if multiplier is not None:
            x.mul_(_signed32(multiplier))


def _dropout_keep_int32(n_rows: int, n_cols: int, p: float, seed: int) -> Tensor:
    """:func:`dropout_keep` on the CPU for ``n_rows·n_cols <= 2^31``, in cache-sized chunks of
    int32 with every op in place (the int64 formulation makes ~20 full-size temporaries)."""
    k0, k1 = (_signed32(k) for k in dropout_key(seed))
    n = n_rows * n_cols
    keep = torch.empty(n, dtype=torch.bool)
    counters = torch.arange(min(_CHUNK, n), dtype=torch.int32)
    work, tmp = torch.empty_like(counters), torch.empty_like(counters)
    threshold = dropout_threshold(p)
    for start in range(0, n, _CHUNK):
        m = min(_CHUNK, n - start)
        x, t = work[:m], tmp[:m]
        torch.add(counters[:m], start, out=x)
        x ^= k0
        _mix32_int32_(x, t)
        x ^= k1
        _mix32_int32_(x, t)
        torch.bitwise_right_shift(x, 32 - _UNIFORM_BITS, out=t)
        t &= (1 << _UNIFORM_BITS) - 1
        torch.ge(t, threshold, out=keep[start:start + m])
    return keep.view(n_rows, n_cols)


def hstu_output_reference(
    attn: Tensor,
    u: Tensor,
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    dropout_p: float,
    seed: int,
    eps: float,
) -> Tensor:
    """The PyTorch reference of :func:`hstu_output` (validated inputs, ``seed`` already drawn)."""
    y = u * F.layer_norm(attn, (attn.shape[-1],), eps=eps)
    if dropout_p > 0.0:
        keep = dropout_keep(attn.shape[0], attn.shape[1], dropout_p, seed, attn.device)
        # scaled like the kernel: y·(1/(1−p)) with the scale rounded once to the working dtype
        zero = torch.zeros((), dtype=y.dtype, device=y.device)
        y = torch.where(keep, y * (1.0 / (1.0 - dropout_p)), zero)
    return torch.addmm(bias, y, weight.t()) + x


def _validate(
    attn: Tensor, u: Tensor, x: Tensor, weight: Tensor, bias: Tensor, dropout_p: float, eps: float
) -> None:
    named = {"attn": attn, "u": u, "x": x, "weight": weight, "bias": bias}
    for name, t in named.items():
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if attn.dim() != 2:
        raise ValueError(f"attn must be 2-D [T, E], got shape {tuple(attn.shape)}")
    n_rows, width = attn.shape
    if u.shape != attn.shape:
        raise ValueError(f"u must have attn's shape {tuple(attn.shape)}, got {tuple(u.shape)}")
    if x.dim() != 2 or x.shape[0] != n_rows:
        raise ValueError(f"x must be 2-D [T, D] with T={n_rows}, got shape {tuple(x.shape)}")
    dim = x.shape[1]
    if weight.shape != (dim, width):
        raise ValueError(f"weight must be [D, E] = [{dim}, {width}], got {tuple(weight.shape)}")
    if bias.shape != (dim,):
        raise ValueError(f"bias must be [D] = [{dim}], got {tuple(bias.shape)}")
    if width == 0:
        raise ValueError("attn and u need E >= 1 columns (LayerNorm over zero columns is undefined)")
    dtypes = {t.dtype for t in named.values()}
    if len(dtypes) > 1:
        got = ", ".join(f"{k}={t.dtype}" for k, t in named.items())
        raise ValueError(f"all tensors must share one dtype, got {got}")
    devices = {t.device for t in named.values()}
    if len(devices) > 1:
        got = ", ".join(f"{k}={t.device}" for k, t in named.items())
        raise ValueError(f"all tensors must be on one device, got {got}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if not eps > 0.0:
        raise ValueError(f"eps must be > 0, got {eps}")


def hstu_output(
    attn: Tensor,
    u: Tensor,
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    *,
    dropout_p: float = 0.0,
    seed: int | None = None,
    eps: float = 1e-6,
    kernel: KernelImpl = "pytorch",
) -> Tensor:
    """``x + dropout(u ⊙ LayerNorm(attn)) @ weight.T + bias``, differentiable in all five tensors.

    Args:
        attn: ``[T, E]`` attention output (E = heads·dv); rows may be strided (a column slice).
        u: ``[T, E]`` the gate (SiLU of the U projection).
        x: ``[T, D]`` the layer input, added back un-normalised.
        weight: ``[D, E]`` and bias: ``[D]``, the output Linear.
        dropout_p: drop probability in [0, 1); 0 (what callers pass in eval mode) skips dropout.
        seed: fixes the mask (any Python int). None with ``dropout_p > 0`` draws one from torch's
            default CPU generator, so runs seeded with ``torch.manual_seed`` repeat.
        eps: LayerNorm's epsilon.
        kernel: ``"pytorch"`` or ``"triton"``. ``"triton"`` runs the fused kernel on CUDA float32
            tensors, or CPU ones under ``TRITON_INTERPRET=1``; otherwise it falls back to
            ``"pytorch"`` with one warning per process. Both drop the same elements for one seed.

    Returns:
        ``[T, D]`` in the inputs' dtype.
    """
    dropout_p, eps = float(dropout_p), float(eps)
    _validate(attn, u, x, weight, bias, dropout_p, eps)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be a Python int or None, got {seed!r}")
    if dropout_p > 0.0 and seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    seed = 0 if seed is None else seed
    return TRITON.dispatch(
        "hstu_output", kernel, (attn, u, x, weight, bias),
        triton=lambda module: module.hstu_output_triton(
            attn, u, x, weight, bias, dropout_p, seed, eps
        ),
        reference=lambda: hstu_output_reference(attn, u, x, weight, bias, dropout_p, seed, eps),
        layout_reason=lambda module: module.layout_reason(attn, u),
    )
