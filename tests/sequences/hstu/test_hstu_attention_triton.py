"""The Triton HSTU attention against a float64 oracle written here (interpreter on CPU-only machines).

The oracle is deliberately plain: per row, dense ``[L, L]`` scores with explicit causal masks, the
bias looked up entry by entry, autograd in float64 for the gradients. Shapes stay tiny because the
interpreter runs every program in numpy; on CPU the kernels use 16-wide tiles and head-dim slices,
so rows of up to 37 items and head dims of 25 still cover several tiles, partial tiles and slices.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.triton
hat = pytest.importorskip("recforge.kernels.hstu_attention_triton")

if not torch.cuda.is_available() and not hat.INTERPRETED:
    pytest.skip("no GPU and TRITON_INTERPRET=1 was not set before import", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _spec_bucket(delta: torch.Tensor, num_buckets: int) -> torch.Tensor:
    # spec §1.4 as the reference computes it: float32 log of the clamped absolute gap
    return (torch.log(delta.abs().clamp(min=1).to(torch.float32)) / 0.301).long().clamp(0, num_buckets)


def oracle(q, k, v, offsets, pos_w, time_w, timestamps, query_times, width):
    """Float64 HSTU attention, one row at a time; inputs are upcast copies of the kernel's."""
    num_buckets = time_w.numel() - 1
    rows = []
    for b in range(offsets.numel() - 1):
        lo, hi = int(offsets[b]), int(offsets[b + 1])
        n = hi - lo
        if n == 0:
            continue
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        causal = (j <= i).to(torch.float64)
        scores = torch.einsum("ihd,jhd->hij", q[lo:hi], k[lo:hi])
        bucket = _spec_bucket(query_times[lo:hi, None] - timestamps[None, lo:hi], num_buckets)
        # entries above the diagonal index past the causal half of pos_w; the mask zeroes them
        bias = pos_w[width - 1 + j - i] + time_w[bucket]
        attn = F.silu(scores + bias) / width * causal
        rows.append(torch.einsum("hij,jhd->ihd", attn, v[lo:hi]))
    if not rows:
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[2]) + 0 * (q.sum() + k.sum() + v.sum())
    return torch.cat(rows)


def make_problem(lens, heads, dqk, dv, width, *, num_buckets=128, seed=0, times="chrono"):
    """Random inputs on the CPU: float32 tensors the kernel reads, int64 offsets and times.

    ``times="chrono"``: each row's timestamps rise with ties, gaps of seconds and gaps of years,
    and query times are the next item's time (the last one a later target), as the model builds
    them; ``"wild"``: arbitrary int64 times of both signs and every magnitude, so gaps are negative,
    huge and spread over all buckets.
    """
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)
    q = torch.randn(total, heads, dqk, generator=gen) * 0.6
    k = torch.randn(total, heads, dqk, generator=gen) * 0.6
    v = torch.randn(total, heads, dv, generator=gen)
    pos_w = torch.randn(2 * width - 1, generator=gen) * 0.5
    time_w = torch.randn(num_buckets + 1, generator=gen) * 0.5
    offsets = torch.tensor([0, *lens]).cumsum(0)
    if times == "chrono":
        none = torch.zeros(0, dtype=torch.long)
        stamps, queries = [none], [none]
        for n in lens:
            kind = torch.randint(0, 4, (n + 1,), generator=gen)
            step = torch.where(kind == 0, 0, torch.randint(1, 120, (n + 1,), generator=gen))
            step = torch.where(kind == 3, torch.randint(10**5, 10**9, (n + 1,), generator=gen), step)
            row = 10**9 + step.cumsum(0)
            stamps.append(row[:n])
            queries.append(row[1:])
        timestamps, query_times = torch.cat(stamps), torch.cat(queries)
    else:
        scale = 10 ** torch.randint(0, 19, (2, total), generator=gen).double()
        raw = (torch.rand(2, total, generator=gen, dtype=torch.float64) * 2 - 1) * scale
        timestamps, query_times = raw.clamp(-9e18, 9e18).long()
    return q, k, v, offsets, pos_w, time_w, timestamps, query_times


