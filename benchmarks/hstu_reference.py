"""Training sequences/s and evaluation users/s of the *reference* HSTU and SASRec (Meta's
generative-recommenders research code) on this machine, so that recforge's figures
(`train_throughput.py --experiment hstu_ml-1m` / `hstu_large_ml-1m` / `sasrec_ml-1m`, the same
name as ``--config``) can be quoted as ratios taken on the same box, with the same threads, under
the same load.

Nothing here is copied from the reference: the script imports it from ``--reference-dir`` (an
exported tree of facebookresearch/generative-recommenders, see ``--help``) and drives it as the
reference's ``train_fn`` does, in one process on the CPU:

* data: the ml-1m ratings (by default the shared prefix ``../shared/data/ml-1m``, 2,999 users),
  turned into per-user chronological sequences as the reference's ml-1m preprocessing does (every
  rating counts, no id remapping, rows sorted by timestamp and grouped by user), written to a
  temporary CSV in its ``sasrec_format.csv`` layout and read back through the reference's own
  ``DatasetV2`` (padding length 201: the most recent 200 items of history; training drops each
  user's last item, evaluation targets it). The catalogue is every movie of ``movies.dat``
  (3,883), the item table has max id + 1 rows (3,953).
* model: the reference's classes built with the arguments ``train_fn`` and ``hstu_encoder`` /
  ``sasrec_encoder`` give them for the ml-1m gin configs (``configs/ml-1m/``; recforge's
  ``conf/experiment/<config>.yaml`` carry the same values): item dim 50, input dropout 0.2,
  learnable positions over 200 + 11, then for HSTU 2 blocks x 1 head dqk = dv = 50 (large: 8 x 2,
  25), linear dropout 0.2, rel_bias / uvqk / SiLU; for SASRec (``sasrec_ml-1m``,
  ``sasrec-sampled-softmax-n128-final.gin``) 2 blocks x 1 head of ``torch.nn.MultiheadAttention``,
  FFN hidden 50 with ReLU, FFN and attention dropout 0.2. Both: L2-normalised outputs,
  dot-product similarity, 128 local (uniform catalogue) negatives, temperature 0.05, L2-normalised
  item embeddings, AdamW(1e-3, betas (0.9, 0.98), weight decay 0), batch 128. The parameter count
  is printed beside shared/specs/hstu.md's (§1.6: 234,400 / 313,000 / 238,800), not asserted.
* training step (timed): ``movielens_seq_features_from_row``, the target scattered into the
  ids, ``zero_grad``, item embeddings, the encoder (HSTU's and SASRec's ``forward`` take the same
  arguments), the sampled-softmax loss with the local negatives sampler, ``backward``,
  ``AdamW.step``: the body of ``train_fn``'s loop.
* evaluation (timed): ``get_eval_state`` (normalised embeddings of the whole catalogue,
  ``MIPSBruteForceTopK``) once per pass, then per batch of ``--eval-batch-size`` users
  ``movielens_seq_features_from_row`` + ``eval_metrics_v2_from_tensors`` (encode, brute-force
  MIPS over the catalogue, top-2500 with the history filtered, rank of the target, metrics).

Differences from ``train_fn`` (what a single CPU process needs, or what is not model work): no
``gin`` (the same arguments are passed directly), no DDP/NCCL (the model is called directly, as
``model.module`` is there), no TensorBoard writer, no in-loop one-batch evaluation every 100
steps, no checkpoints; ``torch.autograd.set_detect_anomaly`` is off unless ``--detect-anomaly``
(``train_fn`` leaves it on, which slows training); batches are built before the clock starts
(the reference prefetches them with 8 DataLoader workers); evaluation batches default to 512 users
(recforge's ``data.eval_batch_size``; ``train_fn``'s own default is 128).

The research code needs three fbgemm_gpu operators, which cannot be installed here. Before the
reference is imported, plain-PyTorch versions are registered under ``torch.ops.fbgemm`` (unless a
real fbgemm_gpu already provides them): ``asynchronous_complete_cumsum``,
``jagged_to_padded_dense`` and ``dense_to_jagged`` (see ``register_fbgemm_jagged_ops``). They are
``CompositeImplicitAutograd``, i.e. made of differentiable torch ops, so autograd goes through
them; a small self-check against per-row loops runs at start.

Windows alternate training and evaluation, so load from other jobs hits both alike. Read the min as
"how bad it got", the median as the figure to quote, with the load average. The script prints
figures; it asserts nothing about them.

    python benchmarks/hstu_reference.py --reference-dir /work/ref/generative-recommenders \\
        --config hstu_ml-1m --threads 2 --windows 5 --steps 5
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
REFERENCE_URL = "https://github.com/facebookresearch/generative-recommenders"
REFERENCE_COMMIT = "2e81fab"  # the commit shared/specs/hstu.md describes (2025-06-25)

# The ml-1m gin configs (configs/ml-1m/hstu-sampled-softmax-n128{,-large}-final.gin and
# sasrec-sampled-softmax-n128-final.gin) = recforge's conf/experiment/<config>.yaml
# (shared/specs/hstu.md §1.6): main_module picks the encoder as train_fn's get_sequential_encoder
# does, the rest is what the gin file gives hstu_encoder / sasrec_encoder.
CONFIGS = {
    "hstu_ml-1m": dict(main_module="HSTU", num_blocks=2, num_heads=1, dqk=50, dv=50, linear_dropout_rate=0.2),
    "hstu_large_ml-1m": dict(main_module="HSTU", num_blocks=8, num_heads=2, dqk=25, dv=25, linear_dropout_rate=0.2),
    # sasrec_encoder's defaults are ffn_hidden_dim 64, ReLU, 0.2: the gin file sets 50, relu, 0.2
    "sasrec_ml-1m": dict(main_module="SASRec", num_blocks=2, num_heads=1, ffn_hidden_dim=50,
                         ffn_activation_fn="relu", ffn_dropout_rate=0.2),
}
# shared/specs/hstu.md §1.6's parameter counts for the full ml-1m item table (3,953 rows), printed
# beside the model's own so a wrong constructor argument shows (other --ratings / --movies change
# the item table's rows, and so the model's count)
SPEC_PARAMETERS = {"hstu_ml-1m": 234_400, "hstu_large_ml-1m": 313_000, "sasrec_ml-1m": 238_800}
COMMON = dict(
    item_embedding_dim=50, max_sequence_length=200, gr_output_length=10, dropout_rate=0.2,
    num_negatives=128, temperature=0.05, l2_norm_eps=1e-6,
    learning_rate=1e-3, betas=(0.9, 0.98), weight_decay=0.0,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reference-dir", type=Path, default=Path("/work/ref/generative-recommenders"),
                   help="an exported tree of facebookresearch/generative-recommenders (default: %(default)s)")
    p.add_argument("--reference-commit", default=None,
                   help="the commit the tree was exported from, to print with the figures (default: read "
                        "from the tree when it is a git checkout or holds a COMMIT file, else 'unknown')")
    p.add_argument("--config", choices=sorted(CONFIGS), default="hstu_ml-1m",
                   help="the reference's ml-1m gin config to mirror, named as recforge's experiment "
                        "(default %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch threads and OMP/MKL_NUM_THREADS (default 2)")
    p.add_argument("--omp-wait-policy", choices=["ACTIVE", "PASSIVE"], default=None,
                   help="OMP_WAIT_POLICY (default: unset, as train_throughput.py)")
    p.add_argument("--windows", type=int, default=5, help="timed windows of each kind (default 5)")
    p.add_argument("--steps", type=int, default=5, help="training steps per training window (default 5)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed training steps and evaluation batches before the first window (default 2)")
    p.add_argument("--eval-users", type=int, default=None,
                   help="users ranked per evaluation window (default: every user, 2,999 on the shared prefix)")
    p.add_argument("--eval-batch-size", type=int, default=512,
                   help="users per evaluation batch (default 512, recforge's; train_fn's default is 128)")
    p.add_argument("--batch-size", type=int, default=128, help="sequences per training step (default 128)")
    p.add_argument("--detect-anomaly", action="store_true",
                   help="torch.autograd.set_detect_anomaly(True) while training, as train_fn leaves it")
    p.add_argument("--ratings", type=Path, default=None,
                   help="ml-1m ratings (UserID::MovieID::Rating::Timestamp, .gz or plain; default: "
                        "$RECFORGE_SHARED_DATA or ../shared/data, ml-1m/ratings.partial.dat.gz)")
    p.add_argument("--movies", type=Path, default=None,
                   help="ml-1m movies.dat, the catalogue (default: next to the ratings)")
    p.add_argument("--seed", type=int, default=0, help="torch seed and batch order (default 0)")
    p.add_argument("--malloc", choices=("keep", "default"), default="keep",
                   help="glibc allocator settings: keep (what recforge's runs set by default, extras.malloc=keep) "
                        "or glibc's defaults; give train_throughput.py the same (--override extras.malloc=...)")
    args = p.parse_args(argv)
    for name in ("windows", "steps", "threads", "batch_size", "eval_batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0 or (args.eval_users is not None and args.eval_users < 1):
        p.error("--warmup must be >= 0 and --eval-users >= 1")
    return args


def missing_reference_line(ref: Path) -> str:
    return (f"hstu_reference: no reference tree at {ref} (want {ref}/generative_recommenders/research/...); "
            f"get it with: git clone --bare {REFERENCE_URL} /tmp/gr.git (or fetch "
            f"github:facebookresearch/generative-recommenders, a bare mirror) && mkdir -p {ref} && "
            f"git --git-dir=/tmp/gr.git archive {REFERENCE_COMMIT} | tar -x -C {ref} && "
            f"git --git-dir=/tmp/gr.git rev-parse {REFERENCE_COMMIT} > {ref}/COMMIT; then pass --reference-dir {ref}")


def encoder_file(config: str) -> str:
    """The module file (under the layout's modeling/sequential/) of the config's encoder."""
    return {"HSTU": "hstu.py", "SASRec": "sasrec.py"}[CONFIGS[config]["main_module"]]


def reference_layout(ref: Path) -> str | None:
    """The module prefix of the research code: ``generative_recommenders.research`` (2024-09 on) or
    ``generative_recommenders`` (the older layout, modeling/ at the top); None if neither is there."""
    if (ref / "generative_recommenders/research/modeling/sequential/hstu.py").is_file():
        return "generative_recommenders.research"
    if (ref / "generative_recommenders/modeling/sequential/hstu.py").is_file():
        return "generative_recommenders"
    return None


def reference_commit(ref: Path, given: str | None) -> str:
    if given:
        return given
    try:
        out = subprocess.run(["git", "-C", str(ref), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and Path(subprocess.run(["git", "-C", str(ref), "rev-parse", "--show-toplevel"],
                                                       capture_output=True, text=True, timeout=10).stdout.strip()) == ref.resolve():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    for name in ("COMMIT", ".commit", "REVISION"):
        f = ref / name
        if f.is_file():
            return f.read_text().strip().split()[0]
    return "unknown (pass --reference-commit)"


def reference_fingerprint(ref: Path, prefix: str) -> str:
    """sha256 (12 hex digits) over the research code's .py files: ties the figures to the exact code."""
    root = ref / Path(*prefix.split("."))
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(ref)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


# ---------------------------------------------------------------------------------------------
# fbgemm's jagged operators in plain PyTorch (the three the research code path calls)
# ---------------------------------------------------------------------------------------------
_FBGEMM_LIB = None  # the torch.library.Library must stay alive for its registrations to stay


def register_fbgemm_jagged_ops() -> list[str]:
    """Define ``torch.ops.fbgemm.{asynchronous_complete_cumsum, jagged_to_padded_dense,
    dense_to_jagged}`` (fbgemm_gpu's schemas, one jagged dimension) with plain-PyTorch kernels,
    unless an installed fbgemm_gpu already has them. Returns the names registered here.

    Jagged layout: ``values`` [sum_b L_b, D...] holds the rows of sequence b at
    ``offsets[b]:offsets[b+1]``; ``offsets`` [B+1] is the exclusive-then-total cumsum of lengths.
    """
    global _FBGEMM_LIB
    import torch

    def have(name: str) -> bool:
        try:
            getattr(torch.ops.fbgemm, name)
            return True
        except (AttributeError, RuntimeError):
            return False

    try:  # a real fbgemm_gpu (GPU machines) registers the genuine operators on import
        import fbgemm_gpu  # noqa: F401
    except Exception:
        pass

    def complete_cumsum(t_in):
        # [x0, x1, ..., x_{n-1}] -> [0, x0, x0+x1, ..., sum]: n+1 entries, the input's dtype
        return torch.cat([t_in.new_zeros(1), torch.cumsum(t_in, dim=0).to(t_in.dtype)])

    def row_mask(offsets, width):
        # [B, width] bool: position p of row b is inside sequence b (p < L_b)
        lengths = offsets[1:] - offsets[:-1]
        return torch.arange(width, device=offsets.device).unsqueeze(0) < lengths.unsqueeze(1)

    def jagged_to_padded_dense(values, offsets, max_lengths, padding_value=0.0):
        # [sum L_b, D...] -> [B, max_len, D...]: row b gets its first min(L_b, max_len) values,
        # the rest is padding_value (fbgemm truncates sequences longer than max_len)
        assert len(offsets) == 1 and len(max_lengths) == 1, "one jagged dimension only"
        off, width = offsets[0], int(max_lengths[0])
        mask = row_mask(off, width)
        starts = off[:-1].unsqueeze(1) + torch.arange(width, device=off.device).unsqueeze(0)
        out = values.new_full((off.numel() - 1, width) + tuple(values.shape[1:]), padding_value)
        out[mask] = values[starts[mask]]  # index_put on a fresh tensor: differentiable in values
        return out

    def dense_to_jagged(dense, x_offsets, total_L=None):
        # [B, N, D...] -> ([sum L_b, D...], offsets): the first L_b rows of each dense row, in order
        # (rows longer than N are zero-padded, as fbgemm does)
        assert len(x_offsets) == 1, "one jagged dimension only"
        off = x_offsets[0]
        longest = int((off[1:] - off[:-1]).max()) if off.numel() > 1 else 0
        if longest > dense.size(1):
            pad = dense.new_zeros((dense.size(0), longest - dense.size(1)) + tuple(dense.shape[2:]))
            dense = torch.cat([dense, pad], dim=1)
        values = dense[row_mask(off, dense.size(1))]  # boolean mask: b-major, then position order
        return values, [off.clone()]

    ops = {
        "asynchronous_complete_cumsum": ("asynchronous_complete_cumsum(Tensor t_in) -> Tensor", complete_cumsum),
        "jagged_to_padded_dense": ("jagged_to_padded_dense(Tensor values, Tensor[] offsets, SymInt[] max_lengths, "
                                   "float padding_value=0) -> Tensor", jagged_to_padded_dense),
        "dense_to_jagged": ("dense_to_jagged(Tensor dense, Tensor[] x_offsets, SymInt? total_L=None) "
                            "-> (Tensor, Tensor[])", dense_to_jagged),
    }
    registered = []
    for name, (schema, fn) in ops.items():
        if have(name):
            continue
        if _FBGEMM_LIB is None:
            _FBGEMM_LIB = torch.library.Library("fbgemm", "FRAGMENT")
        _FBGEMM_LIB.define(schema)
        # CompositeImplicitAutograd: the kernel is itself made of differentiable ops, so autograd
        # (and inference mode) go through it with no backward of its own
        _FBGEMM_LIB.impl(name, fn, "CompositeImplicitAutograd")
        registered.append(name)
    return registered


def check_fbgemm_jagged_ops() -> None:
    """The operators against per-row loops on a small ragged batch, values and gradients."""
    import torch

    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 0, 5, 1], dtype=torch.int64)
    off = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
    assert off.tolist() == [0, 3, 3, 8, 9] and off.dtype == lengths.dtype
    values = torch.randn(9, 2, generator=g, requires_grad=True)
    dense = torch.ops.fbgemm.jagged_to_padded_dense(values=values, offsets=[off], max_lengths=[4], padding_value=-1.0)
    want = torch.full((4, 4, 2), -1.0)
    for b in range(4):
        n = min(int(lengths[b]), 4)
        want[b, :n] = values.detach()[int(off[b]): int(off[b]) + n]
    assert torch.equal(dense.detach(), want)
    w = torch.randn(4, 4, 2, generator=g)
    (dense * w).sum().backward()
    gwant = torch.zeros(9, 2)
    for b in range(4):
        n = min(int(lengths[b]), 4)
        gwant[int(off[b]): int(off[b]) + n] = w[b, :n]
    assert torch.equal(values.grad, gwant)
    x = torch.randn(4, 6, 2, generator=g, requires_grad=True)
    jag, offs = torch.ops.fbgemm.dense_to_jagged(x, [off])
    jwant = torch.cat([x.detach()[b, : int(lengths[b])] for b in range(4)])
    assert torch.equal(jag.detach(), jwant) and torch.equal(offs[0], off)
    wj = torch.randn(9, 2, generator=g)
    (jag * wj).sum().backward()
    xg = torch.zeros(4, 6, 2)
    for b in range(4):
        xg[b, : int(lengths[b])] = wj[int(off[b]): int(off[b + 1])]
    assert torch.equal(x.grad, xg)


