"""SASRec against a naive per-user float64 reference (spec §1.6; research sasrec.py)."""
from __future__ import annotations

import math

import pytest
import torch

from recforge.losses.sampled_softmax import SampledSoftmax
from recforge.models.sasrec import SASRec


def _layer_norm(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps)


def naive_user(model: SASRec, seq: list[int]) -> torch.Tensor:
    """One user's outputs ``[L, D]``: no padding, explicit causal attention, float64."""
    p = {k: v.detach().double() for k, v in model.named_parameters()}
    d = model.embedding_dim
    n = len(seq)
    x = p["item_emb.weight"][torch.tensor(seq)] * math.sqrt(d) + p["pos_emb.weight"][:n]
    for i, block in enumerate(model.blocks):
        w = {k.split(".", 2)[2]: v for k, v in p.items() if k.startswith(f"blocks.{i}.")}
        h = block.num_heads
        dh = d // h
        x_hat = _layer_norm(x)
        wq, wk, wv = w["in_proj_weight"].split(d)
        bq, bk, bv = w["in_proj_bias"].split(d)
        q, k, v = x_hat @ wq.T + bq, x @ wk.T + bk, x @ wv.T + bv
        heads = []
        for j in range(h):
            cols = slice(j * dh, (j + 1) * dh)
            scores = q[:, cols] @ k[:, cols].T / math.sqrt(dh)
            out = torch.zeros(n, dh, dtype=torch.float64)
            for t in range(n):  # query t sees keys 0..t
                s = scores[t, : t + 1]
                a = torch.exp(s - s.max())
                out[t] = (a / a.sum()) @ v[: t + 1, cols]
            heads.append(out)
        attn = torch.cat(heads, dim=1) @ w["out_proj.weight"].T + w["out_proj.bias"]
        hh = _layer_norm(x_hat + attn)
        ffn = torch.clamp(hh @ w["ffn_in.weight"].T + w["ffn_in.bias"], min=0)
        x = hh + ffn @ w["ffn_out.weight"].T + w["ffn_out.bias"]
    return x / torch.clamp(torch.sqrt((x * x).sum(dim=1, keepdim=True)), min=model.l2_norm_eps)


def _jagged(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    items = torch.tensor([i for s in seqs for i in s], dtype=torch.int64)
    offsets = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    return items, offsets


def _model(heads: int = 2, **kw) -> SASRec:
    torch.manual_seed(0)
    args = dict(n_items=40, embedding_dim=8, num_blocks=2, num_heads=heads, ffn_hidden_dim=12,
                max_sequence_length=16, extra_positions=3)
    args.update(kw)
    model = SASRec(**args).double().eval()
    # Non-zero biases, so a bias applied to the wrong input shows.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.3)
    return model


def _random_seqs(lengths: list[int], n_items: int = 40, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, n_items, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("heads", [1, 2])
def test_matches_naive_reference_on_a_jagged_batch(heads: int) -> None:
    model = _model(heads)
    seqs = _random_seqs([5, 1, 0, 16, 3, 7])
    items, offsets = _jagged(seqs)
    out = model(items, offsets)
    assert out.shape == (len(items), 8)
    expected = torch.cat([naive_user(model, s) for s in seqs if s])
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.norm(dim=1), torch.ones(len(items), dtype=torch.float64))
    last = model.encode_last(*_jagged([s for s in seqs if s]))
    torch.testing.assert_close(last, torch.stack([naive_user(model, s)[-1] for s in seqs if s]))


def test_causal() -> None:
    model = _model()
    seqs = _random_seqs([9, 6])
    items, offsets = _jagged(seqs)
    before = model(items, offsets)
    changed = items.clone()
    changed[5] = (changed[5] + 1) % 40  # row 0, position 5
    after = model(changed, offsets)
    assert torch.equal(after[:5], before[:5])
    assert not torch.allclose(after[5:9], before[5:9])
    assert torch.equal(after[9:], before[9:])


def test_a_users_outputs_do_not_depend_on_the_rest_of_the_batch() -> None:
    model = _model()
    seqs = _random_seqs([4, 11, 2, 16])
    alone = model(*_jagged([seqs[0]]))
    for others in ([seqs[1]], [seqs[3], seqs[2]], [seqs[2], seqs[1], seqs[3]]):
        batch = model(*_jagged([*others, seqs[0]]))
        torch.testing.assert_close(batch[-4:], alone, rtol=1e-12, atol=1e-13)


def test_gradients_reach_every_parameter() -> None:
    torch.manual_seed(0)
    model = SASRec(n_items=30, embedding_dim=8, num_blocks=2, num_heads=2, ffn_hidden_dim=6,
                   max_sequence_length=10, extra_positions=0)
    model.train()
    seqs = _random_seqs([10, 3, 7], n_items=30)
    items, offsets = _jagged(seqs)
    out = model(items, offsets)
    positives = torch.randint(0, 30, (len(items),))
    loss = SampledSoftmax(n_negatives=5, seed=3)(out, positives, model.item_table)
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


def test_parameter_count_matches_the_spec_for_ml_1m() -> None:
    model = SASRec(n_items=3953, embedding_dim=50, num_blocks=2, num_heads=1, ffn_hidden_dim=50)
    total = sum(p.numel() for p in model.parameters())
    assert model.pos_emb.num_embeddings == 211
    assert total == 238_800
    assert total - model.item_table.numel() == 41_150


def test_initialisation_follows_the_reference() -> None:
    torch.manual_seed(0)
    d = 64
    model = SASRec(n_items=5000, embedding_dim=d, num_blocks=1, num_heads=1, ffn_hidden_dim=32)
    items = model.item_table.detach()
    assert items.abs().max() <= 0.04 and abs(items.std().item() - 0.02 * 0.88) < 0.001
    pos = model.pos_emb.weight.detach()
    assert pos.abs().max() <= 2 / math.sqrt(d) + 1e-7
    block = model.blocks[0]
    assert abs(block.in_proj_weight.std().item() - math.sqrt(2 / (4 * d))) < 0.01
    assert abs(block.ffn_in.weight.std().item() - math.sqrt(2 / (d + 32))) < 0.01
    assert not block.in_proj_bias.any() and not block.out_proj.bias.any()
    assert block.ffn_in.bias.abs().max() <= 1 / math.sqrt(d) and block.ffn_in.bias.any()


def test_item_embeddings_for_scoring_are_normalised_and_the_raw_table_is_the_parameter() -> None:
    model = _model()
    assert model.item_embeddings(normalize=False) is model.item_table
    normed = model.item_embeddings()
    table = model.item_table
    torch.testing.assert_close(normed, table / table.norm(dim=1, keepdim=True))


def test_refuses_histories_longer_than_the_position_table_and_empty_last_rows() -> None:
    model = _model()
    with pytest.raises(ValueError, match="truncate"):
        model(*_jagged(_random_seqs([20])))
    with pytest.raises(ValueError, match="at least one item"):
        model.encode_last(*_jagged(_random_seqs([3, 0])))