def run_both(problem, max_len, width, grad=None, config=None):
    """Kernel (float32, on DEVICE) and oracle (float64, CPU) outputs and input gradients."""
    q, k, v, offsets, pos_w, time_w, timestamps, query_times = problem
    floats = (q, k, v, pos_w, time_w)
    kernel_in = [t.detach().clone().to(DEVICE).requires_grad_() for t in floats]
    oracle_in = [t.detach().double().requires_grad_() for t in floats]
    kq, kk, kv, kp, kt = kernel_in
    out = hat.hstu_attention_triton(
        kq, kk, kv, offsets.to(DEVICE), max_len, kp, kt, timestamps.to(DEVICE), query_times.to(DEVICE),
        width, config=config,
    )  # fmt: skip
    oq, ok, ov, op, ot = oracle_in
    ref = oracle(oq, ok, ov, offsets, op, ot, timestamps, query_times, width)
    if grad is None:
        return out, ref, None, None
    out.backward(grad.to(DEVICE))
    ref.backward(grad.double().contiguous())
    return out, ref, [t.grad for t in kernel_in], [t.grad for t in oracle_in]


def assert_matches(got, want, what):
    got = got.detach().double().cpu()
    want = want.detach()
    # 1e-5 of the tensor's scale: fp32 sums of a few dozen terms sit far below it
    scale = max(want.abs().max().item(), 1e-30)
    err = (got - want).abs().max().item()
    assert err <= 1e-5 * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g}"


GRAD_NAMES = ("q", "k", "v", "pos_weights", "time_weights")

# lengths with an empty row, single items, partial tiles and a row of the longest length (37: three
# 16-wide tiles, the last partial); max_len and width above the longest row where noted
CASES = {
    "chrono": dict(lens=[5, 0, 1, 37, 16, 2], heads=2, dqk=7, dv=10, max_len=37, width=40),
    "wild": dict(lens=[0, 23, 1, 9], heads=3, dqk=12, dv=5, max_len=30, width=30, times="wild"),
    "wide-heads": dict(lens=[19, 3, 0], heads=1, dqk=25, dv=20, max_len=19, width=25),
    "few-buckets": dict(lens=[1, 18, 4], heads=2, dqk=8, dv=8, max_len=18, width=18, num_buckets=10),
}


def _case(name, seed=0):
    spec = dict(CASES[name])
    max_len, width = spec.pop("max_len"), spec.pop("width")
    return make_problem(width=width, seed=seed, **spec), max_len, width


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_and_every_gradient_match_the_float64_oracle(name):
    problem, max_len, width = _case(name)
    q, v = problem[0], problem[2]
    grad = torch.randn(q.shape[0], q.shape[1], v.shape[2], generator=torch.Generator().manual_seed(1))
    out, ref, grads, ref_grads = run_both(problem, max_len, width, grad)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert_matches(out, ref, "output")
    for gname, got, want in zip(GRAD_NAMES, grads, ref_grads):
        assert got is not None and got.shape == want.shape, gname
        assert_matches(got, want, f"d {gname}")


@pytest.mark.parametrize(
    "config",
    [
        # the GPU's tiles: 32-query forward/dQ tiles over 16-key steps, 32-key dK/dV tiles over
        # 16-query steps, here with 32-wide head-dim slices
        {"block_m": 32, "block_n": 16, "bwd_block_m": 16, "bwd_block_n": 32, "slice_d": 32, "num_warps": 8},
        # square dK/dV tiles, and 64-key dK/dV tiles that span whole rows (three query steps)
        {"bwd_block_m": 16, "bwd_block_n": 16},
        {"block_m": 16, "block_n": 32, "bwd_block_m": 16, "bwd_block_n": 64},
    ],
    ids=["gpu", "square", "wide-keys"],
)
def test_other_tile_shapes_match_too(config):
    problem, max_len, width = _case("chrono", seed=3)
    grad = torch.randn(problem[0].shape[0], 2, 10, generator=torch.Generator().manual_seed(4))
    out, ref, grads, ref_grads = run_both(problem, max_len, width, grad, config=config)
    assert_matches(out, ref, "output")
    for gname, got, want in zip(GRAD_NAMES, grads, ref_grads):
        assert_matches(got, want, f"d {gname}")


@pytest.mark.parametrize("layout", ["transposed", "strided", "expanded"])
def test_non_contiguous_upstream_gradients(layout):
    problem, max_len, width = _case("wild", seed=5)
    n_tok, heads, dv = problem[0].shape[0], problem[0].shape[1], problem[2].shape[2]
    gen = torch.Generator().manual_seed(6)
    if layout == "transposed":  # head-major storage: rows and heads swapped in memory
        grad = torch.randn(heads, n_tok, dv, generator=gen).transpose(0, 1)
    elif layout == "strided":  # every other element of a wider buffer: head-dim stride 2
        grad = torch.randn(n_tok, heads, 2 * dv, generator=gen)[:, :, ::2]
    else:  # one row broadcast to every token and head: strides (0, 0, 1)
        grad = torch.randn(dv, generator=gen).expand(n_tok, heads, dv)
    assert not grad.is_contiguous()
    _, _, grads, ref_grads = run_both(problem, max_len, width, grad)
    for gname, got, want in zip(GRAD_NAMES, grads, ref_grads):
        assert_matches(got, want, f"d {gname} ({layout} upstream)")


