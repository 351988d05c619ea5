"""GRU4Rec model (spec §1.3, §1.7) against GRU cells written out gate by gate."""
from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from recforge.models.gru4rec import GRU4Rec, OneHotGRUCell, OriginalGRUCell

N_ITEMS = 37


# ----------------------------------------------------------------------------- naive references
def naive_gru_cell(x, h, w_ih, w_hh, b_ih, b_hh):
    """nn.GRUCell's formulas, gate by gate (rows of w_ih / w_hh are blocks [r | z | n])."""
    k = h.shape[1]
    w_ir, w_iz, w_in = w_ih[:k], w_ih[k : 2 * k], w_ih[2 * k :]
    w_hr, w_hz, w_hn = w_hh[:k], w_hh[k : 2 * k], w_hh[2 * k :]
    b_ir, b_iz, b_in = b_ih[:k], b_ih[k : 2 * k], b_ih[2 * k :]
    b_hr, b_hz, b_hn = b_hh[:k], b_hh[k : 2 * k], b_hh[2 * k :]
    r = torch.sigmoid(x @ w_ir.T + b_ir + h @ w_hr.T + b_hr)
    z = torch.sigmoid(x @ w_iz.T + b_iz + h @ w_hz.T + b_hz)
    n = torch.tanh(x @ w_in.T + b_in + r * (h @ w_hn.T + b_hn))
    return (1.0 - z) * n + z * h


def naive_original_cell(x, h, wx, wh, b):
    """The original single-bias GRU, gate by gate: columns of wx / wh / b are blocks [c | r | z]."""
    k = h.shape[1]
    w_c, w_r, w_z = wx[:, :k], wx[:, k : 2 * k], wx[:, 2 * k :]
    u_h, u_r, u_z = wh[:, :k], wh[:, k : 2 * k], wh[:, 2 * k :]
    b_c, b_r, b_z = b[:k], b[k : 2 * k], b[2 * k :]
    r = torch.sigmoid(x @ w_r + b_r + h @ u_r)
    z = torch.sigmoid(x @ w_z + b_z + h @ u_z)
    candidate = torch.tanh((r * h) @ u_h + x @ w_c + b_c)
    return (1.0 - z) * h + z * candidate


def naive_cell_from_module(cell, x, h):
    if isinstance(cell, OriginalGRUCell):
        return naive_original_cell(x, h, cell.Wx, cell.Wh, cell.bias)
    assert isinstance(cell, torch.nn.GRUCell)
    return naive_gru_cell(x, h, cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)


def naive_onehot_layer(cell: OneHotGRUCell, items, h, n_items):
    """The original single-bias GRU on an explicit one-hot vector: a = x·Wx + b as [cand | r | z]."""
    k = cell.hidden_size
    x = F.one_hot(items, n_items).to(h.dtype)
    a = x @ cell.Wx.weight + cell.bias
    a_c, a_r, a_z = a[:, :k], a[:, k : 2 * k], a[:, 2 * k :]
    u_h, u_r, u_z = cell.Wh[:, :k], cell.Wh[:, k : 2 * k], cell.Wh[:, 2 * k :]
    r = torch.sigmoid(a_r + h @ u_r)
    z = torch.sigmoid(a_z + h @ u_z)
    candidate = torch.tanh((r * h) @ u_h + a_c)
    return (1.0 - z) * h + z * candidate


def make_model(seed=0, **kwargs) -> GRU4Rec:
    torch.manual_seed(seed)
    model = GRU4Rec(n_items=N_ITEMS, **kwargs).double()
    # Biases are zero at init; make them random so that their wiring is tested too.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or name == "By.weight":
                p.normal_(0.0, 0.5)
    return model


def random_state(model, batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, w, generator=g, dtype=torch.float64) * 0.5 for w in model.state_widths]


ITEMS = torch.tensor([0, 5, 5, 36, 12, 3])


# ----------------------------------------------------------------------------- forward equivalence
def test_constrained_step_equals_naive_gru():
    model = make_model(hidden_size=6).eval()
    hidden = random_state(model, len(ITEMS))
    out, new_hidden = model.step(ITEMS, hidden)
    x = model.Wy.weight[ITEMS]  # shared embedding: the output matrix's rows
    want = naive_cell_from_module(model.cells[0], x, hidden[0])
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert len(new_hidden) == 1
    torch.testing.assert_close(new_hidden[0], want, rtol=1e-12, atol=1e-12)
    assert model.E is None and model.onehot is None
    assert model.state_widths == [6]


