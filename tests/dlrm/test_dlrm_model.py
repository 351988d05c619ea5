"""recforge's DLRM: the parts' shapes for each interaction, the reference's init statistics, the
tables' lookup against per-feature EmbeddingBags and their sparse gradients through an SGD step, the
DCN-v2 cross network against its per-row formula, bad arguments refused in one line, and
``compile=true`` against eager."""
from __future__ import annotations

import copy
import logging
import math
import pickle

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.nn import functional as F

from conftest import CONF_DIR
from recforge.config_values import ConfigValueError, check_config_values
from recforge.contracts import CTRModel, declares
from recforge.errors import UserInputError
from recforge.kernels.dot_interaction import TRITON as DOT_TRITON
from recforge.models.dlrm import DLRM, DCNv2Interaction, SparseArch, load_reference_state_dict

CARDS = [3 + 2 * f for f in range(26)]  # 26 small tables of different sizes


def _batch(batch: int, cards=CARDS, n_dense: int = 13, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    dense = torch.rand(batch, n_dense, generator=gen) * 3
    sparse = torch.stack([torch.randint(0, c, (batch,), generator=gen) for c in cards], dim=1)
    return dense, sparse


def _small(**kwargs) -> DLRM:
    torch.manual_seed(0)
    return DLRM(CARDS, **{"dense_arch": (32,), "over_arch": (24,), "dcn_rank": 8, **kwargs})


# ---------------------------------------------------------------- contract and shapes
def test_contract_and_the_kaggle_default_architecture() -> None:
    model = DLRM(CARDS)
    assert isinstance(model, CTRModel) and declares(model, CTRModel)
    assert model.param_dtype == torch.float32
    widths = [(m.in_features, m.out_features) for m in model.dense_arch.mlp if isinstance(m, nn.Linear)]
    assert widths == [(13, 512), (512, 256), (256, 64), (64, 16)]  # 13-512-256-64-16
    widths = [(m.in_features, m.out_features) for m in model.over_arch.mlp if isinstance(m, nn.Linear)]
    assert widths == [(367, 512), (512, 256), (256, 1)]  # 367-512-256-1
    # a ReLU after every bottom layer, the last included; none after the top MLP's last Linear
    assert [type(m) for m in model.dense_arch.mlp] == [nn.Linear, nn.ReLU] * 4
    assert isinstance(model.over_arch.mlp[-1], nn.Linear)
    assert model.sparse_parameters() == [model.sparse_arch.embedding.weight]
    assert model.sparse_arch.embedding.weight.shape == (sum(CARDS), 16)
    assert model.cardinalities == CARDS


@pytest.mark.parametrize(
    ("kwargs", "over_in"),
    [
        ({}, 16 + 351),
        ({"interaction_itself": True}, 16 + 378),
        ({"interaction": "cat"}, 27 * 16),
        ({"interaction": "dcnv2"}, 27 * 16),
        ({"interaction": "dot", "embedding_dim": 8, "dense_arch": ()}, 8 + 351),
    ],
    ids=str,
)
def test_shapes_for_each_interaction(kwargs, over_in) -> None:
    model = _small(**kwargs)
    assert model.over_arch.mlp[0].in_features == over_in
    dense, sparse = _batch(5)
    logits = model(dense, sparse)
    assert logits.shape == (5,) and logits.dtype == torch.float32
    d = model.embedding_dim
    embedded = model.sparse_arch(sparse)
    assert embedded.shape == (5, 26, d)
    assert model.interaction(model.dense_arch(dense), embedded).shape == (5, over_in)
    # rows are independent: a row's logit does not depend on the rest of the batch
    torch.testing.assert_close(model(dense[2:3], sparse[2:3]), logits[2:3])
    assert model(dense[:0], sparse[:0]).shape == (0,)


def test_cat_interaction_is_dense_then_features_in_order() -> None:
    model = _small(interaction="cat")
    dense, sparse = _batch(3)
    x = model.dense_arch(dense)
    expected = torch.cat([x] + [model.sparse_arch.table(f)[sparse[:, f]] for f in range(26)], dim=1)
    torch.testing.assert_close(model.interaction(x, model.sparse_arch(sparse)), expected, rtol=0, atol=0)


# ---------------------------------------------------------------- init
def test_init_statistics_follow_the_reference() -> None:
    torch.manual_seed(1)
    model = DLRM([20000, 3, 50000], n_dense=13, embedding_dim=64, dense_arch=(512, 256),
                 over_arch=(512, 256), interaction="dcnv2", dcn_layers=2, dcn_rank=128)
    linears = [m for arch in (model.dense_arch, model.over_arch) for m in arch.mlp
               if isinstance(m, nn.Linear)]
    for layer in linears:
        fan_out, fan_in = layer.weight.shape
        w_std, b_std = math.sqrt(2 / (fan_in + fan_out)), math.sqrt(1 / fan_out)
        n = layer.weight.numel()
        assert abs(layer.weight.mean().item()) < 5 * w_std / math.sqrt(n)
        assert abs(layer.weight.std().item() / w_std - 1) < 5 * math.sqrt(1 / (2 * n)) + 0.01
        if fan_out >= 256:  # enough biases for a spread
            assert abs(layer.bias.std().item() / b_std - 1) < 5 * math.sqrt(1 / (2 * fan_out))
    for f, rows in enumerate(model.cardinalities):
        table = model.sparse_arch.table(f)
        bound = math.sqrt(1 / rows)
        assert table.abs().max() <= bound
        if rows > 1000:  # U(±b): variance b²/3, and the extremes reach the bounds
            assert abs(table.var().item() / (bound**2 / 3) - 1) < 0.02
            assert table.max() > 0.999 * bound and table.min() < -0.999 * bound
    # the 3-row table really is U(±sqrt(1/3)), not its neighbours' narrower range
    assert model.sparse_arch.table(1).abs().max() > math.sqrt(1 / 20000) * 10
    cross = model.interaction
    width = 4 * 64
    for v, w, b in zip(cross.V, cross.W, cross.bias):
        xavier = math.sqrt(2 / (width + 128))
        assert v.shape == (128, width) and w.shape == (width, 128)
        for kernel in (v, w):
            assert abs(kernel.std().item() / xavier - 1) < 0.02
        assert torch.equal(b, torch.zeros(width))


# ---------------------------------------------------------------- tables
def test_lookup_equals_per_feature_sum_bags() -> None:
    # the reference's one-id bags: nn.EmbeddingBag(mode="sum") per feature, fed ids with offsets
    model = _small()
    dense, sparse = _batch(6, seed=3)
    embedded = model.sparse_arch(sparse)
    offsets = torch.arange(6)
    for f, rows in enumerate(CARDS):
        bag = nn.EmbeddingBag(rows, 16, mode="sum")
        bag.weight.data.copy_(model.sparse_arch.table(f))
        torch.testing.assert_close(embedded[:, f], bag(sparse[:, f], offsets), rtol=0, atol=0)


def test_sparse_gradients_and_an_sgd_step() -> None:
    model = _small()
    dense, sparse = _batch(8, seed=4)
    before = model.sparse_arch.embedding.weight.detach().clone()
    F.binary_cross_entropy_with_logits(model(dense, sparse), torch.ones(8)).backward()
    grad = model.sparse_arch.embedding.weight.grad
    assert grad.is_sparse
    rows = sparse + model.sparse_arch.offsets
    assert set(grad.coalesce().indices()[0].tolist()) == set(rows.flatten().tolist())
    dense_grad = grad.to_dense()

    # the same batch with dense table gradients gives the same numbers
    reference = _small(sparse_gradients=False)
    F.binary_cross_entropy_with_logits(reference(dense, sparse), torch.ones(8)).backward()
    assert not reference.sparse_arch.embedding.weight.grad.is_sparse
    torch.testing.assert_close(dense_grad, reference.sparse_arch.embedding.weight.grad)

    torch.optim.SGD(model.sparse_parameters(), lr=0.5).step()
    after = model.sparse_arch.embedding.weight.detach()
    torch.testing.assert_close(after, before - 0.5 * dense_grad)
    untouched = torch.ones(len(before), dtype=torch.bool)
    untouched[rows.flatten()] = False
    assert untouched.any() and torch.equal(after[untouched], before[untouched])
    assert (after[~untouched] != before[~untouched]).any(dim=1).all()


@pytest.mark.parametrize(("feature", "value"), [(3, 9), (0, -1), (25, 53)])
def test_ids_outside_their_table_are_refused(feature, value) -> None:
    # feature 3 has 9 rows: id 9 would read feature 4's first row if it were not checked
    model = _small()
    dense, sparse = _batch(4)
    sparse[2, feature] = value
    match = rf"sparse\[2, {feature}\] = {value} is outside feature {feature}'s table"
    with pytest.raises(ValueError, match=match):
        model(dense, sparse)


def test_table_views_and_offsets() -> None:
    arch = SparseArch([4, 1, 6], 3)
    assert arch.offsets.tolist() == [0, 4, 5]
    assert [arch.table(f).shape[0] for f in range(3)] == [4, 1, 6]
    assert arch.table(2).data_ptr() == arch.embedding.weight[5].data_ptr()
    assert "offsets" not in arch.state_dict() and arch.sparse


# ---------------------------------------------------------------- DCN-v2
def test_dcnv2_matches_its_per_layer_formula() -> None:
    torch.manual_seed(5)
    cross = DCNv2Interaction(embedding_dim=4, n_sparse=3, num_layers=3, rank=5).double()
    with torch.no_grad():  # non-zero biases so b_l's place in the formula matters
        for b in cross.bias:
            b.normal_()
    dense = torch.randn(4, 4, dtype=torch.float64)
    embeddings = torch.randn(4, 3, 4, dtype=torch.float64)
    out = cross(dense, embeddings)
    for row in range(4):
        x0 = torch.cat([dense[row]] + [embeddings[row, f] for f in range(3)])
        x = x0.clone()
        for v, w, b in zip(cross.V, cross.W, cross.bias):
            low = torch.stack([(v[r] * x).sum() for r in range(v.shape[0])])  # V_l x_l
            full = torch.stack([(w[n] * low).sum() for n in range(w.shape[0])])  # W_l (V_l x_l)
            x = x0 * (full + b) + x
        torch.testing.assert_close(out[row], x, rtol=1e-12, atol=1e-12)
    leaves = (dense[:2].requires_grad_(), embeddings[:2].requires_grad_())
    assert torch.autograd.gradcheck(lambda d, e: cross(d, e), leaves)


# ---------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cardinalities": []}, "model.cardinalities must not be empty"),
        ({"cardinalities": [5, 0, 3]}, "model.cardinalities must be a list of positive integers"),
        ({"cardinalities": [5, 2.5]}, "model.cardinalities must be a list of positive integers"),
        ({"cardinalities": 7}, "model.cardinalities must be a list of positive integers"),
        ({"n_dense": 0}, "model.n_dense must be a positive integer"),
        ({"embedding_dim": -4}, "model.embedding_dim must be a positive integer"),
        ({"embedding_dim": True}, "model.embedding_dim must be a positive integer"),
        ({"dense_arch": [64, 0]}, "model.dense_arch must be a list of positive integers"),
        ({"over_arch": "512-256"}, "model.over_arch must be a list of positive integers"),
        ({"interaction": "dcn"}, "model.interaction must be one of dot, cat, dcnv2, got 'dcn'"),
        ({"dot_interaction": {"kernel": "cuda"}},
         "unknown model.dot_interaction.kernel 'cuda'; allowed values: pytorch, triton"),
        ({"dot_interaction": {"kernal": "triton"}},
         r"model.dot_interaction takes only 'kernel', got \['kernal'\]"),
        ({"interaction_kernel": "cuda"}, "unknown model.interaction_kernel 'cuda'"),
        ({"interaction": "cat", "interaction_itself": True},
         "interaction_itself=true applies to interaction=dot"),
        ({"interaction": "dcnv2", "dot_interaction": {"kernel": "triton"}},
         "model.dot_interaction.kernel=triton applies to interaction=dot"),
        ({"interaction": "dcnv2", "dcn_rank": 0}, "model.dcn_rank must be a positive integer"),
        ({"interaction": "dcnv2", "dcn_layers": 0}, "model.dcn_layers must be a positive integer"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_arguments_are_one_line_user_errors(kwargs, match) -> None:
    kwargs = {"cardinalities": CARDS, **kwargs}
    with pytest.raises(UserInputError, match=match) as caught:
        DLRM(**kwargs)
    assert "\n" not in str(caught.value)


def test_config_check_reads_the_signature() -> None:
    # what `model.interaction=...` on the command line meets before anything is built
    node = {"_target_": "recforge.models.dlrm.DLRM", "_partial_": True, "interaction": "dcnv2",
            "dot_interaction": {"kernel": "pytorch"}, "dense_arch": [512, 256, 64], "dcn_rank": 512}
    check_config_values(OmegaConf.create({"model": node}))
    for key, value, match in (("interaction", "dcn", "model.interaction=dcn: expected one of"),
                              ("dcn_rank", 0, "model.dcn_rank=0: expected an integer >= 1"),
                              ("dense_arch", [64, -1], "model.dense_arch=\\[64, -1\\]"),
                              ("dot_interaction", {"kernel": "cuda"}, "model.dot_interaction.kernel=cuda"),
                              ("interaction_kernel", "cuda", "model.interaction_kernel=cuda")):
        with pytest.raises(ConfigValueError, match=match):
            check_config_values(OmegaConf.create({"model": {**node, key: value}}))


def _composed_model(caplog, *overrides: str) -> tuple[DLRM, list[str]]:
    """The model `python src/train.py model=dlrm <overrides>` builds, and the lines it logged."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["model=dlrm", *overrides])
    check_config_values(OmegaConf.create({"model": OmegaConf.to_container(cfg.model)}))
    torch.manual_seed(0)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="recforge.models.dlrm"):
        model = instantiate(cfg.model)(cardinalities=CARDS)
    return model, [f"{r.levelname}: {r.getMessage()}" for r in caplog.records]


def test_the_old_kernel_key_still_works_for_one_release(caplog) -> None:
    new, new_lines = _composed_model(caplog, "model.dot_interaction.kernel=triton")
    old, old_lines = _composed_model(caplog, "model.interaction_kernel=triton")
    assert new.interaction.kernel == old.interaction.kernel == "triton"
    assert repr(new) == repr(old)
    assert new.state_dict().keys() == old.state_dict().keys()
    assert all(torch.equal(v, old.state_dict()[k]) for k, v in new.state_dict().items())
    assert new_lines == []
    assert old_lines == [
        ("WARNING: model.interaction_kernel is deprecated and will be removed in the next release; "
         "use model.dot_interaction.kernel=triton")
    ]
    default, default_lines = _composed_model(caplog)
    assert default.interaction.kernel == "pytorch" and default_lines == []
    with pytest.raises(UserInputError, match="model.interaction_kernel=pytorch contradicts "
                                             "model.dot_interaction.kernel=triton"):
        _composed_model(caplog, "model.dot_interaction.kernel=triton", "model.interaction_kernel=pytorch")


def test_bad_inputs_are_refused() -> None:
    model = _small()
    dense, sparse = _batch(4)
    with pytest.raises(ValueError, match=r"dense must be a float tensor \[B, n_dense\] = \[B, 13\]"):
        model(dense[:, :12], sparse)
    with pytest.raises(ValueError, match=r"an integer tensor \[B, n_sparse\] = \[4, 26\]"):
        model(dense, sparse[:, :25])
    with pytest.raises(ValueError, match="sparse must be an integer tensor"):
        model(dense, sparse.float())
    with pytest.raises(ValueError, match=r"= \[4, 26\]"):
        model(dense, sparse[:3])


def test_reference_loader_refuses_what_does_not_fit() -> None:
    model = _small(dense_arch=(64,), over_arch=(64,))
    state = {f"emb_l.{t}.weight": torch.zeros(c, 16) for t, c in enumerate(CARDS)}
    state |= {"bot_l.0.weight": torch.zeros(64, 13), "bot_l.0.bias": torch.zeros(64),
              "bot_l.2.weight": torch.zeros(16, 64), "bot_l.2.bias": torch.zeros(16),
              "top_l.0.weight": torch.zeros(64, 367), "top_l.0.bias": torch.zeros(64),
              "top_l.2.weight": torch.zeros(1, 64), "top_l.2.bias": torch.zeros(1)}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"missing \['top_l.2.bias'\], unexpected \['top_l.4.bias'\]"):
        load_reference_state_dict(model, {**{k: v for k, v in state.items() if k != "top_l.2.bias"},
                                          "top_l.4.bias": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"emb_l.3.weight: shape \(10, 16\) in the state, \(9, 16\) in"):
        load_reference_state_dict(model, {**state, "emb_l.3.weight": torch.zeros(10, 16)})
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing copied
    load_reference_state_dict(model, state)
    assert all(torch.equal(v, torch.zeros_like(v)) for v in model.state_dict().values())
    with pytest.raises(ValueError, match="no dcnv2 interaction"):
        load_reference_state_dict(_small(interaction="dcnv2"), state)


# ---------------------------------------------------------------- torch.compile
@pytest.mark.slow
@pytest.mark.isolated
@pytest.mark.parametrize(
    ("interaction", "kernel"),
    [("dot", "pytorch"), ("dcnv2", "pytorch"), pytest.param("dot", "triton", marks=pytest.mark.triton)],
)
def test_compile_equals_eager(interaction, kernel) -> None:
    import torch._dynamo

    if kernel == "triton" and DOT_TRITON.unusable_reason(torch.zeros(1, 1)) is not None:
        pytest.skip("Triton cannot run here (not importable, or CPU without TRITON_INTERPRET=1)")
    eager = _small(interaction=interaction, dot_interaction={"kernel": kernel})
    compiled = copy.deepcopy(eager)
    compiled.compile_dense = True
    dense, sparse = _batch(16, seed=6)
    labels = (torch.rand(16, generator=torch.Generator().manual_seed(6)) < 0.3).float()
    torch._dynamo.utils.counters.clear()
    results = []
    for model in (eager, compiled):
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse), labels)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.to_dense() for n, p in model.named_parameters()}))
    # the compiled path really ran through dynamo: one graph, or the MLPs' graphs around the Triton
    # op (one graph break, where the autograd function runs eagerly)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    breaks = {reason.split("\n")[0] for reason in torch._dynamo.utils.counters["graph_break"]}
    expected_breaks = {"Skip calling `torch.compiler.disable()`d function"} if kernel == "triton" else set()
    assert breaks == expected_breaks
    (loss_e, grads_e), (loss_c, grads_c) = results
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
    # a compiled model still copies and pickles (the compiled function is rebuilt on use)
    clone = pickle.loads(pickle.dumps(compiled))
    assert clone._compiled is None and clone.compile_dense
    torch.testing.assert_close(clone(dense, sparse), compiled(dense, sparse), rtol=1e-5, atol=1e-6)


def test_compile_flag_is_the_constructor_argument() -> None:
    assert _small(compile=True).compile_dense and not _small().compile_dense
    # nn.Module.compile (the method) is not shadowed by the flag
    assert callable(DLRM.compile)
