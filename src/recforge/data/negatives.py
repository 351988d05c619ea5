"""Popularity-based negative sampling for sampled next-item losses (GRU4Rec, spec §1.5)."""
from __future__ import annotations

import torch

from recforge.utils.seeds import derived_seed

# Tags this module's random stream apart from every other use of the run's seed.
_NEGATIVES_STREAM = 0x6E6567


def negatives_generator_seed(seed: int, stream: int = 0) -> int:
    """The sampler's generator seed, derived from the run seed and a stream number (DDP rank).

    The run seed also seeds torch's global generator, which draws the initial weights. Seeding the
    sampler with that same number would replay those very uniforms as negatives: the first few
    hundred mini-batches' samples would be a function of the initial item vectors. Ranks must not
    share a stream either, nor collide with another run's seed (``seed + rank`` would).
    """
    return derived_seed(seed, _NEGATIVES_STREAM, stream)


class PopularitySampler:
    """Draws ``n_sample`` items per mini-batch i.i.d. with P(j) ∝ popularity_j ** alpha.

    One draw is shared by every row of a mini-batch. Draws come from a pre-drawn store of
    ``store_size // n_sample`` mini-batches, refilled when used up, so the inverse-CDF search runs
    in large vectorised blocks. ``alpha=0`` is uniform, 1 is proportional to popularity.
    ``seed`` and ``stream`` (the DDP rank) pick the generator through
    :func:`negatives_generator_seed`, independent of torch's global generator. The store lives on
    ``device``.

    The sampler's position is part of training state (``state_dict``): a resumed run draws the
    same negatives as an uninterrupted one.
    """

    def __init__(
        self,
        popularity: torch.Tensor,
        n_sample: int,
        alpha: float = 0.5,
        store_size: int = 10_000_000,
        seed: int = 0,
        stream: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        if n_sample < 1:
            raise ValueError(f"n_sample must be >= 1 to sample, got {n_sample}")
        weights = popularity.double().clamp_min(0) ** alpha
        cdf = torch.cumsum(weights, 0)
        cdf /= cdf[-1].clone()
        cdf[-1] = 1.0  # round-off must not leave the last item unreachable
        self.cdf = cdf
        self.n_sample = int(n_sample)
        self.alpha = float(alpha)
        self.rows = max(1, int(store_size) // self.n_sample)
        self.generator = torch.Generator().manual_seed(negatives_generator_seed(seed, stream))
        self.device = torch.device(device)
        self._store: torch.Tensor | None = None
        self._next = 0
        self._state_at_fill: torch.Tensor | None = None

    def _fill(self) -> None:
        self._state_at_fill = self.generator.get_state()
        u = torch.rand(self.rows * self.n_sample, generator=self.generator, dtype=torch.float64)
        store = torch.searchsorted(self.cdf, u, right=True).clamp_max_(len(self.cdf) - 1)
        # Drawn on the CPU (the same draws on every device), then moved once per fill: no
        # host-to-device copy per mini-batch.
        self._store = store.view(self.rows, self.n_sample).to(self.device)
        self._next = 0

    def sample(self) -> torch.Tensor:
        """The next mini-batch's negatives, ``[n_sample]`` item indices."""
        if self._store is None or self._next >= self.rows:
            self._fill()
        row = self._store[self._next]
        self._next += 1
        return row

    def state_dict(self) -> dict:
        return {
            "state_at_fill": self._state_at_fill,
            "next": self._next,
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("state_at_fill") is not None:
            self.generator.set_state(state["state_at_fill"])
            self._fill()
            self._next = int(state["next"])
        self.generator.set_state(state["generator"])
