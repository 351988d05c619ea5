"""A table's rows sharded over 2 gloo processes against the same table unsharded (issue 19).

The oracle is ``nn.Embedding`` holding the whole table in one process: the same ids, the same loss,
the same optimizer. The sharded lookup must equal it bit for bit (each output row comes from one
rank, the others add exact zeros), and after a few optimizer steps every rank's rows must equal the
unsharded table's rows there.
"""
from __future__ import annotations

import pytest
import torch
from gloo_ranks import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from recforge.distributed.sharded_table import RowShardedEmbedding, row_range
from recforge.optim.rowwise_adagrad import RowWiseAdagrad

ROWS, DIM, STEPS = 1001, 4, 3  # 1001 rows: an uneven split (501 + 500)


def test_row_range_is_torch_chunk_s_split():
    for rows in (0, 1, 7, 1000, 1001):
        for world in (1, 2, 3, 4):
            chunks = torch.arange(rows).chunk(world) if rows else []
            want = [(int(c[0]), int(c[-1]) + 1) for c in chunks]
            got = [row_range(rows, world, r) for r in range(world)]
            assert got[: len(want)] == want, (rows, world)
            # ranks past torch.chunk's last chunk hold nothing, at the end
            assert all(start == end == rows for start, end in got[len(want):])
    with pytest.raises(ValueError):
        row_range(10, 2, 2)


def _batches(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    # repeats within a batch and rows of both shards; the same on every rank
    return [torch.randint(0, ROWS, (16, 5), generator=gen) for _ in range(steps)]


def _train(table: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    outputs = []
    for ids in _batches(STEPS):
        optimizer.zero_grad()
        out = table(ids)
        outputs.append(out.detach().clone())
        # a loss whose gradient differs per position, so misplaced rows would show
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).pow(2).sum().backward()
        optimizer.step()
    return outputs


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5)
    return RowWiseAdagrad(params, lr=0.1)


def _worker(rank: int, kind: str, sparse: bool) -> dict:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("table",))
    whole = torch.empty(ROWS, DIM).uniform_(-1, 1, generator=torch.Generator().manual_seed(3))
    table = RowShardedEmbedding(ROWS, DIM, mesh["table"], sparse=sparse)
    table.load_state_dict({"weight": whole})  # the whole table: this rank keeps its rows
    outputs = _train(table, _optimizer(kind, table.parameters()))
    state = table.state_dict()["weight"]
    return {
        "start": table.start, "end": table.end, "local": table.weight.detach().clone(),
        "outputs": outputs, "whole_after": state.full_tensor(), "placements": str(state.placements),
        "state_shape": tuple(state.shape),
    }


@pytest.mark.slow
@pytest.mark.parametrize("kind,sparse", [("sgd", True), ("rowwise_adagrad", True), ("rowwise_adagrad", False)])
def test_two_shards_train_as_the_whole_table(kind: str, sparse: bool):
    ranks = run_ranks(_worker, kind, sparse)
    whole = torch.empty(ROWS, DIM).uniform_(-1, 1, generator=torch.Generator().manual_seed(3))
    oracle = nn.Embedding(ROWS, DIM, sparse=sparse, _weight=whole.clone())
    want_outputs = _train(oracle, _optimizer(kind, oracle.parameters()))
    want = oracle.weight.detach()

    assert [(ranks[r]["start"], ranks[r]["end"]) for r in (0, 1)] == [(0, 501), (501, 1001)]
    for r in (0, 1):
        # each rank holds its half of the rows, and only those
        assert ranks[r]["local"].shape == (ranks[r]["end"] - ranks[r]["start"], DIM)
        for got, expected in zip(ranks[r]["outputs"], want_outputs):
            assert torch.equal(got, expected)  # the lookup, bit for bit, on every rank
        torch.testing.assert_close(ranks[r]["local"], want[ranks[r]["start"]:ranks[r]["end"]], rtol=1e-6, atol=1e-7)
        assert ranks[r]["placements"] == "(Shard(dim=0),)" and ranks[r]["state_shape"] == (ROWS, DIM)
        torch.testing.assert_close(ranks[r]["whole_after"], want, rtol=1e-6, atol=1e-7)
    assert ranks[0]["local"].numel() + ranks[1]["local"].numel() == want.numel()


def _reshard_worker(rank: int, world: int, saved: torch.Tensor) -> torch.Tensor:
    mesh = init_device_mesh("cpu", (world,))
    table = RowShardedEmbedding(ROWS, DIM, mesh)
    with pytest.raises(ValueError, match=r"weight: a table of shape \(1000, 4\) in the checkpoint, "
                                         r"\(1001, 4\) in the model"):
        table.load_state_dict({"weight": saved[:1000]})
    table.load_state_dict({"weight": saved})
    return table.weight.detach().clone()


@pytest.mark.slow
def test_a_whole_table_loads_into_any_number_of_shards():
    saved = torch.randn(ROWS, DIM)
    for world in (1, 2):
        shards = run_ranks(_reshard_worker, world, saved, world=world)
        assert torch.equal(torch.cat(shards), saved)


def _bag_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    batches = []
    for _ in range(steps):
        sizes = torch.randint(0, 5, (24,), generator=gen)  # empty bags too
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
        batches.append((torch.randint(0, ROWS, (int(sizes.sum()),), generator=gen), offsets))
    return batches


def _train_bags(lookup, optimizer) -> list[torch.Tensor]:
    outputs = []
    for values, offsets in _bag_batches(STEPS):
        optimizer.zero_grad()
        out = lookup(values, offsets)
        outputs.append(out.detach().clone())
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).pow(2).sum().backward()
        optimizer.step()
    return outputs


def _bag_worker(rank: int) -> dict:
    mesh = init_device_mesh("cpu", (2,))
    table = RowShardedEmbedding(ROWS, DIM, mesh)
    table.load_state_dict({"weight": torch.empty(ROWS, DIM).uniform_(-1, 1, generator=torch.Generator().manual_seed(3))})
    outputs = _train_bags(table.bags, RowWiseAdagrad(table.parameters(), lr=0.1))
    return {"rows": (table.start, table.end), "local": table.weight.detach().clone(), "outputs": outputs}


@pytest.mark.slow
def test_two_shards_sum_bags_as_the_whole_table():
    ranks = run_ranks(_bag_worker)
    weight = nn.Parameter(torch.empty(ROWS, DIM).uniform_(-1, 1, generator=torch.Generator().manual_seed(3)))

    def whole(values, offsets):
        return nn.functional.embedding_bag(values, weight, offsets, mode="sum", sparse=True, include_last_offset=True)

    want_outputs = _train_bags(whole, RowWiseAdagrad([weight], lr=0.1))
    for r in (0, 1):
        start, end = ranks[r]["rows"]
        for got, expected in zip(ranks[r]["outputs"], want_outputs, strict=True):
            # a bag with rows on both ranks is summed in another order: round-off only
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ranks[r]["local"], weight.detach()[start:end], rtol=1e-5, atol=1e-6)