def test_onehot_first_layer_equals_single_bias_formulation():
    model = make_model(hidden_size=5, embedding=0, constrained_embedding=False).eval()
    assert isinstance(model.onehot, OneHotGRUCell) and len(model.cells) == 0
    hidden = random_state(model, len(ITEMS))
    out, new_hidden = model.step(ITEMS, hidden)
    want = naive_onehot_layer(model.onehot, ITEMS, hidden[0], N_ITEMS)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(new_hidden[0], want, rtol=1e-12, atol=1e-12)
    # The cell alone, too.
    torch.testing.assert_close(model.onehot(ITEMS, hidden[0]), want, rtol=1e-12, atol=1e-12)


def test_onehot_gate_layout_hand_example():
    # h = 1, one item: a = [c, r, z] = Wx[item] + b, U = [u_h, u_r, u_z].
    cell = OneHotGRUCell(n_items=2, hidden_size=1, sparse=False).double()
    with torch.no_grad():
        cell.Wx.weight.copy_(torch.tensor([[0.3, -0.2, 0.5], [9.0, 9.0, 9.0]], dtype=torch.float64))
        cell.bias.copy_(torch.tensor([0.1, 0.2, -0.3], dtype=torch.float64))
        cell.Wh.copy_(torch.tensor([[0.7, -0.4, 0.6]], dtype=torch.float64))
    h = torch.tensor([[0.8]], dtype=torch.float64)
    got = cell(torch.tensor([0]), h).item()
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    r = sig(-0.2 + 0.2 + 0.8 * -0.4)
    z = sig(0.5 - 0.3 + 0.8 * 0.6)
    cand = math.tanh(r * 0.8 * 0.7 + 0.3 + 0.1)
    assert got == pytest.approx((1 - z) * 0.8 + z * cand, rel=1e-12)


def test_separate_embedding_uses_E():
    model = make_model(hidden_size=6, embedding=4, constrained_embedding=False).eval()
    assert model.E is not None and tuple(model.E.weight.shape) == (N_ITEMS, 4)
    assert model.cells[0].input_size == 4
    hidden = random_state(model, len(ITEMS))
    out, _ = model.step(ITEMS, hidden)
    want = naive_cell_from_module(model.cells[0], model.E.weight[ITEMS], hidden[0])
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    # The output matrix plays no part in the input.
    with torch.no_grad():
        model.Wy.weight.mul_(-3.0)
    torch.testing.assert_close(model.step(ITEMS, hidden)[0], out)


@pytest.mark.parametrize("cell", ["torch", "original"])
@pytest.mark.parametrize("mode", ["constrained", "embedding", "onehot"])
def test_multi_layer_stacking(mode, cell):
    kwargs = {
        "constrained": dict(constrained_embedding=True),
        "embedding": dict(embedding=3, constrained_embedding=False),
        "onehot": dict(embedding=0, constrained_embedding=False),
    }[mode]
    model = make_model(layers=[5, 7, 4], cell=cell, **kwargs).eval()
    assert model.state_widths == [5, 7, 4]
    cell_type = torch.nn.GRUCell if cell == "torch" else OriginalGRUCell
    assert all(type(c) is cell_type for c in model.cells)
    hidden = random_state(model, len(ITEMS))
    out, new_hidden = model.step(ITEMS, hidden)
    cells = list(model.cells)
    if mode == "onehot":
        h1 = naive_onehot_layer(model.onehot, ITEMS, hidden[0], N_ITEMS)
    else:
        table = model.Wy if mode == "constrained" else model.E
        assert cells[0].input_size == (4 if mode == "constrained" else 3)  # d = last layer size
        h1 = naive_cell_from_module(cells.pop(0), table.weight[ITEMS], hidden[0])
    h2 = naive_cell_from_module(cells[0], h1, hidden[1])
    h3 = naive_cell_from_module(cells[1], h2, hidden[2])
    for got, want in zip(new_hidden, [h1, h2, h3]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, h3, rtol=1e-12, atol=1e-12)
    assert tuple(model.Wy.weight.shape) == (N_ITEMS, 4)


