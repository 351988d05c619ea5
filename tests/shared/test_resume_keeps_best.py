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

from recforge.callbacks.fresh_monitor import EarlyStopping, ModelCheckpoint


class Scripted(L.LightningModule):
    """One parameter, ``batches`` batches per epoch (batch k pulls it towards k + 1, so the weight
    depends on which batches trained in which order); ``val/score`` at epoch e is ``scores[e]``,
    not logged where that is None (a partial validation pass, as ``RecTask`` records it)."""

    def __init__(self, scores: list[float | None], batches: int = 1):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.scores = scores
        self.batches = batches
        self.last_validation_logged: set[str] = set()

    def training_step(self, batch, batch_idx):
        return (self.w - batch[0]).pow(2).sum()

    def validation_step(self, batch, batch_idx):
        score = self.scores[self.current_epoch]
        self.last_validation_logged = set() if score is None else {"val/score"}
        if score is not None:
            self.log("val/score", score)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        # one loader (a list of tensors would be read as a list of loaders)
        return torch.utils.data.DataLoader(torch.arange(1.0, self.batches + 1).view(-1, 1), batch_size=None)

    def val_dataloader(self):
        return [torch.ones(1)]


def _fit(scores: list[float | None], epochs: int, dirpath: Path, mode: str = "max", ckpt_path: Path | None = None,
         batches: int = 1, max_steps: int = -1, patience: int | None = None) -> ModelCheckpoint:
    callback = ModelCheckpoint(dirpath=dirpath, filename="epoch_{epoch:03d}", monitor="val/score",
                               mode=mode, save_last=True, save_top_k=1, auto_insert_metric_name=False)
    stops = [] if patience is None else [EarlyStopping(monitor="val/score", mode=mode, patience=patience)]
    trainer = L.Trainer(max_epochs=epochs, max_steps=max_steps, callbacks=[callback, *stops], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        accelerator="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "The dirpath has changed ..." among them
        warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers|GPU available|TPU available|"
                                "HPU available|LitLogger|log_every_n_steps|train_dataloader|val_dataloader|"
                                "smaller than the logging interval|Checkpoint directory .* exists).*")
        trainer.fit(Scripted(scores, batches), ckpt_path=ckpt_path)
    return callback


def _saved(path: Path) -> dict:
    return torch.load(path, weights_only=False, map_location="cpu")


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


def test_last_is_the_final_epoch_when_the_later_epochs_do_not_improve(tmp_path: Path):
    # Lightning 2.6 alone writes last.ckpt only beside a new best: here it stayed at epoch 0
    callback = _fit([0.9, 0.5, 0.4], 3, tmp_path / "a")
    last = _saved(tmp_path / "a" / "last.ckpt")
    assert (last["epoch"], last["global_step"]) == (2, 3)
    assert Path(callback.best_model_path).name == "epoch_000.ckpt"


def test_a_step_limit_inside_an_epoch_leaves_its_last_step_in_last(tmp_path: Path):
    # three batches an epoch; the limit of 4 stops after the first batch of epoch 1 (that the
    # resumed run then trains the rest of the epoch is tests/dlrm/test_dlrm_train.py's)
    _fit([0.5, 0.6, 0.7], 3, tmp_path / "a", batches=3, max_steps=4)
    last = _saved(tmp_path / "a" / "last.ckpt")
    assert (last["epoch"], last["global_step"]) == (1, 4)
    assert last["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["processed"] == 1


def test_a_resume_onto_a_pass_without_the_monitor_keeps_the_last_and_the_best(tmp_path: Path):
    # epoch 1's validation logs no val/score (a partial pass): the resumed run used to stop on
    # Lightning's "could not find the monitored key"
    scores = [0.5, None, 0.7]
    _fit(scores, 1, tmp_path / "a")
    resumed = _fit(scores, 3, tmp_path / "b", ckpt_path=tmp_path / "a" / "last.ckpt")
    assert resumed.best_model_score == pytest.approx(0.7)
    assert Path(resumed.best_model_path).name == "epoch_002.ckpt"
    assert _saved(tmp_path / "b" / "last.ckpt")["epoch"] == 2


def test_a_resumed_run_keeps_the_patience_it_was_given(tmp_path: Path):
    scores = [0.9, 0.5, 0.4, 0.3, 0.95]
    _fit(scores, 5, tmp_path / "a", patience=1)  # stops after epoch 1
    assert _saved(tmp_path / "a" / "last.ckpt")["epoch"] == 1
    # Lightning restored patience 1 from the checkpoint and stopped again after epoch 2
    resumed = _fit(scores, 5, tmp_path / "b", patience=5, ckpt_path=tmp_path / "a" / "last.ckpt")
    assert _saved(tmp_path / "b" / "last.ckpt")["epoch"] == 4
    assert resumed.best_model_score == pytest.approx(0.95)


class ScriptedSteps(Scripted):
    """:class:`Scripted` stepping its optimizer itself, as every recforge task does."""

    def __init__(self, scores: list[float | None], batches: int = 1):
        super().__init__(scores, batches)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss


@pytest.mark.parametrize("val_check_interval", [1.0, 2])
def test_step_checkpoints_are_ranked_only_where_a_validation_scored_them(tmp_path: Path, val_check_interval):
    """every_n_train_steps=3 over epochs of 4 updates: Lightning ranked the checkpoint of step 9 by
    epoch 1's figure (0.9), taken at step 8, so the 'best' was weights no validation had seen.
    Ranked here: the steps a validation scored (each epoch's end, or every 2 updates); the step
    checkpoints are last.ckpt, the latest state."""
    scores = [0.3, 0.9, 0.5]
    callback = ModelCheckpoint(dirpath=tmp_path, filename="step_{step}", monitor="val/score", mode="max",
                               save_last=True, save_top_k=1, every_n_train_steps=3)
    trainer = L.Trainer(max_epochs=3, callbacks=[callback], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu",
                        val_check_interval=val_check_interval)
    module = ScriptedSteps(scores, batches=4)
    trainer.fit(module)
    assert callback.best_model_score == pytest.approx(0.9)
    best = _saved(Path(callback.best_model_path))
    validated = {4, 8, 12} if val_check_interval == 1.0 else {2, 4, 6, 8, 10, 12}
    assert best["global_step"] in validated and 5 <= best["global_step"] <= 8  # epoch 1's
    assert _saved(tmp_path / "last.ckpt")["global_step"] == 12