def test_views_of_a_wider_projection_give_the_same_output():
    # q, k, v split off one [T, H, 3d] projection, as a model's fused uvqk matmul gives them
    problem, max_len, width = _case("chrono", seed=7)
    q, k, v, offsets, pos_w, time_w, timestamps, query_times = problem
    fused = torch.cat([q, k, v[..., :7]], dim=-1)  # dv != dqk: v is a narrower slice
    views = fused[..., :7], fused[..., 7:14], fused[..., 14:]
    assert not views[0].is_contiguous()
    args = (offsets, max_len, pos_w, time_w, timestamps, query_times, width)
    a = hat.hstu_attention_triton(*(t.to(DEVICE) for t in views), *(_to(x) for x in args))
    b = hat.hstu_attention_triton(*(t.contiguous().to(DEVICE) for t in views), *(_to(x) for x in args))
    assert torch.equal(a, b)


def _to(x):
    return x.to(DEVICE) if isinstance(x, torch.Tensor) else x


def test_reruns_are_bit_identical():
    problem, max_len, width = _case("chrono", seed=8)
    grad = torch.randn(problem[0].shape[0], 2, 10, generator=torch.Generator().manual_seed(9))
    first = run_both(problem, max_len, width, grad)
    second = run_both(problem, max_len, width, grad)
    assert torch.equal(first[0], second[0])
    for gname, a, b in zip(GRAD_NAMES, first[2], second[2]):
        assert torch.equal(a, b), gname


def _threshold_probes(num_buckets):
    """Gaps at, one below and one above every bucket's first gap, plus 0, negatives and extremes."""
    # the device's table: the kernel must match the torch formula as computed on its own device
    thresholds = hat.bucket_thresholds(num_buckets, DEVICE).cpu()
    finite = thresholds[thresholds < INT64_MAX]
    around = torch.stack([finite - 1, finite, finite + 1]).flatten()
    extremes = torch.tensor(
        [0, 1, -1, 2, -2, 3, 10**18, -(10**18), INT64_MAX, INT64_MAX - 1, -INT64_MAX, INT64_MIN]
    )
    gaps = torch.cat([around, -around, extremes]).unique()
    return gaps, thresholds