# ----------------------------------------------------------------------------- original GRU cell
@pytest.mark.parametrize("mode", ["constrained", "embedding"])
def test_original_cell_step_equals_single_bias_formulation(mode):
    kwargs = dict(constrained_embedding=True) if mode == "constrained" else dict(
        embedding=4, constrained_embedding=False
    )
    model = make_model(hidden_size=6, cell="original", **kwargs).eval()
    (cell,) = model.cells
    assert isinstance(cell, OriginalGRUCell)
    assert (cell.input_size, cell.hidden_size) == (6 if mode == "constrained" else 4, 6)
    # One input-side bias of 3h, no recurrent bias (make_model randomised it).
    assert tuple(cell.bias.shape) == (18,) and cell.bias.abs().sum() > 0
    assert sorted(n for n, _ in cell.named_parameters()) == ["Wh", "Wx", "bias"]
    hidden = random_state(model, len(ITEMS))
    out, new_hidden = model.step(ITEMS, hidden)
    table = model.Wy if mode == "constrained" else model.E
    want = naive_original_cell(table.weight[ITEMS], hidden[0], cell.Wx, cell.Wh, cell.bias)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(new_hidden[0], want, rtol=1e-12, atol=1e-12)
    # The training path (one shared lookup in the constrained mode) runs the same cell.
    columns = torch.tensor([3, 0, 36, 3])
    scores, _ = model.train_step(ITEMS, hidden, columns)
    torch.testing.assert_close(scores, model.score_columns(want, columns), rtol=1e-12, atol=1e-12)


def test_original_cell_gate_layout_hand_example():
    # h = 1, input size 2: a = x·Wx + b = [c, r, z]; Wh = [u_h, u_r, u_z]. z gates the candidate.
    cell = OriginalGRUCell(input_size=2, hidden_size=1).double()
    with torch.no_grad():
        cell.Wx.copy_(torch.tensor([[0.3, -0.2, 0.5], [0.1, 0.4, -0.6]], dtype=torch.float64))
        cell.bias.copy_(torch.tensor([0.1, 0.2, -0.3], dtype=torch.float64))
        cell.Wh.copy_(torch.tensor([[0.7, -0.4, 0.6]], dtype=torch.float64))
    x = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    h = torch.tensor([[0.8]], dtype=torch.float64)
    got = cell(x, h).item()
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    a_c, a_r, a_z = 0.3 + 0.2 + 0.1, -0.2 + 0.8 + 0.2, 0.5 - 1.2 - 0.3
    r = sig(a_r + 0.8 * -0.4)
    z = sig(a_z + 0.8 * 0.6)
    cand = math.tanh(r * 0.8 * 0.7 + a_c)
    assert got == pytest.approx((1 - z) * 0.8 + z * cand, rel=1e-12)


def test_original_cell_matches_onehot_cell_on_one_hot_input():
    # Same formulation: a dense cell fed explicit one-hot vectors is the one-hot row-lookup cell.
    torch.manual_seed(4)
    onehot = OneHotGRUCell(N_ITEMS, 5, sparse=False).double()
    dense = OriginalGRUCell(N_ITEMS, 5).double()
    with torch.no_grad():
        dense.Wx.copy_(onehot.Wx.weight)
        dense.Wh.copy_(onehot.Wh)
        onehot.bias.normal_(0.0, 0.5)
        dense.bias.copy_(onehot.bias)
    h = torch.randn(len(ITEMS), 5, dtype=torch.float64)
    x = F.one_hot(ITEMS, N_ITEMS).double()
    torch.testing.assert_close(dense(x, h), onehot(ITEMS, h), rtol=1e-12, atol=1e-12)


def _original_from_torch(torch_cell: torch.nn.GRUCell, negate_z: bool) -> OriginalGRUCell:
    """An original cell with the torch cell's weights moved into the [c | r | z] layout."""
    k = torch_cell.hidden_size
    w_ih, w_hh, b_ih = torch_cell.weight_ih, torch_cell.weight_hh, torch_cell.bias_ih
    sign = -1.0 if negate_z else 1.0
    cell = OriginalGRUCell(torch_cell.input_size, k).double()
    with torch.no_grad():
        # torch rows are [r | z | n] of W (out x in); the original's columns are [c | r | z] of x·W.
        cell.Wx.copy_(torch.cat([w_ih[2 * k :], w_ih[:k], sign * w_ih[k : 2 * k]]).T)
        cell.Wh.copy_(torch.cat([w_hh[2 * k :], w_hh[:k], sign * w_hh[k : 2 * k]]).T)
        cell.bias.copy_(torch.cat([b_ih[2 * k :], b_ih[:k], sign * b_ih[k : 2 * k]]))
    return cell


