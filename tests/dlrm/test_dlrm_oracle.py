"""DLRM against the reference's own forward and backward (shared/data/reference/README.md,
dlrm_net_small.npz): facebookresearch/dlrm's ``DLRM_Net`` state dict loaded into recforge's DLRM must
reproduce its probabilities, its mean BCE and the gradient of every parameter on one batch of 32,
through the PyTorch and the Triton dot interaction. This pins down the layer layout (ReLU after the
bottom MLP's last layer, none after the top MLP's), the order of the 351 interaction terms and the
concatenation after the bottom output."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from recforge.models.dlrm import DLRM, load_reference_state_dict

# the module, not the op that recforge.kernels exports under its name
dot_op = importlib.import_module("recforge.kernels.dot_interaction")

# float32 round-off: both paths reproduce the probabilities exactly and every gradient to within
# 1.5e-8 (the largest, top_l.0.weight, reaches ~0.2); the bound leaves room for other BLAS builds
RTOL, ATOL = 1e-5, 1e-7

N_TABLES = 26


@pytest.fixture(scope="module")
def reference(shared_data_dir):
    path = shared_data_dir / "reference" / "dlrm_net_small.npz"
    if not path.is_file():
        pytest.skip(f"reference batch not found at {path}")
    with np.load(path) as data:
        return {name: data[name] for name in data.files}


def _loaded_model(ref: dict, **kwargs) -> DLRM:
    """recforge's DLRM at the reference's architecture (bottom 13-64-16, top 367-64-1, 26 tables of
    500 + 13 i rows) holding its weights."""
    cardinalities = [ref[f"param/emb_l.{t}.weight"].shape[0] for t in range(N_TABLES)]
    assert cardinalities == [500 + 13 * t for t in range(N_TABLES)]
    model = DLRM(cardinalities, n_dense=13, embedding_dim=16, dense_arch=(64,), over_arch=(64,),
                 **kwargs)
    state = {k.removeprefix("param/"): v for k, v in ref.items() if k.startswith("param/")}
    load_reference_state_dict(model, state)
    return model


def _run(ref: dict, **kwargs) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Probabilities [32], loss and the gradients under the reference's names (tables dense)."""
    model = _loaded_model(ref, **kwargs)
    logits = model(torch.from_numpy(ref["dense"]), torch.from_numpy(ref["ids"]))
    loss = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(ref["labels"][:, 0]))
    loss.backward()
    table_grad = model.sparse_arch.embedding.weight.grad.to_dense()
    starts = np.cumsum([0, *model.cardinalities])
    grads = {f"emb_l.{t}.weight": table_grad[starts[t]:starts[t + 1]] for t in range(N_TABLES)}
    for prefix, arch in (("bot_l", model.dense_arch), ("top_l", model.over_arch)):
        for k in (0, 2):
            grads[f"{prefix}.{k}.weight"] = arch.mlp[k].weight.grad
            grads[f"{prefix}.{k}.bias"] = arch.mlp[k].bias.grad
    return torch.sigmoid(logits).detach(), loss.detach(), grads


def _assert_reproduces(ref: dict, **kwargs) -> dict[str, float]:
    prob, loss, grads = _run(ref, **kwargs)
    expected = {k.removeprefix("grad/"): torch.from_numpy(v) for k, v in ref.items()
                if k.startswith("grad/")}
    assert set(grads) == set(expected)
    torch.testing.assert_close(prob, torch.from_numpy(ref["prob"][:, 0]), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(loss.double(), torch.tensor(float(ref["loss"]), dtype=torch.float64),
                               rtol=RTOL, atol=ATOL)
    errors = {"prob": (prob - torch.from_numpy(ref["prob"][:, 0])).abs().max().item()}
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, n=name: f"{n}: {m}")
        errors[name] = (grad - expected[name]).abs().max().item()
    # every gradient the reference has is non-trivial here, so a zero would not pass unnoticed
    assert all(expected[name].abs().max() > 1e-4 for name in expected)
    return errors


def test_pytorch_interaction_reproduces_the_reference(reference) -> None:
    prob, _, _ = _run(reference)
    _assert_reproduces(reference)
    # The same ops in the same order as the reference: on the machine that recorded it the
    # probabilities were bitwise equal. BLAS picks its kernels by CPU, and on another CPU the
    # reference itself (DLRM_Net at 090956e, run on this repo's CI machine) lands up to float32's
    # epsilon (1.19e-7, one ulp at 1.0) from its own recording while recforge still equals it bit
    # for bit there; so the recording is matched to within that epsilon.
    errors = (prob.numpy() - reference["prob"][:, 0]).astype(np.float64)
    assert np.abs(errors).max() <= np.finfo(np.float32).eps


@pytest.mark.triton
def test_triton_interaction_reproduces_the_reference(reference) -> None:
    if dot_op.TRITON.unusable_reason(torch.zeros(1, 1)) is not None:
        pytest.skip("Triton cannot run here (not importable, or CPU without TRITON_INTERPRET=1)")
    _assert_reproduces(reference, dot_interaction={"kernel": "triton"})


def test_the_oracle_pins_the_order_of_the_pairs(reference, monkeypatch) -> None:
    # the same 351 dots in column order (j ascending, then i: torchrec's order with the roles of
    # the row and column swapped) miss the reference's probabilities: the test above has the power
    # to tell the orders apart
    def column_major(n_features, itself=False, device="cpu"):
        rows, cols = torch.triu_indices(n_features, n_features, offset=0 if itself else 1)
        return (cols * n_features + rows).to(device)

    monkeypatch.setattr(dot_op, "pair_indices", column_major)
    prob, _, _ = _run(reference)
    assert (prob - torch.from_numpy(reference["prob"][:, 0])).abs().max() > 1e-4