# ---------------------------------------------------------------------------------------------
# data: ml-1m ratings -> the reference's sasrec_format.csv -> its DatasetV2
# ---------------------------------------------------------------------------------------------
def default_data_paths(args: argparse.Namespace) -> tuple[Path, Path]:
    shared = Path(os.environ.get("RECFORGE_SHARED_DATA") or (REPO_ROOT.parent / "shared" / "data"))
    ratings = args.ratings or shared / "ml-1m" / "ratings.partial.dat.gz"
    movies = args.movies or ratings.parent / "movies.dat"
    return ratings, movies


def read_ml1m(ratings_path: Path, movies_path: Path):
    """ratings as a DataFrame (user_id, movie_id, rating, unix_timestamp) and the catalogue: the
    movie ids of movies.dat in file order (the reference's all_item_ids)."""
    import pandas as pd

    opener = gzip.open if ratings_path.suffix == ".gz" else open
    with opener(ratings_path, "rt", encoding="latin-1") as f:
        text = f.read().replace("::", ",")
    ratings = pd.read_csv(io.StringIO(text), header=None, names=["user_id", "movie_id", "rating", "unix_timestamp"])
    with open(movies_path, encoding="latin-1") as f:
        movie_ids = [int(line.split("::", 1)[0]) for line in f if line.strip()]
    return ratings, movie_ids


