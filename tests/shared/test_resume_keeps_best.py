"""A resumed run keeps the best checkpoint of the run it resumes (issue 21): Lightning alone
forgets it when the checkpoint directory changes, which it does for every resumed recforge run
(each run writes into its own directory). The oracle is a module whose validation score is
scripted per epoch, so which epoch is best is known in advance."""
from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch

from recforge.callbacks.fresh_monitor import ModelCheckpoint


class Scripted(L.LightningModule):
    """One parameter, one batch per epoch; ``val/score`` at epoch e is ``scores[e]``."""

    def __init__(self, scores: list[float]):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.scores = scores

    def training_step(self, batch, batch_idx):
        return (self.w - batch[0]).pow(2).sum()

    def validation_step(self, batch, batch_idx):
        self.log("val/score", self.scores[self.current_epoch])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return [torch.ones(1)]

    def val_dataloader(self):
        return [torch.ones(1)]


def _fit(scores: list[float], epochs: int, dirpath: Path, mode: str = "max", ckpt_path: Path | None = None):
    callback = ModelCheckpoint(dirpath=dirpath, filename="epoch_{epoch:03d}", monitor="val/score",
                               mode=mode, save_last=True, save_top_k=1, auto_insert_metric_name=False)
    trainer = L.Trainer(max_epochs=epochs, callbacks=[callback], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "The dirpath has changed ..." among them
        warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers|GPU available|TPU available|"
                                "HPU available|LitLogger|log_every_n_steps|train_dataloader|val_dataloader|"
                                "smaller than the logging interval|Checkpoint directory .* exists).*")
        trainer.fit(Scripted(scores), ckpt_path=ckpt_path)
    return callback


@pytest.mark.parametrize("mode,scores,best_epoch", [
    ("max", [0.5, 0.9, 0.4, 0.6, 0.7], 1),
    ("min", [0.5, 0.1, 0.4, 0.3, 0.2], 1),
])
def test_resumed_run_keeps_the_earlier_best(tmp_path: Path, mode: str, scores: list[float], best_epoch: int):
    first = _fit(scores, 3, tmp_path / "a", mode)
    best_name = f"epoch_{best_epoch:03d}.ckpt"
    assert Path(first.best_model_path).name == best_name
    earlier = (tmp_path / "a" / best_name).read_bytes()

    resumed = _fit(scores, 5, tmp_path / "b", mode, ckpt_path=tmp_path / "a" / "last.ckpt")
    assert resumed.best_model_score == pytest.approx(scores[best_epoch])
    assert resumed.best_model_path == str(tmp_path / "b" / best_name)
    assert (tmp_path / "b" / best_name).read_bytes() == earlier  # the resumed run is whole on its own
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [best_name, "last.ckpt"]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [best_name, "last.ckpt"]  # untouched


def test_a_better_epoch_after_resume_replaces_only_the_copy(tmp_path: Path):
    scores = [0.5, 0.9, 0.4, 0.6, 0.95]
    _fit(scores, 3, tmp_path / "a")
    resumed = _fit(scores, 5, tmp_path / "b", ckpt_path=tmp_path / "a" / "last.ckpt")
    assert resumed.best_model_score == pytest.approx(0.95)
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["epoch_004.ckpt", "last.ckpt"]
    assert (tmp_path / "a" / "epoch_001.ckpt").exists()  # top-1 bookkeeping deleted the copy only


def test_a_deleted_earlier_best_is_not_invented(tmp_path: Path):
    scores = [0.5, 0.9, 0.4, 0.6, 0.7]
    _fit(scores, 3, tmp_path / "a")
    (tmp_path / "a" / "epoch_001.ckpt").unlink()
    resumed = _fit(scores, 5, tmp_path / "b", ckpt_path=tmp_path / "a" / "last.ckpt")
    assert resumed.best_model_score == pytest.approx(0.7)  # the best the resumed run has a file for
    assert Path(resumed.best_model_path).name == "epoch_004.ckpt"


def test_resuming_into_the_same_directory_is_lightnings_own(tmp_path: Path):
    scores = [0.5, 0.9, 0.4, 0.6, 0.7]
    _fit(scores, 3, tmp_path / "a")
    resumed = _fit(scores, 5, tmp_path / "a", ckpt_path=tmp_path / "a" / "last.ckpt")
    assert resumed.best_model_score == pytest.approx(0.9)
    assert resumed.best_model_path == str(tmp_path / "a" / "epoch_001.ckpt")