@pytest.mark.parametrize("negate_z", [False, True])
def test_original_and_torch_cells_are_different_formulations(negate_z):
    torch.manual_seed(5)
    x = torch.randn(6, 4, dtype=torch.float64)
    h = torch.randn(6, 3, dtype=torch.float64) * 0.5
    torch_cell = torch.nn.GRUCell(4, 3).double()
    with torch.no_grad():
        torch_cell.bias_hh.zero_()  # the original has no recurrent bias
    original = _original_from_torch(torch_cell, negate_z)
    # Same weights, same shapes, different results: z gates the other side, and r scales h before
    # U_h (original) instead of after (torch). Flipping z's sign (z -> 1 - z) removes only the first.
    diff = (original(x, h) - torch_cell(x, h)).abs().max().item()
    assert diff > 1e-3
    n_torch = sum(p.numel() for p in torch_cell.parameters())
    assert n_torch - sum(p.numel() for p in original.parameters()) == 3 * 3  # no recurrent bias


def test_original_and_torch_cells_agree_only_where_the_formulations_coincide():
    # With one unit, r ⊙ (h·U_h) = (r ⊙ h)·U_h; with z's sign flipped the z-gating also lines up,
    # so the two cells agree exactly: the mapping above is right and only the formulas differ.
    torch.manual_seed(6)
    x = torch.randn(6, 4, dtype=torch.float64)
    h = torch.randn(6, 1, dtype=torch.float64)
    torch_cell = torch.nn.GRUCell(4, 1).double()
    with torch.no_grad():
        torch_cell.bias_hh.zero_()
    original = _original_from_torch(torch_cell, negate_z=True)
    torch.testing.assert_close(original(x, h), torch_cell(x, h), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["constrained", "onehot"])
def test_torch_and_original_models_differ(mode):
    kwargs = dict(constrained_embedding=True) if mode == "constrained" else dict(
        embedding=0, constrained_embedding=False
    )
    outs = {}
    for cell in ("torch", "original"):
        model = make_model(seed=0, layers=[6, 6], cell=cell, **kwargs).eval()
        outs[cell] = model.step(ITEMS, random_state(model, len(ITEMS)))[0]
    assert (outs["torch"] - outs["original"]).abs().max() > 1e-3


def test_original_cell_gradients_reach_every_parameter():
    model = make_model(layers=[5, 4], cell="original").train()
    hidden = random_state(model, len(ITEMS))
    scores, _ = model.train_step(ITEMS, hidden, torch.tensor([1, 2, 3]))
    scores.pow(2).sum().backward()
    for name, p in model.named_parameters():
        if name.startswith("cells."):
            assert p.grad is not None and not p.grad.is_sparse and p.grad.abs().sum() > 0, name


# ----------------------------------------------------------------------------- dropout
def _check_inverted_dropout(dropped, clean, p):
    scaled = clean / (1.0 - p)
    is_zero = dropped == 0
    assert is_zero.any() and (~is_zero).any(), "expected some dropped and some kept units"
    torch.testing.assert_close(dropped[~is_zero], scaled[~is_zero], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["constrained", "onehot"])
def test_hidden_dropout_is_inverted_and_is_the_carried_state(mode):
    p = 0.5
    kwargs = dict(constrained_embedding=True) if mode == "constrained" else dict(
        embedding=0, constrained_embedding=False, dropout_p_embed=p
    )
    model = make_model(layers=[16, 16], dropout_p_hidden=p, **kwargs)
    items = torch.arange(24) % N_ITEMS
    hidden = random_state(model, len(items))
    model.train()
    torch.manual_seed(123)
    out, new_hidden = model.step(items, hidden)
    # The dropped-out vector is both the output and the state carried to the next step.
    assert torch.equal(out, new_hidden[-1])
    # Layer 1 (dropped out, inverted) ...
    if mode == "onehot":
        clean1 = naive_onehot_layer(model.onehot, items, hidden[0], N_ITEMS)
        cell2 = model.cells[0]
    else:
        clean1 = naive_cell_from_module(model.cells[0], model.Wy.weight[items], hidden[0])
        cell2 = model.cells[1]
    _check_inverted_dropout(new_hidden[0], clean1, p)
    # ... is what layer 2 sees.
    clean2 = naive_cell_from_module(cell2, new_hidden[0], hidden[1])
    _check_inverted_dropout(new_hidden[1], clean2, p)