def write_sasrec_format(ratings, out_csv: Path, seed: int) -> int:
    """What the reference's MovielensDataProcessor.preprocess_rating writes for ml-1m (its
    sasrec_format.csv), less the joined user features the model never reads: every rating, raw
    movie ids, rows sorted by timestamp (pandas' default sort, as there), grouped by user,
    comma-joined ids / ratings / timestamps, rows shuffled. Returns the number of users."""
    import pandas as pd

    groups = ratings.sort_values(by=["unix_timestamp"]).groupby("user_id")
    seq = pd.DataFrame({
        "user_id": list(groups.groups.keys()),
        "sequence_item_ids": [",".join(map(str, v)) for v in groups.movie_id.apply(list)],
        "sequence_ratings": [",".join(map(str, v)) for v in groups.rating.apply(list)],
        "sequence_timestamps": [",".join(map(str, v)) for v in groups.unix_timestamp.apply(list)],
    })
    seq.sample(frac=1, random_state=seed).reset_index().to_csv(out_csv, index=False, sep=",")
    return len(seq)


def build_batches(dataset, batch_size: int, count: int | None, full_only: bool, seed: int) -> list[dict]:
    """Batches of the reference's dataset rows in a seeded random order (its loaders shuffle),
    collated by torch's default collate as its DataLoader does. ``count``: how many (None: one pass);
    ``full_only``: drop a last partial batch."""
    import torch

    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(dataset, order), batch_size=batch_size,
                                         shuffle=False, num_workers=0, drop_last=full_only)
    batches = []
    for row in loader:
        batches.append(row)
        if count is not None and len(batches) >= count:
            break
    return batches


# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ref = args.reference_dir
    prefix = reference_layout(ref) if ref.is_dir() else None
    if prefix is None:
        print(missing_reference_line(ref), file=sys.stderr)
        return 2
    encoder_path = ref / Path(*prefix.split(".")) / "modeling" / "sequential" / encoder_file(args.config)
    if not encoder_path.is_file():  # a tree from before the encoder existed, or a trimmed one
        print(f"hstu_reference: --config {args.config} needs {encoder_path}, not in this tree; "
              f"export {REFERENCE_COMMIT} as --help says", file=sys.stderr)
        return 2
    ratings_path, movies_path = default_data_paths(args)
    for path in (ratings_path, movies_path):
        if not path.is_file():
            print(f"hstu_reference: no {path} (pass --ratings / --movies, or set RECFORGE_SHARED_DATA)", file=sys.stderr)
            return 2

    # before torch is imported: OpenMP and MKL read these when they load
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    if args.omp_wait_policy:
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy
    import importlib

    import torch
    from timing import cpu_model, load_average, summary

    torch.set_num_threads(args.threads)
    # the allocator recforge's runs have by default (extras.malloc), or glibc's defaults: compare
    # with train_throughput.py under the same setting (issue 22)
    from recforge.utils.allocator import apply_malloc_policy

    malloc = apply_malloc_policy(args.malloc)
    print(f"# {malloc}", flush=True)
    registered = register_fbgemm_jagged_ops()
    check_fbgemm_jagged_ops()

    sys.path.insert(0, str(ref.resolve()))

    def mod(name: str):
        return importlib.import_module(f"{prefix}.{name}")

    import contextlib
    main_module = CONFIGS[args.config]["main_module"]
    with contextlib.redirect_stdout(io.StringIO()):  # the reference prints its init choices
        encoder_mod = mod("modeling.sequential." + encoder_file(args.config).removesuffix(".py"))
    assert Path(encoder_mod.__file__).resolve().is_relative_to(ref.resolve()), encoder_mod.__file__
    Encoder = getattr(encoder_mod, main_module)  # HSTU or SASRec
    LocalEmbeddingModule = mod("modeling.sequential.embedding_modules").LocalEmbeddingModule
    LearnablePositionalEmbeddingInputFeaturesPreprocessor = mod(
        "modeling.sequential.input_features_preprocessors").LearnablePositionalEmbeddingInputFeaturesPreprocessor
    L2NormEmbeddingPostprocessor = mod("modeling.sequential.output_postprocessors").L2NormEmbeddingPostprocessor
    movielens_seq_features_from_row = mod("modeling.sequential.features").movielens_seq_features_from_row
    SampledSoftmaxLoss = mod("modeling.sequential.losses.sampled_softmax").SampledSoftmaxLoss
    LocalNegativesSampler = mod("modeling.sequential.autoregressive_losses").LocalNegativesSampler
    DotProductSimilarity = mod("rails.similarities.dot_product_similarity_fn").DotProductSimilarity
    get_top_k_module = mod("indexing.utils").get_top_k_module
    eval_mod = mod("data.eval")
    DatasetV2 = mod("data.dataset").DatasetV2

    commit = reference_commit(ref, args.reference_commit)
    fingerprint = reference_fingerprint(ref, prefix)
    load_start = load_average()
    hp = {**COMMON, **CONFIGS[args.config]}

    def log(message: str) -> None:
        print(message, flush=True)

    log(f"# hstu_reference {args.config}: {ref} ({prefix}, commit {commit}, code sha256 {fingerprint})")
    log(f"# torch {torch.__version__}, {torch.get_num_threads()} threads "
        f"(OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}); CPU {cpu_model()}; load average {load_start}")
    log(f"# fbgemm ops in plain PyTorch: {', '.join(registered) or 'none (fbgemm_gpu provides them)'}")

    # data --------------------------------------------------------------------------------------
    random.seed(42)  # train_fn's only seed
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    ratings, all_item_ids = read_ml1m(ratings_path, movies_path)
    max_item_id = int(max(max(all_item_ids), ratings.movie_id.max()))  # 3,952 = the reference's expected_max_item_id
    missing = set(ratings.movie_id.unique().tolist()) - set(all_item_ids)
    if missing:
        log(f"# note: {len(missing)} rated movies are not in {movies_path.name}; they are never ranked")
    with tempfile.TemporaryDirectory(prefix="hstu-reference-") as tmp:
        csv_path = Path(tmp) / "sasrec_format.csv"
        n_users = write_sasrec_format(ratings, csv_path, args.seed)
        padding_length = hp["max_sequence_length"] + 1  # get_reco_dataset: + target
        train_ds = DatasetV2(ratings_file=str(csv_path), padding_length=padding_length, ignore_last_n=1,
                             chronological=True, sample_ratio=1.0)
        eval_ds = DatasetV2(ratings_file=str(csv_path), padding_length=padding_length, ignore_last_n=0,
                            chronological=True, sample_ratio=1.0)
        n_train_batches = args.warmup + args.windows * args.steps
        train_batches = build_batches(train_ds, args.batch_size, min(n_train_batches, len(train_ds) // args.batch_size),
                                      full_only=True, seed=args.seed)
        if not train_batches:
            print(f"hstu_reference: fewer users ({len(train_ds)}) than --batch-size {args.batch_size}", file=sys.stderr)
            return 2
        eval_users = min(args.eval_users or len(eval_ds), len(eval_ds))
        eval_subset = torch.utils.data.Subset(eval_ds, torch.randperm(
            len(eval_ds), generator=torch.Generator().manual_seed(args.seed + 1))[:eval_users].tolist())
        eval_batches = build_batches(eval_subset, args.eval_batch_size, None, full_only=False, seed=args.seed + 2)
    data_s = time.perf_counter() - t0
    hist = torch.cat([b["history_lengths"] for b in eval_batches]).float()
    log(f"# data: {ratings_path} ({len(ratings):,} ratings, {n_users:,} users, {ratings.movie_id.nunique():,} rated "
        f"movies, catalogue {len(all_item_ids):,}, max id {max_item_id}); eval histories mean "
        f"{hist.mean():.1f} (max {int(hist.max())}) of the most recent {hp['max_sequence_length']}; "
        f"{len(train_batches)} training batches of {args.batch_size} and {len(eval_batches)} evaluation batches "
        f"({eval_users:,} users, {args.eval_batch_size} a batch) built in {data_s:.1f} s (not timed)")

    # model, as train_fn builds it ----------------------------------------------------------------
    device = torch.device("cpu")
    with contextlib.redirect_stdout(io.StringIO()):
        embedding_module = LocalEmbeddingModule(num_items=max_item_id, item_embedding_dim=hp["item_embedding_dim"])
        # what train_fn gives get_sequential_encoder whichever the encoder
        encoder_args = dict(
            max_sequence_len=hp["max_sequence_length"],
            max_output_len=hp["gr_output_length"] + 1,
            embedding_dim=embedding_module.item_embedding_dim,
            num_blocks=hp["num_blocks"], num_heads=hp["num_heads"],
            embedding_module=embedding_module,
            similarity_module=DotProductSimilarity(),
            input_features_preproc_module=LearnablePositionalEmbeddingInputFeaturesPreprocessor(
                max_sequence_len=hp["max_sequence_length"] + hp["gr_output_length"] + 1,
                embedding_dim=hp["item_embedding_dim"], dropout_rate=hp["dropout_rate"]),
            output_postproc_module=L2NormEmbeddingPostprocessor(embedding_dim=hp["item_embedding_dim"], eps=1e-6),
            verbose=True,
        )
        if main_module == "HSTU":  # hstu_encoder's arguments
            model = Encoder(
                **encoder_args, linear_dim=hp["dv"], attention_dim=hp["dqk"],
                normalization="rel_bias", linear_config="uvqk", linear_activation="silu",
                linear_dropout_rate=hp["linear_dropout_rate"], attn_dropout_rate=0.0,
                enable_relative_attention_bias=True, concat_ua=False,
            )
        else:  # sasrec_encoder's arguments (activation_checkpoint: get_sequential_encoder's default)
            model = Encoder(
                **encoder_args, ffn_hidden_dim=hp["ffn_hidden_dim"], ffn_activation_fn=hp["ffn_activation_fn"],
                ffn_dropout_rate=hp["ffn_dropout_rate"], activation_checkpoint=False,
            )
    ar_loss = SampledSoftmaxLoss(num_to_sample=hp["num_negatives"], softmax_temperature=hp["temperature"],
                                 model=model, activation_checkpoint=False)
    negatives_sampler = LocalNegativesSampler(num_items=max_item_id, item_emb=model._embedding_module._item_emb,
                                              all_item_ids=all_item_ids, l2_norm=True, l2_norm_eps=hp["l2_norm_eps"])
    model, ar_loss, negatives_sampler = model.to(device), ar_loss.to(device), negatives_sampler.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=hp["learning_rate"], betas=hp["betas"],
                            weight_decay=hp["weight_decay"])
    n_params = sum(p.numel() for p in model.parameters())
    log(f"# model: {model.debug_str()}, {n_params:,} parameters (spec {SPEC_PARAMETERS[args.config]:,} for a "
        f"3,953-row item table; this one has {max_item_id + 1:,}); {hp['num_negatives']} local negatives, "
        f"t={hp['temperature']}; AdamW lr {hp['learning_rate']} betas {hp['betas']} wd {hp['weight_decay']}"
        f"{'; anomaly detection on' if args.detect_anomaly else ''}")
    max_output_length = hp["gr_output_length"] + 1
    losses: list[float] = []

    def train_step(row: dict) -> int:
        # the body of train_fn's loop (less its writer, eval-every-100 and warm-up LR branches)
        seq_features, target_ids, target_ratings = movielens_seq_features_from_row(
            row, device=device, max_output_length=max_output_length)
        seq_features.past_ids.scatter_(dim=1, index=seq_features.past_lengths.view(-1, 1), src=target_ids.view(-1, 1))
        opt.zero_grad()
        input_embeddings = model.get_item_embeddings(seq_features.past_ids)
        seq_embeddings = model(past_lengths=seq_features.past_lengths, past_ids=seq_features.past_ids,
                               past_embeddings=input_embeddings, past_payloads=seq_features.past_payloads)
        supervision_ids = seq_features.past_ids
        negatives_sampler._item_emb = model._embedding_module._item_emb
        ar_mask = supervision_ids[:, 1:] != 0
        loss, aux_losses = ar_loss(
            lengths=seq_features.past_lengths, output_embeddings=seq_embeddings[:, :-1, :],
            supervision_ids=supervision_ids[:, 1:], supervision_embeddings=input_embeddings[:, 1:, :],
            supervision_weights=ar_mask.float(), negatives_sampler=negatives_sampler, **seq_features.past_payloads)
        assert not aux_losses  # get_weighted_loss adds nothing for the dot product
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        return int(seq_features.past_lengths.numel())

    def make_eval_state():
        return eval_mod.get_eval_state(
            model=model, all_item_ids=all_item_ids, negatives_sampler=negatives_sampler,
            top_k_module_fn=lambda item_embeddings, item_ids: get_top_k_module(
                top_k_method="MIPSBruteForceTopK", model=model, item_embeddings=item_embeddings, item_ids=item_ids),
            device=device, float_dtype=None)

    def eval_batch(eval_state, row: dict) -> dict:
        seq_features, target_ids, target_ratings = movielens_seq_features_from_row(
            row, device=device, max_output_length=max_output_length)
        return eval_mod.eval_metrics_v2_from_tensors(
            eval_state, model, seq_features, target_ids=target_ids, target_ratings=target_ratings,
            user_max_batch_size=None, dtype=None)

    def eval_pass(batches: list[dict]) -> tuple[int, dict]:
        # train_fn's per-epoch evaluation: eval state once, every batch, metrics concatenated
        model.eval()
        state = make_eval_state()
        parts: dict[str, list] = {}
        users = 0
        for row in batches:
            out = eval_batch(state, row)
            for key, value in out.items():
                parts.setdefault(key, []).append(value)
            users += int(row["target_ids"].numel())
        model.train()
        return users, {k: torch.cat(v, dim=-1) for k, v in parts.items()}

    # warm-up, then windows alternating training and evaluation -----------------------------------
    cursor = 0

    def next_batch() -> dict:
        nonlocal cursor
        row = train_batches[cursor % len(train_batches)]
        cursor += 1
        return row

    torch.autograd.set_detect_anomaly(args.detect_anomaly)
    model.train()
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        train_step(next_batch())
    if args.warmup:
        eval_pass(eval_batches[: min(args.warmup, len(eval_batches))])
    log(f"# warm-up: {args.warmup} training steps and {min(args.warmup, len(eval_batches)) if args.warmup else 0} "
        f"evaluation batches in {time.perf_counter() - t0:.1f} s")

    train_rates, step_ms, eval_rates, eval_ms_per_user = [], [], [], []
    metrics = {}
    for w in range(args.windows):
        sequences = 0
        start = time.perf_counter()
        for _ in range(args.steps):
            sequences += train_step(next_batch())
        seconds = time.perf_counter() - start
        train_rates.append(sequences / seconds)
        step_ms.append(1e3 * seconds / args.steps)
        start = time.perf_counter()
        users, metrics = eval_pass(eval_batches)
        seconds = time.perf_counter() - start
        eval_rates.append(users / seconds)
        eval_ms_per_user.append(1e3 * seconds / users)
        log(f"window {w + 1}/{args.windows}: train {train_rates[-1]:.1f} seq/s ({step_ms[-1]:.0f} ms a step, loss "
            f"{losses[-1]:.3f}); eval {eval_rates[-1]:.1f} users/s ({users} users in {seconds:.2f} s); load {load_average()}")
    torch.autograd.set_detect_anomaly(False)
    load_end = load_average()

    train_summary, eval_summary = summary(train_rates), summary(eval_rates)
    quality = {k: round(float(v.float().mean()), 4) for k, v in metrics.items() if k in ("hr@10", "ndcg@10", "hr@50", "mrr")}
    log(f"{'':<22}{'min':>10}{'median':>10}")
    log(f"{'train sequences/s':<22}{train_summary['min']:>10.1f}{train_summary['median']:>10.1f}")
    log(f"{'eval users/s':<22}{eval_summary['min']:>10.1f}{eval_summary['median']:>10.1f}")
    log(f"# metrics of the last evaluation (after {cursor} training steps; a sanity check, not a result): {quality}")
    log(f"# load average at end: {load_end} (other jobs on the box skew the min)")
    print(json.dumps({
        "benchmark": "hstu_reference", "config": args.config,
        "reference": {"dir": str(ref), "layout": prefix, "commit": commit, "code_sha256": fingerprint,
                      "fbgemm_ops_in_pytorch": registered},
        "threads": args.threads, "malloc": malloc, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "torch": torch.__version__, "cpu": cpu_model(),
        "load_average": {"start": load_start, "end": load_end},
        "windows": args.windows, "steps": args.steps, "warmup": args.warmup,
        "batch_size": args.batch_size, "eval_batch_size": args.eval_batch_size, "eval_users": eval_users,
        "detect_anomaly": args.detect_anomaly,
        "train_sequences_per_s": train_summary, "train_ms_per_step": summary(step_ms),
        "eval_users_per_s": eval_summary, "eval_ms_per_user": summary(eval_ms_per_user),
        "last_eval_metrics": quality, "losses": [round(x, 4) for x in losses],
        "data": {"ratings": str(ratings_path), "movies": str(movies_path), "users": n_users,
                 "catalogue": len(all_item_ids), "max_item_id": max_item_id},
        "model": {"parameters": n_params, "spec_parameters": SPEC_PARAMETERS[args.config],
                  **{k: (list(v) if isinstance(v, tuple) else v) for k, v in hp.items()}},
    }, separators=(",", ":")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
