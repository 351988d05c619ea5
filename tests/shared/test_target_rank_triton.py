"""The Triton twin of target_rank_counts against the PyTorch path (interpreter on CPU-only machines).

Shapes stay tiny because the interpreter runs every program in numpy, one at a time; on CPU the
kernel uses 16 x 32 x 16 tiles, so the shapes below still cover several row blocks, partial item
tiles and a multi-step loop over d.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from recforge.kernels import target_rank as tr
from recforge.kernels import target_rank_counts
from recforge.kernels.target_rank import target_rank_counts_reference

pytestmark = pytest.mark.triton
trt = pytest.importorskip("recforge.kernels.target_rank_triton")

if not torch.cuda.is_available() and not trt.INTERPRETED:
    pytest.skip("no GPU and TRITON_INTERPRET=1 was not set before import", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def launches(monkeypatch):
    """Counts launches of the Triton twin, so a silent fallback cannot pass for a match."""
    calls = []
    real = trt.target_rank_counts_triton

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(trt, "target_rank_counts_triton", spy)
    return calls


def _problem(kind: str, n_rows: int, n_items: int, dim: int, with_bias: bool, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    if kind == "float":
        queries = torch.randn(n_rows, dim, generator=gen)
        items = torch.randn(n_items, dim, generator=gen)
        bias = torch.randn(n_items, generator=gen) if with_bias else None
    elif kind == "int":
        # values in {-1, 0, 1}: every score is exact in any precision and order, and heavily tied
        queries = torch.randint(-1, 2, (n_rows, dim), generator=gen).float()
        items = torch.randint(-1, 2, (n_items, dim), generator=gen).float()
        bias = torch.randint(0, 2, (n_items,), generator=gen).float() if with_bias else None
    else:  # constant: every item ties with every target
        queries = torch.full((n_rows, dim), 0.5)
        items = torch.full((n_items, dim), 0.25)
        bias = torch.full((n_items,), -1.0) if with_bias else None
    targets = torch.randint(0, n_items, (n_rows,), generator=gen)
    return queries, items, bias, targets


def _to(device, dtype, *tensors):
    return [None if t is None else t.to(device=device, dtype=dtype) for t in tensors]


def _assert_same(got, want) -> None:
    assert got[0].dtype == torch.int64 and got[1].dtype == torch.int64
    assert got[0].tolist() == want[0].tolist()
    assert got[1].tolist() == want[1].tolist()


@pytest.mark.parametrize("kind", ["float", "int"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 5, 3), (7, 23, 17), (20, 150, 40)])
def test_matches_pytorch_fp32(kind, with_bias, shape, launches) -> None:
    n_rows, n_items, dim = shape
    q, w, b, t = _problem(kind, n_rows, n_items, dim, with_bias, seed=n_rows + dim)
    q, w, b = _to(DEVICE, torch.float32, q, w, b)
    t = t.to(DEVICE)
    want = target_rank_counts(q, w, b, t, chunk_size=16)
    got = target_rank_counts(q, w, b, t, kernel="triton")
    assert launches, "the Triton kernel was not used"
    _assert_same(got, want)
    if kind == "int" and n_items > 5:  # the comparison only means something with ties
        assert (want[1] > 1).any()


@pytest.mark.parametrize("kind", ["float", "int"])
@pytest.mark.parametrize(
    "q_dtype,w_dtype",
    [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.bfloat16)],
)
def test_matches_pytorch_low_precision(kind, q_dtype, w_dtype, launches) -> None:
    q, w, b, t = _problem(kind, 19, 70, 37, True, seed=5)
    q = q.to(DEVICE, q_dtype)
    w, b = _to(DEVICE, w_dtype, w, b)
    t = t.to(DEVICE)
    got = target_rank_counts(q, w, b, t, kernel="triton")
    assert launches
    _assert_same(got, target_rank_counts(q, w, b, t))


@pytest.mark.parametrize("with_bias", [False, True])
def test_constant_scores_all_tie(with_bias, launches) -> None:
    n_items = 45
    q, w, b, t = _problem("constant", 18, n_items, 20, with_bias, seed=0)
    q, w, b = _to(DEVICE, torch.float32, q, w, b)
    t = t.to(DEVICE)
    n_greater, n_equal = target_rank_counts(q, w, b, t, kernel="triton")
    assert launches
    assert n_greater.tolist() == [0] * 18
    assert n_equal.tolist() == [n_items] * 18


def test_catalogue_splits_and_block_sizes() -> None:
    q, w, b, t = _problem("int", 20, 150, 40, True, seed=9)
    q, w, b, t = q.to(DEVICE), w.to(DEVICE), b.to(DEVICE), t.to(DEVICE)
    want = target_rank_counts_reference(q @ w.T + b, t)
    for n_splits in (2, 3, 5):  # interpreter: 5 tiles of 32 items, so uneven and one-tile splits
        _assert_same(trt.target_rank_counts_triton(q, w, b, t, n_splits=n_splits), want)
    _assert_same(trt.target_rank_counts_triton(q, w, b, t, block_sizes=(16, 16, 64)), want)
    with pytest.raises(ValueError, match="BLOCK_B <= BLOCK_N"):
        trt.target_rank_counts_triton(q, w, b, t, block_sizes=(32, 16, 16))


@pytest.mark.parametrize("upcast", [True, False], ids=["fp32-tiles", "half-tiles"])
@pytest.mark.parametrize("n_rows", [70, 20])
def test_gpu_tile_shapes(n_rows, upcast) -> None:
    # The tiles a GPU launch picks (interpreted here on CPU): several row blocks or one partial
    # one, a d-loop of 16-wide steps with a partial last step (d=100), partial item tiles.
    blocks = trt._block_sizes(n_rows, 100, on_gpu=True, upcast=upcast)
    q, w, b, t = _problem("int", n_rows, 300, 100, True, seed=n_rows)
    q, w, b, t = q.to(DEVICE), w.to(DEVICE), b.to(DEVICE), t.to(DEVICE)
    want = target_rank_counts_reference(q @ w.T + b, t)
    _assert_same(trt.target_rank_counts_triton(q, w, b, t, n_splits=2, block_sizes=blocks), want)


@pytest.mark.skipif(
    DEVICE == "cpu",
    reason="the interpreter's dot is numpy's BLAS matmul, whose rounding depends on the column",
)
def test_duplicated_target_rows_tie_exactly() -> None:
    # Copies of a target's row score bit-for-bit like the target only if the target score goes
    # through the same dot path as the catalogue tiles; a separate dot product would miss by ulps.
    gen = torch.Generator().manual_seed(1)
    n_rows, dim = 6, 40
    q = torch.randn(n_rows, dim, generator=gen)
    base = torch.randn(40, dim, generator=gen)
    targets = torch.arange(n_rows)
    # item rows: 40 distinct, then 3 copies of each target row at scattered positions
    w = torch.cat([base, base[:n_rows], base[:n_rows], base[:n_rows]])
    perm = torch.randperm(w.shape[0], generator=gen)
    w = w[perm]
    inverse = torch.argsort(perm)
    targets = inverse[targets]
    base_bias = torch.randn(40, generator=gen)
    bias = torch.cat([base_bias, base_bias[:n_rows], base_bias[:n_rows], base_bias[:n_rows]])[perm]
    q, w, bias, targets = (x.to(DEVICE) for x in (q, w, bias, targets))
    n_greater, n_equal = trt.target_rank_counts_triton(q, w, bias, targets)
    assert n_equal.tolist() == [4] * n_rows
    exact = q.double() @ w.double().T + bias.double()
    want_greater = (exact > exact.gather(1, targets[:, None])).sum(1)
    assert n_greater.tolist() == want_greater.tolist()


def test_empty_batch() -> None:
    q, w = torch.zeros(0, 8, device=DEVICE), torch.randn(10, 8, device=DEVICE)
    t = torch.zeros(0, dtype=torch.long, device=DEVICE)
    n_greater, n_equal = target_rank_counts(q, w, None, t, kernel="triton")
    assert n_greater.shape == (0,) and n_equal.shape == (0,)


def test_unavailable_triton_warns_once_and_falls_back(monkeypatch, launches) -> None:
    monkeypatch.setattr(tr.TRITON, "available", lambda: False)
    monkeypatch.setattr(tr.TRITON, "warned", False)
    q, w, b, t = _problem("int", 9, 23, 4, True, seed=2)
    want = target_rank_counts_reference(q @ w.T + b, t)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = target_rank_counts(q, w, b, t, kernel="triton")
        second = target_rank_counts(q, w, None, t, kernel="triton")
    fallback = [c for c in caught if "kernel='triton'" in str(c.message)]
    assert len(fallback) == 1, [str(c.message) for c in caught]
    assert issubclass(fallback[0].category, RuntimeWarning)
    assert "could not be imported" in str(fallback[0].message)
    assert not launches
    _assert_same(first, want)
    _assert_same(second, target_rank_counts_reference(q @ w.T, t))


def test_cpu_without_interpreter_falls_back(monkeypatch, launches) -> None:
    monkeypatch.setattr(trt, "INTERPRETED", False)
    monkeypatch.setattr(tr.TRITON, "warned", False)
    q, w, b, t = _problem("int", 5, 12, 4, False, seed=3)
    with pytest.warns(RuntimeWarning, match="TRITON_INTERPRET=1 was not set"):
        got = target_rank_counts(q, w, b, t, kernel="triton")
    assert not launches
    _assert_same(got, target_rank_counts_reference(q @ w.T, t))


def test_float64_falls_back(monkeypatch, launches) -> None:
    monkeypatch.setattr(tr.TRITON, "warned", False)
    q, w, b, t = _problem("float", 5, 12, 4, True, seed=4)
    q, w, b = q.double().to(DEVICE), w.double().to(DEVICE), b.double().to(DEVICE)
    with pytest.warns(RuntimeWarning, match="float64"):
        got = target_rank_counts(q, w, b, t.to(DEVICE), kernel="triton")
    assert not launches
    _assert_same(got, target_rank_counts(q, w, b, t.to(DEVICE)))


def test_unknown_kernel_is_rejected() -> None:
    with pytest.raises(ValueError, match="pytorch, triton"):
        target_rank_counts(torch.ones(1, 2), torch.ones(3, 2), None, torch.tensor([0]), kernel="cuda")


def test_evaluation_kernel_config_reaches_the_kernel(make_cfg, launches) -> None:
    from hydra.utils import instantiate

    from recforge.data.batches import SessionStep

    n_items, n_rows = 40, 12
    cfg = make_cfg("evaluation.kernel=triton", "model.hidden_size=24")
    assert cfg.evaluation.kernel == "triton"

    def build_task(evaluation):
        return instantiate(
            cfg.task,
            _convert_="all",
            model=instantiate(cfg.model),
            loss=instantiate(cfg.loss),
            optimizer=instantiate(cfg.optimizer),
            evaluation=evaluation,
            n_items=n_items,
            item_popularity=np.ones(n_items, dtype=np.int64),
        ).eval().to(DEVICE)  # a GPU machine runs the compiled kernel, which needs CUDA tensors

    torch.manual_seed(0)
    task = build_task(instantiate(cfg.evaluation))
    assert task.evaluation.kernel == "triton"
    gen = torch.Generator().manual_seed(0)
    batch = SessionStep(
        inputs=torch.randint(0, n_items, (n_rows,), generator=gen).to(DEVICE),
        targets=torch.randint(0, n_items, (n_rows,), generator=gen).to(DEVICE),
        reset=torch.ones(n_rows, dtype=torch.bool, device=DEVICE),
    )
    task.on_validation_epoch_start()
    with torch.no_grad():
        task.validation_step(batch, 0)
    assert launches == [torch.Size([n_rows, 24])]

    # the same weights and step through the PyTorch path give the same metrics
    reference = build_task(instantiate(cfg.evaluation, kernel="pytorch"))
    reference.load_state_dict(task.state_dict())
    reference.on_validation_epoch_start()
    with torch.no_grad():
        reference.validation_step(batch, 0)
    assert len(launches) == 1
    got, want = task.evaluation.splits["val"].compute(), reference.evaluation.splits["val"].compute()
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].item() == pytest.approx(want[key].item(), abs=1e-12), key