@pytest.mark.parametrize("num_buckets", [128, 10, 200])
def test_kernel_bucket_equals_the_torch_formula_around_every_threshold(num_buckets):
    # One query per probe gap: q = k = 0, no position bias and time bias b for bucket b, so the
    # score is the bucket itself. Keys all have time 0, so every key of query i has the gap
    # query_times[i], and with v = 1 the output is (i + 1) * SiLU(bucket) / W (W = 16, rows of 16).
    gaps, _ = _threshold_probes(num_buckets)
    n_tok = gaps.numel()
    lens = [16] * (n_tok // 16) + ([n_tok % 16] if n_tok % 16 else [])
    offsets = torch.tensor([0, *lens]).cumsum(0)
    zeros = torch.zeros(n_tok, 1, 16)
    v = torch.ones(n_tok, 1, 1)
    time_w = torch.arange(num_buckets + 1, dtype=torch.float32)
    out = hat.hstu_attention_triton(
        zeros.to(DEVICE), zeros.to(DEVICE), v.to(DEVICE), offsets.to(DEVICE), 16, torch.zeros(31).to(DEVICE),
        time_w.to(DEVICE), torch.zeros(n_tok, dtype=torch.long).to(DEVICE), gaps.to(DEVICE), 16,
    )  # fmt: skip
    position = torch.cat([torch.arange(n) for n in lens]).double() + 1
    silu = (out[:, 0, 0].double().cpu() * 16 / position)
    table = F.silu(time_w.double())
    got = (silu[:, None] - table[None, :]).abs().argmin(dim=1)
    want = _spec_bucket(gaps.to(DEVICE), num_buckets).cpu()
    wrong = (got != want).nonzero().flatten()
    assert wrong.numel() == 0, (
        f"gaps {gaps[wrong][:5].tolist()}: kernel {got[wrong][:5].tolist()}, torch {want[wrong][:5].tolist()}"
    )


@pytest.mark.parametrize("num_buckets", [128, 10, 200])
def test_thresholds_are_the_first_gap_of_each_bucket(num_buckets):
    thresholds = hat.bucket_thresholds(num_buckets, "cpu")
    assert thresholds.shape == (num_buckets + 2,) and thresholds[0] == 1
    assert thresholds[-1] == INT64_MAX  # the clamped bucket never exceeds num_buckets
    assert bool((thresholds[1:] >= thresholds[:-1]).all())
    for b, x in enumerate(thresholds.tolist()):
        if x == INT64_MAX:  # unreached: even the largest gap stays below b
            assert _spec_bucket(torch.tensor([INT64_MAX]), num_buckets).item() < b
            continue
        assert _spec_bucket(torch.tensor([x]), num_buckets).item() >= b
        if x > 1:
            assert _spec_bucket(torch.tensor([x - 1]), num_buckets).item() < b
    # The kernel's one-step correction relies on the formula being monotone in the gap; check it
    # over the float32 values within 64 ulps of each threshold (gaps map to those floats).
    finite = thresholds[(thresholds < INT64_MAX) & (thresholds > 1)].to(torch.float32)
    steps = torch.arange(-64, 65, dtype=torch.float32)
    near = finite[:, None] + steps[None, :] * torch.finfo(torch.float32).eps * finite[:, None]
    near = near.clamp(min=1).double().sort(dim=1).values.long()
    buckets = _spec_bucket(near, num_buckets)
    assert bool((buckets[:, 1:] >= buckets[:, :-1]).all())


def test_empty_batches_give_zeros_and_zero_gradients():
    for lens in ([], [0, 0]):
        problem = make_problem(lens, 2, 4, 3, 5)
        q = problem[0].to(DEVICE).requires_grad_()
        pos_w = problem[4].to(DEVICE).requires_grad_()
        rest = [t.to(DEVICE) for t in problem]
        out = hat.hstu_attention_triton(q, rest[1], rest[2], rest[3], 5, pos_w, *rest[5:], 5)
        assert out.shape == (0, 2, 3)
        out.sum().backward()
        assert q.grad.shape == q.shape and not pos_w.grad.any()


def _args(**change):
    problem, max_len, width = _case("chrono")
    q, k, v, offsets, pos_w, time_w, timestamps, query_times = problem
    args = dict(q=q, k=k, v=v, offsets=offsets, max_len=max_len, pos_weights=pos_w, time_weights=time_w,
                timestamps=timestamps, query_times=query_times, width=width)  # fmt: skip
    args.update(change)
    return {name: _to(value) for name, value in args.items()}


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {"k": a["k"][:, :, :-1]}, "k must have q's shape"),
        (lambda a: {"v": a["v"][:-1]}, "v must be"),
        (lambda a: {"q": a["q"][:, 0]}, "must be \\[T, H, d\\]"),
        (lambda a: {"q": a["q"].double(), "k": a["k"].double()}, "q must be one of"),
        (lambda a: {"timestamps": a["timestamps"][:-1]}, "timestamps must be"),
        (lambda a: {"query_times": a["query_times"].float()}, "query_times must be"),
        (lambda a: {"offsets": a["offsets"][:-1]}, "offsets must rise"),
        (lambda a: {"offsets": a["offsets"].flip(0)}, "offsets must rise"),
        (lambda a: {"max_len": 36}, "below the longest row \\(37\\)"),
        (lambda a: {"width": 36, "max_len": 37}, "width \\(36\\) must be"),
        (lambda a: {"pos_weights": a["pos_weights"][:-1]}, "pos_weights must be"),
        (lambda a: {"time_weights": a["time_weights"][None]}, "time_weights must be"),
        (lambda a: {"max_len": 37.0}, "python ints"),
    ],
)
def test_bad_inputs_raise_clear_errors(change, message):
    args = _args()
    args.update(change(args))
    with pytest.raises(ValueError, match=message):
        hat.hstu_attention_triton(**args)


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="power of two"):
        hat.hstu_attention_triton(**_args(), config={"block_m": 24})
    with pytest.raises(ValueError, match="unknown config"):
        hat.hstu_attention_triton(**_args(), config={"tile": 16})
    with pytest.raises(ValueError, match="bwd_block_m must not exceed"):
        hat.hstu_attention_triton(**_args(), config={"bwd_block_m": 32, "bwd_block_n": 16})