def test_eval_mode_has_no_dropout():
    model = make_model(layers=[8, 8], dropout_p_embed=0.9, dropout_p_hidden=0.9).eval()
    hidden = random_state(model, len(ITEMS))
    out, new_hidden = model.step(ITEMS, hidden)
    h1 = naive_cell_from_module(model.cells[0], model.Wy.weight[ITEMS], hidden[0])
    h2 = naive_cell_from_module(model.cells[1], h1, hidden[1])
    torch.testing.assert_close(new_hidden[0], h1, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, h2, rtol=1e-12, atol=1e-12)


def test_embedding_dropout_hits_the_input_vector():
    # p_embed = 1 drops the whole input embedding: the layer sees a zero input.
    model = make_model(hidden_size=6, dropout_p_embed=1.0).train()
    hidden = random_state(model, len(ITEMS))
    out, _ = model.step(ITEMS, hidden)
    zero_in = torch.zeros(len(ITEMS), 6, dtype=torch.float64)
    torch.testing.assert_close(out, naive_cell_from_module(model.cells[0], zero_in, hidden[0]))
    model.eval()
    out, _ = model.step(ITEMS, hidden)
    want = naive_cell_from_module(model.cells[0], model.Wy.weight[ITEMS], hidden[0])
    torch.testing.assert_close(out, want)


def test_onehot_layer_uses_embed_dropout_not_hidden_dropout():
    # PyTorch reference: the one-hot first layer's output gets dropout_p_embed (spec §1.3).
    model = make_model(hidden_size=6, embedding=0, constrained_embedding=False, dropout_p_hidden=1.0)
    model.train()
    hidden = random_state(model, len(ITEMS))
    out, _ = model.step(ITEMS, hidden)
    torch.testing.assert_close(out, naive_onehot_layer(model.onehot, ITEMS, hidden[0], N_ITEMS))
    model.dropout_p_embed = 1.0
    out, new_hidden = model.step(ITEMS, hidden)
    assert not out.any() and not new_hidden[0].any()


# ----------------------------------------------------------------------------- scoring
def test_score_columns_and_item_weights():
    model = make_model(layers=[5, 3]).eval()
    g = torch.Generator().manual_seed(3)
    output = torch.randn(4, 3, generator=g, dtype=torch.float64)
    columns = torch.tensor([7, 0, 7, 36, 2, 2, 19])  # duplicates allowed
    full = output @ model.Wy.weight.T + model.By.weight.T
    torch.testing.assert_close(model.score_columns(output, columns), full[:, columns])
    weights, bias = model.item_weights()
    assert tuple(weights.shape) == (N_ITEMS, 3) and tuple(bias.shape) == (N_ITEMS,)
    torch.testing.assert_close(output @ weights.T + bias, full)
    assert weights.data_ptr() == model.Wy.weight.data_ptr()


# ----------------------------------------------------------------------------- init and config
def _assert_uniform_block(block, fan_in, fan_out):
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    assert block.abs().max().item() <= bound + 1e-7, (tuple(block.shape), bound)
    if block.numel() >= 100:
        # Drawn over the whole range (a smaller, whole-matrix bound would fail this).
        assert block.abs().max().item() > 0.8 * bound
        assert abs(block.mean().item()) < 0.2 * bound


