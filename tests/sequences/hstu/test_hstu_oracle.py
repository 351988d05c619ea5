"""HSTU against the reference research code's own outputs (shared/data/reference/README.md,
hstu_ml1m_prefix_batch.npz): its state dict loaded into recforge's HSTU must reproduce its encoder
outputs on 16 evaluation rows of the ml-1m prefix at every valid position. This pins down the
position-bias indexing (w[N − 1 + j − i]), the time bias (bucket of the *next* event's time minus
the key's, the target's time at the last position), SiLU(·)/N with N = 211, and the layer order."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from recforge.kernels.hstu_attention import TRITON as ATTENTION_TRITON
from recforge.kernels.hstu_output import TRITON as OUTPUT_TRITON
from recforge.models.hstu import HSTU

# float32 round-off through two layers: every kernel combination lands below 1e-7
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def reference(shared_data_dir):
    path = shared_data_dir / "reference" / "hstu_ml1m_prefix_batch.npz"
    if not path.is_file():
        pytest.skip(f"reference batch not found at {path}")
    with np.load(path) as data:
        return {name: data[name] for name in data.files}


def _loaded_model(ref: dict, **kernels: dict) -> HSTU:
    """recforge's HSTU holding the reference's weights.

    The reference's item ids are raw movie ids indexing a 3,953-row table (row 0 = padding, never
    read by a valid position): building the table with those rows keeps the ids as they are.
    """
    layers = sorted({k.split(".")[2] for k in ref if k.startswith("param/_hstu._attention_layers.")})
    table = ref["param/_embedding_module._item_emb.weight"]
    model = HSTU(n_items=table.shape[0], embedding_dim=table.shape[1], num_blocks=len(layers),
                 num_heads=1, dqk=50, dv=50, max_sequence_length=200, extra_positions=11,
                 **kernels).eval()
    state = {"item_emb.weight": table,
             "pos_emb.weight": ref["param/_input_features_preproc._pos_emb.weight"]}
    for i in layers:
        prefix = f"param/_hstu._attention_layers.{i}."
        state |= {
            f"layers.{i}.uvqk": ref[prefix + "_uvqk"],
            f"layers.{i}.pos_weights": ref[prefix + "_rel_attn_bias._pos_w"],
            f"layers.{i}.time_weights": ref[prefix + "_rel_attn_bias._ts_w"],
            f"layers.{i}.o.weight": ref[prefix + "_o.weight"],
            f"layers.{i}.o.bias": ref[prefix + "_o.bias"],
        }
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()})
    return model


def _jagged_batch(ref: dict) -> tuple[torch.Tensor, ...]:
    """The padded reference batch as jagged tensors: items, offsets, timestamps, query times.

    Row b's history is ``past_ids[b, :L]``; the query time of position p is the timestamp at
    column p + 1, which at p = L − 1 is the target's (written there by the reference's features).
    """
    lengths = ref["past_lengths"]
    rows = range(len(lengths))
    items = np.concatenate([ref["past_ids"][b, :lengths[b]] for b in rows])
    times = np.concatenate([ref["timestamps"][b, :lengths[b]] for b in rows])
    query = np.concatenate([ref["timestamps"][b, 1:lengths[b] + 1] for b in rows])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return tuple(torch.from_numpy(a.astype(np.int64)) for a in (items, offsets, times, query))


def _expected(ref: dict) -> torch.Tensor:
    lengths = ref["past_lengths"]
    return torch.from_numpy(np.concatenate([ref["outputs"][b, :lengths[b]] for b in range(len(lengths))]))


def _skip_unless_triton_runs(twin, name: str) -> None:
    reason = twin.unusable_reason(torch.zeros(1))
    if reason is not None:
        pytest.skip(f"{name} Triton twin cannot run here: {reason}")


@pytest.mark.parametrize("attention_kernel,output_kernel", [
    ("pytorch", "pytorch"), ("triton", "pytorch"), ("pytorch", "triton"), ("triton", "triton"),
])
def test_reproduces_the_reference_outputs(reference, attention_kernel, output_kernel):
    if attention_kernel == "triton":
        _skip_unless_triton_runs(ATTENTION_TRITON, "hstu_attention")
    if output_kernel == "triton":
        _skip_unless_triton_runs(OUTPUT_TRITON, "hstu_output")
    model = _loaded_model(reference, attention={"kernel": attention_kernel}, output={"kernel": output_kernel})
    items, offsets, times, query = _jagged_batch(reference)
    assert int(items.min()) > 0  # no padding id inside a history
    with torch.no_grad():
        out = model(items, offsets, times, query)
    expected = _expected(reference)
    error = (out - expected).abs().max().item()
    assert error < TOLERANCE, f"max |recforge − reference| = {error:.3g}"
    # the outputs beyond each row's length are the reference's padding
    lengths = reference["past_lengths"]
    assert all(not reference["outputs"][b, lengths[b]:].any() for b in range(len(lengths)))


def test_the_reference_batch_is_what_the_readme_says(reference):
    """The facts the mapping above relies on: a 211-wide batch of ≤ 200-item histories with the
    target's time at column L (non-decreasing times up to it)."""
    lengths = reference["past_lengths"]
    assert reference["past_ids"].shape[1] == 211 and lengths.max() <= 200
    for b, n in enumerate(lengths):
        row = reference["timestamps"][b, :n + 1]
        assert (np.diff(row) >= 0).all() and row[n] > 0


def test_the_time_bias_matters_on_the_reference_batch(reference):
    """Shifting every query time one step (the item's own time instead of the next event's)
    changes the outputs: the oracle above really tests the time indexing."""
    model = _loaded_model(reference)
    items, offsets, times, query = _jagged_batch(reference)
    with torch.no_grad():
        wrong = model(items, offsets, times, times)
    assert (wrong - _expected(reference)).abs().max().item() > 100 * TOLERANCE
