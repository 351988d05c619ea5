"""Typed batches: what the data layer yields and the training tasks consume.

Each model family consumes one batch type; a task never sees file formats and a model never sees
Lightning. Lightning moves dataclass batches to the device field by field.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

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


@dataclass
class CTRBatch:
    """Criteo-shaped rows for click-through-rate prediction (DLRM).

    ``dense[b]`` are row b's numerical features after the data's transform (log(1 + x) of the
    value clipped at 0, missing = 0); ``sparse[b, f]`` the index of its categorical feature f in
    that feature's table (``[0, cardinalities[f])``, missing and rare values have their own
    indices, as the data's metadata says); ``labels[b]`` 1.0 for a click, 0.0 otherwise.

    Shapes: dense ``[B, n_dense]`` float32; sparse ``[B, n_sparse]`` int64; labels ``[B]`` float32.
    """

    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> CTRBatch:
        """The batch on ``device`` (itself when already there)."""
        if self.labels.device == torch.device(device):
            return self
        return CTRBatch(*(getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)))
