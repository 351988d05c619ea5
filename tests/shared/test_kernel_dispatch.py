"""The one kernel dispatch (recforge.kernels.twin): every op takes ``kernel=``, refuses an unknown
value in the same line, and falls back from an unusable Triton to its PyTorch reference with one
warning, returning what the reference returns."""
from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from recforge import kernels
from recforge.errors import UserInputError
from recforge.kernels.twin import KERNEL_IMPLS, check_kernel, kernel_of

# the package exports the ops, which shadow the modules of the same name: ask for the modules
di, ha, ho, ra, sl, tr = (
    importlib.import_module(f"recforge.kernels.{name}")
    for name in ("dot_interaction", "hstu_attention", "hstu_output", "rowwise_adagrad", "sampled_loss",
                 "target_rank")
)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@dataclass
class Case:
    """One op: ``call(kernel)`` runs it on fresh inputs, ``reference()`` runs its reference on the
    same inputs (for the in-place optimizer step, both return the updated state)."""

    name: str
    module: object
    call: Callable[[str], tuple]
    reference: Callable[[], tuple]


def _dot_case() -> Case:
    dense, emb = torch.randn(3, 4, generator=_gen(1)), torch.randn(3, 5, 4, generator=_gen(2))
    return Case("dot_interaction", di, lambda kernel: (di.dot_interaction(dense, emb, True, kernel=kernel),),
                lambda: (di.dot_interaction_reference(dense, emb, True),))


def _attention_case() -> Case:
    width, heads, dim = 6, 2, 3
    offsets = torch.tensor([0, 2, 2, 5])
    q, k, v = (torch.randn(5, heads, dim, generator=_gen(s)) for s in (3, 4, 5))
    pos, time = torch.randn(2 * width - 1, generator=_gen(6)), torch.randn(9, generator=_gen(7))
    stamps = torch.tensor([10, 500, 7, 90, 4000])
    query = torch.tensor([500, 900, 90, 4000, 60000])
    args = (q, k, v, offsets, 3, pos, time, stamps, query, width)

    def call(kernel):
        return (ha.hstu_attention(q, k, v, offsets, max_len=3, pos_weights=pos, time_weights=time,
                                  timestamps=stamps, query_times=query, width=width, kernel=kernel),)

    return Case("hstu_attention", ha, call, lambda: (ha.hstu_attention_reference(*args),))


def _output_case() -> Case:
    attn, u = torch.randn(4, 6, generator=_gen(8)), torch.randn(4, 6, generator=_gen(9))
    x, weight, bias = torch.randn(4, 5, generator=_gen(10)), torch.randn(5, 6, generator=_gen(11)), torch.randn(5)

    def call(kernel):
        return (ho.hstu_output(attn, u, x, weight, bias, dropout_p=0.25, seed=7, kernel=kernel),)

    return Case("hstu_output", ho, call,
                lambda: (ho.hstu_output_reference(attn, u, x, weight, bias, 0.25, 7, 1e-6),))


def _adagrad_case() -> Case:
    rows = torch.tensor([[3, 0, 3, 1]])
    values = torch.randn(4, 2, generator=_gen(12))

    def state():
        param = torch.randn(5, 2, generator=_gen(13))
        return param, torch.full_like(param, 0.5), torch.full_like(param, 0.1)

    def grad():
        return torch.sparse_coo_tensor(rows, values, (5, 2))

    def call(kernel):
        param, grad_sum, velocity = state()
        ra.sparse_adagrad_momentum_(param, grad_sum, velocity, grad(), lr=0.1, momentum=0.4, kernel=kernel)
        return param, grad_sum, velocity

    def reference():
        param, grad_sum, velocity = state()
        ra.sparse_adagrad_momentum_reference_(param, grad_sum, velocity, grad(), 0.1, 0.4, 1e-6)
        return param, grad_sum, velocity

    return Case("sparse_adagrad_momentum_", ra, call, reference)


def _xe_case() -> Case:
    scores, log_q = torch.randn(3, 7, generator=_gen(14)), torch.randn(7, generator=_gen(15))
    return Case("sampled_softmax_xe", sl,
                lambda kernel: (sl.sampled_softmax_xe(scores, log_q, 0.5, 4, kernel=kernel),),
                lambda: (sl.sampled_softmax_xe_reference(scores, log_q, 0.5, 4),))


def _bprmax_case() -> Case:
    scores = torch.randn(3, 7, generator=_gen(16))
    return Case("sampled_bprmax", sl,
                lambda kernel: (sl.sampled_bprmax(scores, 0.3, 0.5, 4, kernel=kernel),),
                lambda: (sl.sampled_bprmax_reference(scores, 0.3, 0.5, 4),))