@pytest.mark.parametrize("cell_kind", ["torch", "original"])
@pytest.mark.parametrize(
    "kwargs,first_in",
    [
        (dict(layers=[24, 16], constrained_embedding=True), 16),
        (dict(layers=[24, 16], embedding=9, constrained_embedding=False), 9),
        (dict(layers=[24, 16], embedding=0, constrained_embedding=False), None),
    ],
)
def test_init_per_gate_block_bounds_and_zero_biases(kwargs, first_in, cell_kind):
    torch.manual_seed(0)
    model = GRU4Rec(n_items=200, cell=cell_kind, **kwargs)
    _assert_uniform_block(model.Wy.weight, 200, 16)
    assert not model.By.weight.any()
    if model.E is not None:
        _assert_uniform_block(model.E.weight, 200, 9)
    in_size = first_in
    cells = list(model.cells)
    if model.onehot is not None:
        h = model.onehot.hidden_size
        for k in range(3):
            _assert_uniform_block(model.onehot.Wx.weight[:, k * h : (k + 1) * h], 200, h)
            _assert_uniform_block(model.onehot.Wh[:, k * h : (k + 1) * h], h, h)
        assert not model.onehot.bias.any()
        in_size = h
    else:
        assert cells[0].input_size == first_in
    for cell in cells:
        h = cell.hidden_size
        assert cell.input_size == in_size
        if cell_kind == "original":
            assert isinstance(cell, OriginalGRUCell)
            assert tuple(cell.Wx.shape) == (in_size, 3 * h) and tuple(cell.Wh.shape) == (h, 3 * h)
            for k in range(3):
                _assert_uniform_block(cell.Wx[:, k * h : (k + 1) * h], cell.input_size, h)
                _assert_uniform_block(cell.Wh[:, k * h : (k + 1) * h], h, h)
            assert not cell.bias.any()
        else:
            assert isinstance(cell, torch.nn.GRUCell)
            for k in range(3):
                _assert_uniform_block(cell.weight_ih[k * h : (k + 1) * h], cell.input_size, h)
                _assert_uniform_block(cell.weight_hh[k * h : (k + 1) * h], h, h)
            assert not cell.bias_ih.any() and not cell.bias_hh.any()
        in_size = h


def test_reset_parameters_redraws_original_cells():
    torch.manual_seed(0)
    model = GRU4Rec(n_items=50, layers=[8, 8], cell="original")
    with torch.no_grad():
        for p in model.cells.parameters():
            p.fill_(5.0)
    model.reset_parameters()
    for cell in model.cells:
        assert not cell.bias.any()
        assert cell.Wx.abs().max() <= math.sqrt(6.0 / 16) and cell.Wh.abs().max() <= math.sqrt(6.0 / 16)


def test_invalid_configurations_raise():
    with pytest.raises(ValueError):
        GRU4Rec(n_items=10, hidden_size=4, embedding=3, constrained_embedding=True)
    with pytest.raises(ValueError):
        GRU4Rec(n_items=10, layers=[4, 0])
    with pytest.raises(ValueError, match="cell"):
        GRU4Rec(n_items=10, hidden_size=4, cell="lstm")


def test_default_cell_is_torch():
    model = GRU4Rec(n_items=10, hidden_size=4)
    assert model.cell == "torch" and isinstance(model.cells[0], torch.nn.GRUCell)


# ----------------------------------------------------------------------------- sparse gradients
@pytest.mark.parametrize("mode", ["constrained", "onehot"])
def test_sparse_embeddings_give_sparse_gradients(mode):
    kwargs = dict(constrained_embedding=True) if mode == "constrained" else dict(
        embedding=0, constrained_embedding=False
    )
    items = torch.tensor([1, 4, 4, 9])
    columns = torch.tensor([4, 11, 2, 2, 30])
    grads = {}
    for sparse in (True, False):
        torch.manual_seed(0)
        model = GRU4Rec(n_items=N_ITEMS, hidden_size=6, sparse_embeddings=sparse, **kwargs).double()
        hidden = random_state(model, len(items))
        out, _ = model.step(items, hidden)
        model.score_columns(out, columns).pow(2).sum().backward()
        grads[sparse] = {n: p.grad for n, p in model.named_parameters()}
    sparse_g, dense_g = grads[True], grads[False]
    sparse_names = ["Wy.weight", "By.weight"] + (["onehot.Wx.weight"] if mode == "onehot" else [])
    for name in sparse_names:
        assert sparse_g[name].is_sparse, name
        assert not dense_g[name].is_sparse
        torch.testing.assert_close(sparse_g[name].to_dense(), dense_g[name])
    # Only the rows touched by the step (inputs and scored columns) get a gradient.
    touched = set(columns.tolist()) | (set(items.tolist()) if mode == "constrained" else set())
    rows = set(sparse_g["Wy.weight"].coalesce().indices()[0].tolist())
    assert rows == touched
    if mode == "onehot":
        rows = set(sparse_g["onehot.Wx.weight"].coalesce().indices()[0].tolist())
        assert rows == set(items.tolist())
    for name, g in sparse_g.items():
        if name not in sparse_names:
            assert not g.is_sparse, name
