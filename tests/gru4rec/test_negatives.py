"""PopularitySampler: distribution, the reference's inverse-CDF rule, streams and resumption."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from recforge.data.negatives import PopularitySampler, negatives_generator_seed

POPULARITY = torch.tensor([1.0, 2.0, 50.0, 7.0, 1.0, 300.0, 20.0, 3.0])


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_frequencies_follow_popularity_to_the_alpha(alpha):
    sampler = PopularitySampler(POPULARITY, n_sample=1000, alpha=alpha, store_size=50_000, seed=3)
    draws = torch.cat([sampler.sample() for _ in range(400)])  # 8 store fills
    counts = np.bincount(draws.numpy(), minlength=len(POPULARITY))
    p = POPULARITY.double().numpy() ** alpha
    expected = len(draws) * p / p.sum()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 7 degrees of freedom: P(chi2 > 30) < 1e-4; a wrong exponent or an off-by-one bucket is
    # off by thousands at 400k draws
    assert chi2 < 30.0, (counts, expected.round())


def test_each_uniform_maps_to_the_first_item_whose_cdf_exceeds_it():
    # the reference's binary search; checked on the uniforms the sampler itself drew
    sampler = PopularitySampler(POPULARITY, n_sample=64, alpha=1.0, store_size=640, seed=0)
    generator = torch.Generator().manual_seed(negatives_generator_seed(0))
    u = torch.rand(640, generator=generator, dtype=torch.float64)
    cdf = np.cumsum(POPULARITY.double().numpy())
    cdf /= cdf[-1]
    naive = [next(i for i, c in enumerate(cdf) if c > x) for x in u.tolist()]
    drawn = torch.cat([sampler.sample() for _ in range(10)])
    assert drawn.tolist() == naive


def test_the_stream_is_not_the_global_generator_of_the_same_seed():
    # the run seed also initialises the weights from torch's global generator: the negatives
    # must not replay those uniforms
    seed, n = 11, 4096
    uniform_items = torch.ones(n)
    sampler = PopularitySampler(uniform_items, n_sample=n, alpha=0.0, store_size=n, seed=seed)
    torch.manual_seed(seed)
    replayed = (torch.rand(n, dtype=torch.float64) * n).long()
    agreement = (sampler.sample() == replayed).float().mean().item()
    assert agreement < 0.01  # independent streams agree on about 1/n of the draws


def test_streams_differ_and_each_is_reproducible():
    def first_rows(seed, stream):
        s = PopularitySampler(POPULARITY, 256, 0.5, 2560, seed=seed, stream=stream)
        return torch.stack([s.sample() for _ in range(3)])

    assert torch.equal(first_rows(5, 0), first_rows(5, 0))
    assert not torch.equal(first_rows(5, 0), first_rows(5, 1))
    # rank 1 of seed 5 is not rank 0 of seed 6 (which "seed + rank" would make it)
    assert not torch.equal(first_rows(5, 1), first_rows(6, 0))


def test_resumed_sampler_continues_the_same_draws_across_a_refill():
    a = PopularitySampler(POPULARITY, n_sample=32, alpha=0.5, store_size=32 * 4, seed=2)
    for _ in range(3):
        a.sample()
    state = a.state_dict()
    expected = [a.sample() for _ in range(6)]  # crosses the store refill after row 4
    b = PopularitySampler(POPULARITY, n_sample=32, alpha=0.5, store_size=32 * 4, seed=99)
    b.load_state_dict(state)
    for want in expected:
        assert torch.equal(b.sample(), want)


def test_the_store_is_moved_to_the_device_once_per_fill():
    # "meta" stands in for an accelerator: the rows come out on the store's device, not the CPU
    sampler = PopularitySampler(POPULARITY, n_sample=16, alpha=0.5, store_size=64, seed=0, device="meta")
    rows = [sampler.sample() for _ in range(5)]  # crosses a refill after 4 rows
    assert all(row.device.type == "meta" and row.shape == (16,) for row in rows)
