"""Typed batches: what the data layer yields and the training tasks consume.

Each model family consumes one batch type; a task never sees file formats and a model never sees
Lightning. Lightning moves dataclass batches to the device field by field.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch


@dataclass
class SessionStep:
    """One step of session-parallel mini-batching (GRU4Rec).

    Row ``r`` is one active session slot. Before the step the task takes the previous step's hidden
    state ``H`` (rows = previous slots), keeps ``H[keep]`` when ``keep`` is given (the batch shrank
    because the sessions ran out), then zeroes the rows where ``reset`` is true (a new session entered
    that slot). Then it feeds ``inputs`` and predicts ``targets``.

    Shapes: inputs, targets, reset: ``[B']``; keep: ``[B']`` indices into the previous rows, or None.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    reset: torch.Tensor
    keep: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.inputs.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SessionStep:
        """The batch on ``device`` (itself when already there)."""
        if self.inputs.device == torch.device(device):
            return self

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return SessionStep(move(self.inputs), move(self.targets), move(self.reset), move(self.keep))

    def carry_hidden(
        self,
        hidden: list[torch.Tensor] | None,
        widths: list[int],
        dtype: torch.dtype = torch.float32,
    ) -> list[torch.Tensor]:
        """The hidden state for this step, from the previous step's (``None``: all zeros)."""
        n = self.size
        if hidden is None:
            return [self.inputs.new_zeros((n, w), dtype=dtype) for w in widths]
        out = []
        for h in hidden:
            if self.keep is not None:
                h = h.index_select(0, self.keep)
            h = h.masked_fill(self.reset.unsqueeze(1), 0.0)
            out.append(h)
        return out


@dataclass
class SessionSteps:
    """Consecutive :class:`SessionStep` s handed to the task as one Lightning batch.

    The task still takes one optimizer step per session step; grouping only spreads the training
    loop's fixed cost per batch (hooks, fetching, progress tracking: ~15% of a GRU4Rec step on
    CPU) over several steps. ``size`` counts events, ``n_steps`` the session steps.
    """

    steps: list[SessionStep]

    @property
    def size(self) -> int:
        return sum(step.size for step in self.steps)

    @property
    def n_steps(self) -> int:
        return len(self.steps)

    def after(self, updates: int, then: SessionSteps | None = None) -> SessionSteps:
        """The steps after the first ``updates``, followed by ``then``'s (a resume inside a group
        that a step limit cut short: data.resumable)."""
        return SessionSteps(self.steps[updates:] + (then.steps if then is not None else []))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SessionSteps:
        """The steps on ``device`` (itself when already there)."""
        if not self.steps or self.steps[0].inputs.device == torch.device(device):
            return self
        return SessionSteps([step.to(device, non_blocking=non_blocking) for step in self.steps])


@dataclass
class HistoryBatch:
    """User histories as one jagged batch: flat values plus offsets, never padded to a width.

    Row ``b``'s history is ``items[offsets[b]:offsets[b + 1]]``, oldest first, at most the data
    module's ``max_seq_len`` most recent items, with ``timestamps`` aligned (Unix seconds).
    ``targets[b]`` is the item that follows the history (``target_timestamps[b]`` its time).

    Training supervises every position: position ``p`` of row ``b`` predicts the history's next
    item, and its last position predicts ``targets[b]``. Evaluation ranks ``targets[b]`` against
    the full catalogue; ``exclude_items[exclude_offsets[b]:exclude_offsets[b + 1]]`` are the items
    never ranked for row ``b`` (its history, as the evaluation's filter policy says), or None.

    Item ids are catalogue indices in ``[0, n_items)``; ``users`` are row indices of the prepared
    data (for per-user analysis), not raw ids.

    Shapes: items, timestamps ``[ΣL]`` int64; offsets ``[B+1]`` int64 (offsets[0] = 0);
    targets, target_timestamps, users ``[B]`` int64; exclude_items ``[E]`` and exclude_offsets
    ``[B+1]`` int64, or both None.
    """

    items: torch.Tensor
    timestamps: torch.Tensor
    offsets: torch.Tensor
    targets: torch.Tensor
    target_timestamps: torch.Tensor
    users: torch.Tensor
    exclude_items: torch.Tensor | None = None
    exclude_offsets: torch.Tensor | None = None

    @property
    def size(self) -> int:
        """Rows (users) in the batch."""
        return int(self.targets.shape[0])

    @property
    def lengths(self) -> torch.Tensor:
        """``[B]`` history lengths."""
        return self.offsets[1:] - self.offsets[:-1]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> HistoryBatch:
        """The batch on ``device`` (itself when already there)."""
        if self.items.device == torch.device(device):
            return self

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return HistoryBatch(*(move(getattr(self, f.name)) for f in fields(self)))

    def __reduce__(self):
        # A DataLoader worker hands its batches to the training process by pickling them, and
        # torch pickles each CPU tensor by moving its storage into a new shared-memory segment
        # (created, its descriptor sent over a socket, mapped, unlinked): for the 6-8 small
        # tensors of a batch that cost the training process 1-2 ms of CPU a batch at ml-20m's
        # size, more than building the batch in it (0.2-0.4 ms). As numpy arrays they travel as
        # bytes in the pipe (0.3-0.4 ms) and come back as tensors over the unpickled memory
        # (benchmarks/README.md, history_loader_throughput.py).
        return _history_batch, tuple(_as_array(getattr(self, f.name)) for f in fields(self))