def _rank_case() -> Case:
    # small integers: every score is exact, so the full score matrix is an exact oracle, ties included
    q = torch.randint(-2, 3, (4, 3), generator=_gen(17)).float()
    w = torch.randint(-2, 3, (9, 3), generator=_gen(18)).float()
    t = torch.tensor([0, 4, 8, 4])
    return Case("target_rank_counts", tr, lambda kernel: tr.target_rank_counts(q, w, None, t, kernel=kernel),
                lambda: tr.target_rank_counts_reference(q @ w.T, t))


CASES = [_dot_case, _attention_case, _output_case, _adagrad_case, _xe_case, _bprmax_case, _rank_case]


@pytest.fixture(params=CASES, ids=lambda make: make.__name__.strip("_").removesuffix("_case"))
def case(request) -> Case:
    return request.param()


def _assert_same(got: tuple, want: tuple) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w), (g, w)


def test_every_op_is_exported_from_the_package() -> None:
    public = {name for name in kernels.__all__}
    assert public == {"dot_interaction", "hstu_attention", "hstu_output", "sparse_adagrad_momentum_",
                      "sampled_softmax_xe", "sampled_bprmax", "target_rank_counts"}
    assert {make().name for make in CASES} == public
    for name in public:
        assert callable(getattr(kernels, name))


def test_an_unknown_kernel_is_refused_in_one_line(case) -> None:
    for bad, shown in (("cuda", "'cuda'"), ("Triton", "'Triton'"), (None, "None")):
        with pytest.raises(UserInputError) as caught:
            case.call(bad)
        assert str(caught.value) == f"unknown kernel {shown}; allowed values: pytorch, triton"


def test_pytorch_runs_the_reference(case) -> None:
    _assert_same(case.call("pytorch"), case.reference())


def test_an_unusable_triton_falls_back_with_one_warning(case, monkeypatch) -> None:
    twin = case.module.TRITON
    monkeypatch.setattr(twin, "available", lambda: False)
    monkeypatch.setattr(twin, "warned", False)

    def no_triton():
        raise AssertionError("the Triton module was asked for although Triton is unusable")

    monkeypatch.setattr(twin, "module", no_triton)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = case.call("triton")
        second = case.call("triton")
    fallback = [c for c in caught if "kernel='triton'" in str(c.message)]
    assert [str(c.message) for c in fallback] == [
        (f"{case.name}(kernel='triton'): Triton could not be imported (unavailable); using the "
         "PyTorch implementation (this warning is shown once)")
    ]
    assert fallback[0].category is RuntimeWarning
    assert fallback[0].filename == __file__  # the line that called the op, past any torch wrapper
    _assert_same(first, case.reference())
    _assert_same(second, case.reference())


def test_the_fallback_also_runs_inside_a_compiled_function(monkeypatch) -> None:
    # under torch.compile the Triton branch runs outside the graph; its fallback is the same
    monkeypatch.setattr(di.TRITON, "available", lambda: False)
    monkeypatch.setattr(di.TRITON, "warned", False)
    dense, emb = torch.randn(3, 4, generator=_gen(1)), torch.randn(3, 5, 4, generator=_gen(2))
    compiled = torch.compile(lambda d, e: di.dot_interaction(d, e, kernel="triton") * 2.0, backend="eager")
    with pytest.warns(RuntimeWarning, match=r"dot_interaction\(kernel='triton'\): Triton could not be imported"):
        got = compiled(dense, emb)
    assert torch.equal(got, di.dot_interaction_reference(dense, emb) * 2.0)


def test_the_switch_values_are_the_literal_type() -> None:
    assert KERNEL_IMPLS == ("pytorch", "triton")
    assert [check_kernel(k) for k in KERNEL_IMPLS] == ["pytorch", "triton"]
    with pytest.raises(UserInputError, match=r"^unknown loss.kernel 'gpu'; allowed values: pytorch, triton$"):
        check_kernel("gpu", "loss.kernel")


def test_a_model_part_reads_its_kernel_mapping() -> None:
    assert kernel_of("model.attention", None) == "pytorch"
    assert kernel_of("model.attention", {}) == "pytorch"
    assert kernel_of("model.attention", {"kernel": "triton"}) == "triton"
    with pytest.raises(UserInputError, match=r"^unknown model.output.kernel 'cuda'; allowed"):
        kernel_of("model.output", {"kernel": "cuda"})
    with pytest.raises(UserInputError, match=r"^model.output takes only 'kernel', got \['impl'\]$"):
        kernel_of("model.output", {"impl": "triton"})
