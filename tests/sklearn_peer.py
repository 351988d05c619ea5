"""scikit-learn as a peer oracle, run in a child process.

scikit-learn's wheel carries its own OpenMP runtime (a second libgomp beside torch's). Two OpenMP
runtimes in one process are a known cause of segmentation faults, and the test process trains
models with torch's thread pool for minutes afterwards, so scikit-learn is never imported there:
``sklearn_peer`` writes the arrays to a temporary file and this module, run as a script, computes
the peer's figure in a fresh interpreter.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from processes import run_child


def sklearn_peer(task: str, **arrays) -> float:
    """The figure ``task`` (one of ``TASKS``) computes from ``arrays``, by scikit-learn."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: expected one of {sorted(TASKS)}")
    with tempfile.TemporaryDirectory(prefix="sklearn_peer_") as tmp:
        path = Path(tmp) / "arrays.npz"
        np.savez(path, **{k: np.asarray(v) for k, v in arrays.items()})
        done = run_child([sys.executable, __file__, task, str(path)], capture_output=True, text=True,
                              timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"scikit-learn peer {task!r} failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["value"])


def _roc_auc(a) -> float:
    from sklearn.metrics import roc_auc_score

    return roc_auc_score(a["labels"], a["scores"])


def _log_loss(a) -> float:
    from sklearn.metrics import log_loss

    return log_loss(a["labels"], a["probabilities"])


def _one_hot_logistic_auc(a) -> float:
    """Test AUC of a logistic regression on one-hot categorical ids beside the dense columns."""
    import warnings

    from scipy.sparse import csr_matrix, hstack
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score

    offsets = np.r_[0, np.cumsum(a["cardinalities"])[:-1]]
    width = int(a["cardinalities"].sum())

    def one_hot(sparse, dense):
        n, fields = sparse.shape
        cols = (sparse + offsets).ravel()
        x = csr_matrix((np.ones(cols.size), (np.repeat(np.arange(n), fields), cols)), shape=(n, width))
        return hstack([x, csr_matrix(dense)]).tocsr()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # a few steps on purpose
        fit = LogisticRegression(C=float(a["C"]), max_iter=int(a["max_iter"])).fit(
            one_hot(a["train_sparse"], a["train_dense"]), a["train_labels"])
    return roc_auc_score(a["test_labels"], fit.predict_proba(one_hot(a["test_sparse"], a["test_dense"]))[:, 1])


TASKS = {"roc_auc": _roc_auc, "log_loss": _log_loss, "one_hot_logistic_auc": _one_hot_logistic_auc}


if __name__ == "__main__":
    task, path = sys.argv[1], sys.argv[2]
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    print(json.dumps({"value": float(TASKS[task](arrays))}))