def _as_array(value: torch.Tensor | None):
    """``value``'s memory as a numpy array where it can be (a CPU tensor outside autograd)."""
    if value is None or value.device.type != "cpu" or value.requires_grad:
        return value
    return value.numpy()


def _history_batch(*values) -> HistoryBatch:
    return HistoryBatch(*(torch.from_numpy(v) if isinstance(v, np.ndarray) else v for v in values))


@dataclass
class SparseBags:
    """Multi-hot categorical features: a bag of ids per (feature, row), jagged, feature-major
    (torchrec's ``KeyedJaggedTensor`` layout without the keys).

    Bag ``k = f * batch_size + b`` (feature f of row b) holds ``values[offsets[k]:offsets[k + 1]]``,
    ids in feature f's table; bags may be empty. One-hot rows ``sparse [B, F]`` are the case of
    bags of one (:meth:`from_one_hot`).

    Shapes: values ``[N]`` int64; offsets ``[F * B + 1]`` int64 (``offsets[0] == 0``,
    ``offsets[-1] == N``); ``batch_size`` B.
    """

    values: torch.Tensor
    offsets: torch.Tensor
    batch_size: int

    def __post_init__(self) -> None:
        bags = int(self.offsets.shape[0]) - 1
        if self.batch_size < 1 or bags % self.batch_size:
            raise ValueError(f"SparseBags: {bags} bags are not n_features x batch_size={self.batch_size}")

    @property
    def n_features(self) -> int:
        return (int(self.offsets.shape[0]) - 1) // self.batch_size

    @property
    def lengths(self) -> torch.Tensor:
        """``[F, B]`` bag sizes."""
        return (self.offsets[1:] - self.offsets[:-1]).view(self.n_features, self.batch_size)

    @classmethod
    def from_one_hot(cls, sparse: torch.Tensor) -> SparseBags:
        """Bags of one id from ``sparse [B, F]``."""
        b, f = sparse.shape
        offsets = torch.arange(b * f + 1, dtype=torch.int64, device=sparse.device)
        return cls(sparse.t().reshape(-1).to(torch.int64), offsets, b)

    def rows(self, lo: int, hi: int) -> SparseBags:
        """Rows ``[lo, hi)`` (``0 <= lo < hi``; ``hi`` is clipped to the batch), every feature's
        bags for them."""
        b = self.batch_size
        hi = min(hi, b)
        if not 0 <= lo < hi:
            raise ValueError(f"SparseBags.rows({lo}, {hi}): expected 0 <= lo < hi <= {b}")
        starts = torch.arange(self.n_features, device=self.offsets.device) * b
        begins, ends = self.offsets[starts + lo].tolist(), self.offsets[starts + hi].tolist()
        values = torch.cat([self.values[s:e] for s, e in zip(begins, ends)])
        sizes = self.lengths[:, lo:hi].reshape(-1)
        offsets = torch.zeros(sizes.numel() + 1, dtype=torch.int64, device=self.offsets.device)
        torch.cumsum(sizes, 0, out=offsets[1:])
        return SparseBags(values, offsets, hi - lo)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SparseBags:
        return SparseBags(self.values.to(device, non_blocking=non_blocking),
                          self.offsets.to(device, non_blocking=non_blocking), self.batch_size)


@dataclass
class CTRBatch:
    """Criteo-shaped rows for click-through-rate prediction (DLRM).

    ``dense[b]`` are row b's numerical features after the data's transform (log(1 + x) of the
    value clipped at 0, missing = 0); ``sparse[b, f]`` the index of its categorical feature f in
    that feature's table (``[0, cardinalities[f])``, missing and rare values have their own
    indices, as the data's metadata says), or, for multi-hot features, :class:`SparseBags` of such
    indices; ``labels[b]`` 1.0 for a click, 0.0 otherwise.

    Shapes: dense ``[B, n_dense]`` float32; sparse ``[B, n_sparse]`` int64 or bags of
    ``n_sparse`` features for B rows; labels ``[B]`` float32.
    """

    dense: torch.Tensor
    sparse: torch.Tensor | SparseBags
    labels: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])

    def rows(self, lo: int, hi: int) -> CTRBatch:
        """Rows ``[lo, hi)``."""
        sparse = self.sparse.rows(lo, hi) if isinstance(self.sparse, SparseBags) else self.sparse[lo:hi]
        return CTRBatch(self.dense[lo:hi], sparse, self.labels[lo:hi])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> CTRBatch:
        """The batch on ``device`` (itself when already there)."""
        if self.labels.device == torch.device(device):
            return self
        return CTRBatch(*(getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)))
