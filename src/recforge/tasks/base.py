"""The training machinery every task shares; a family's task subclasses :class:`RecTask`.

What lives here, once: manual optimisation (one update per training step, every DDP rank applying
the same averaged update, a padding rank's included), averaging of sparse item-table gradients across
DDP ranks (optim/sparse_grad_sync.py), clipping that understands sparse gradients, learning-rate
schedulers stepped per epoch or per update, objects with state that must survive a resume (negative samplers),
the epoch's mean training loss, and the logging of the evaluation's metrics.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import lightning as L
import torch
from torch import nn

from recforge.contracts import Evaluation
from recforge.config_checks import CONF_DIR
from recforge.errors import UserInputError
from recforge.evaluation.user_sample import SAMPLE_PREFIX, ValidationSample
from recforge.optim.sparse_capable import check_optimizer_takes_sparse
from recforge.optim.clipping import clip_grad_norm_, clip_grad_value_
from recforge.optim.dense_sparse import DenseSparseOptimizer
from recforge.optim.sparse_grad_sync import average_sparse_grads_, sparse_parameter_names

log = logging.getLogger(__name__)


class RecTask(L.LightningModule):
    """Base of every task: subclasses build their model, define :meth:`train_loss` (which
    :meth:`training_step` optimises, calling :meth:`optimize` once per update) and their
    evaluation steps (feeding ``self.evaluation``).

    Declarations a subclass makes (read by the config check before anything is built; see
    :mod:`recforge.contracts`): ``batch_type`` (the batch it trains on), ``model_contract``
    (the Protocol its model implements, or a tuple of those it can drive), ``produces`` (the
    score layout its loss consumes), ``evaluation_kind`` (the evaluation it feeds). The data reads
    ``min_batch_rows`` (:class:`recforge.contracts.Task`).

    Args:
        optimizer: factory ``(params) -> torch.optim.Optimizer``.
        evaluation: the evaluation component (:class:`recforge.contracts.Evaluation`, e.g.
            :class:`recforge.evaluation.FullRanking`).
        scheduler: optional factory ``(optimizer) -> LR scheduler``, stepped once per epoch, or
            once per update when ``scheduler_interval="step"`` (DLRM's warm-up and decay).
        gradient_clip_val, gradient_clip_algorithm: optional clipping ("norm" or "value") of
            every gradient, sparse item-table gradients included (the task optimises manually, so
            this replaces the Trainer's own clipping options).
    """

    batch_type: ClassVar[type]
    model_contract: ClassVar[type | tuple[type, ...]]
    produces: ClassVar[str]
    evaluation_kind: ClassVar[str]
    # read by the data (recforge.contracts.Task): any batch size unless the loss says otherwise
    min_batch_rows: int = 1

    def __init__(
        self,
        optimizer: Callable[..., torch.optim.Optimizer],
        evaluation: Evaluation,
        scheduler: Callable | None = None,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: Literal["norm", "value"] = "norm",
        scheduler_interval: Literal["epoch", "step"] = "epoch",
    ) -> None:
        super().__init__()
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.evaluation = evaluation
        # Manual optimisation: a GRU4Rec step is small and Lightning's closure machinery cost a
        # quarter of it; it also lets a DDP rank out of rows pad its epoch with zero-loss steps.
        self.automatic_optimization = False
        if gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm must be 'norm' or 'value', got {gradient_clip_algorithm!r}")
        self.gradient_clip_val = gradient_clip_val
        self.gradient_clip_algorithm = gradient_clip_algorithm
        if scheduler_interval not in ("epoch", "step"):
            raise ValueError(f"scheduler_interval must be 'epoch' or 'step', got {scheduler_interval!r}")
        self.scheduler_interval = scheduler_interval
        self._sparse_synced: list[nn.Parameter] = []
        self._lazy_factories: dict[str, Callable[[], Any]] = {}
        self._lazy_objects: dict[str, Any] = {}
        self._pending_states: dict[str, dict] = {}
        # the names the last validation pass logged: checkpointing and early stopping act on a
        # pass only if it logged their monitor (recforge.callbacks.fresh_monitor). Empty before
        # the first pass: a step limit (trainer.max_steps) may end training before any, and
        # early stopping must not then ask for a monitor no pass has logged
        self.last_validation_logged: set[str] = set()
        # of the last training batch, the updates that ran when a step limit (trainer.max_steps)
        # cut a batch of several short; None when it trained whole. The training loader's resume
        # state reads it (recforge.data.base.DataModule.fit_progress)
        self.batch_cut_after: int | None = None
        self._own_rank_state = False  # set when a checkpoint is loaded (see rank_local_keys)

    @property
    def validation_sample(self) -> ValidationSample | None:
        """The evaluation's sample of validation users (None: every user, every epoch), which the
        data module's validation loader reads (:class:`recforge.contracts.Task`)."""
        return getattr(self.evaluation, "validation_sample", None)

    def _check_validation_sample(self, stage: str) -> None:
        sample = self.validation_sample
        datamodule = getattr(self.trainer, "datamodule", None)
        if sample is None or datamodule is None:
            return
        if not getattr(datamodule, "samples_validation_users", False):
            raise UserInputError(
                f"evaluation.max_users={sample.max_users}: {type(datamodule).__name__} cannot "
                "validate on a sample of users (the user-history data of SASRec and HSTU can); "
                "set evaluation.max_users=null"
            )
        monitor = self.evaluation.monitor
        if monitor is None or stage != "fit" or not self.trainer.is_global_zero:
            return
        n = sample.full_every_n_epochs
        full = f"every user on epochs 0, {n}, {2 * n}, ... (val/...)" if n else "never every user"
        if monitor.startswith(f"{SAMPLE_PREFIX}/"):
            follows = (f"checkpointing and early stopping follow {monitor}, a figure over the sample, "
                       "not the whole validation split (opted in by monitoring it)")
        else:
            follows = f"checkpointing and early stopping follow {monitor} on full evaluations only"
        log.info("validation ranks a fixed sample of %d users (seed %d, %s/...) every epoch and %s; %s",
                 sample.max_users, sample.seed, SAMPLE_PREFIX, full, follows)

    # ------------------------------------------------------------------ DDP and sparse gradients
    def setup(self, stage: str) -> None:
        self._check_validation_sample(stage)
        # Before the strategy wraps the module: under DDP the sparse item tables are averaged by
        # the task (optim/sparse_grad_sync.py), not by DDP's sparse all-reduce.
        # Under ModelParallelStrategy (a device mesh) the tables are sharded: a shard's copies on
        # other data-parallel ranks are averaged by the task itself (CTRTask.on_after_backward).
        if self.trainer.world_size > 1 and self.device_mesh is None:
            names = sparse_parameter_names(self)
            self._ddp_params_and_buffers_to_ignore = names
            self._sparse_synced = [self.get_parameter(name) for name in names]

    def on_fit_start(self) -> None:
        # DDP reads the ignore list when it wraps the module: if a strategy wrapped it earlier,
        # these gradients would be averaged twice, silently.
        ignored = getattr(self.trainer.strategy.model, "parameters_to_ignore", None)
        if not self._sparse_synced or ignored is None:
            return
        reduced_twice = sorted(set(self._ddp_params_and_buffers_to_ignore) - set(ignored))
        if reduced_twice:
            raise RuntimeError(f"DDP still reduces {reduced_twice}, which the task averages itself")

    # ------------------------------------------------------------------ optimisation
    def optimize(self, loss: torch.Tensor) -> None:
        """Backward ``loss`` and update once.

        Under DDP a rank with no rows left pads its epoch with a zero loss (GRU4Rec's sessions
        split unevenly); it still receives the other ranks' averaged gradient, and applies it here
        like every rank does, so the replicas stay equal and agree on ``trainer.global_step``.
        (The average is over the whole world, padding ranks' zeros included: the default of
        PyTorch's ``DistributedDataParallel.join``.)"""
        optimizer = self.optimizers()
        optimizer.zero_grad(set_to_none=True)
        self.manual_backward(loss)
        if self._sparse_synced:
            average_sparse_grads_(self._sparse_synced)
        if self.gradient_clip_val:
            self.configure_gradient_clipping(optimizer, self.gradient_clip_val, self.gradient_clip_algorithm)
        optimizer.step()
        self.step_scheduler_per_update()

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        # Lightning calls the training step inside its mixed-precision autocast (trainer.precision=
        # bf16-mixed / 16-mixed), and a manual backward with it. PyTorch's AMP guidance is a backward
        # outside autocast: each op's backward already runs in the dtype its forward chose, while a
        # custom Function's backward would be autocast anew (the sampled softmax's sparse product
        # in bf16, which the CPU lacks; gradients in another dtype than their forward's)
        with torch.autocast(loss.device.type, enabled=False):
            super().manual_backward(loss, *args, **kwargs)

    def step_scheduler_per_update(self) -> None:
        """Step the schedule after an update when it counts updates (``scheduler_interval=step``)."""
        if self.scheduler_interval == "step" and self.scheduler_factory is not None:
            self.lr_schedulers().step()

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ) -> None:
        # Lightning's own clipping cannot take norms of the item tables' sparse gradients.
        if not gradient_clip_val:
            return
        if gradient_clip_algorithm == "value":
            clip_grad_value_(self.parameters(), gradient_clip_val)
        else:
            split, group = self.split_parameters()
            clip_grad_norm_(self.parameters(), gradient_clip_val, split, group)

    def split_parameters(self) -> tuple[list[nn.Parameter], Any]:
        """The parameters of which this process holds only a part (a sharded table's rows), and
        the process group that holds the rest; norm clipping sums their squares over that group.
        None here: every parameter is whole on every process (a family that shards overrides it)."""
        return [], None

    def optimizer_params(self):
        """What the optimizer factory is given: every parameter, in one group. An optimizer that
        routes groups by their ``"sparse"`` flag (:class:`DenseSparseOptimizer`:
        ``optimizer=rowwise_adagrad``, ``adam_rowwise_adagrad``) gets the sparse-gradient item
        tables as a flagged group of their own, for its sparse child (a family may split them
        otherwise)."""
        factory = getattr(self.optimizer_factory, "func", self.optimizer_factory)
        names = sparse_parameter_names(self)
        if not names or not (isinstance(factory, type) and issubclass(factory, DenseSparseOptimizer)):
            return self.parameters()
        tables = list({id(p): p for p in map(self.get_parameter, names)}.values())
        table_ids = {id(p) for p in tables}
        return [{"params": [p for p in self.parameters() if id(p) not in table_ids]},
                {"params": tables, "sparse": True}]

    def configure_optimizers(self):
        check_optimizer_takes_sparse(self.optimizer_factory, self.model, CONF_DIR)
        optimizer = self.optimizer_factory(params=self.optimizer_params())
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler_factory(optimizer=optimizer)}

    # ------------------------------------------------------------------ training loss and epochs
    def train_loss(self, batch: Any) -> torch.Tensor:
        """The loss one update of ``training_step`` optimises, without the update or any logging.
        Every ``training_step`` calls it, so a benchmark's plain loop
        (benchmarks/train_throughput.py) runs the same code as training."""
        raise NotImplementedError(f"{type(self).__name__} defines no train_loss")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """One update on ``train_loss(batch)`` (a family whose batch holds several updates overrides it)."""
        loss = self.train_loss(batch)
        self.optimize(loss)
        self.record_loss(loss)
        self.log_step_loss(loss, batch_idx, batch.size)
        return loss

    def on_train_start(self) -> None:
        # Lightning does not call on_train_epoch_start when it resumes inside an epoch, so the
        # epoch's state starts here too (a resumed epoch's mean loss counts from the resume)
        self.on_train_epoch_start()

    def on_train_epoch_start(self) -> None:
        self._loss_sum = torch.zeros((), device=self.device)
        self._loss_steps = 0

    def record_loss(self, loss: torch.Tensor) -> None:
        """Add one update's loss to the epoch mean (summed on the device: no sync per step)."""
        self._loss_sum += loss.detach()
        self._loss_steps += 1

    def log_step_loss(self, loss: torch.Tensor, batch_idx: int, batch_size: int) -> None:
        # Lightning's per-call logging costs ~5% of a GRU4Rec step: the value is handed over
        # only as often as the loggers write it.
        if batch_size and batch_idx % self.trainer.log_every_n_steps == 0:
            self.log("train/loss_step", loss, prog_bar=True, batch_size=batch_size)

    def on_train_epoch_end(self) -> None:
        if self._loss_steps:
            mean = self._loss_sum / self._loss_steps
            self.log("train/loss_epoch", mean, on_step=False, on_epoch=True, prog_bar=True, sync_dist=True)
        scheduler = self.lr_schedulers()
        if scheduler is not None and self.scheduler_interval == "epoch":
            scheduler.step()  # manual optimisation steps its schedulers itself

    # ------------------------------------------------------------------ state that survives a resume
    def register_lazy(self, name: str, factory: Callable[[], Any]) -> None:
        """An object built on first use (it may need the device or the rank) whose
        ``state_dict`` travels in checkpoints under ``name``; ``factory`` may return None."""
        self._lazy_factories[name] = factory

    def lazy(self, name: str) -> Any:
        """The object registered as ``name``, built (and given its restored state) on first use."""
        if name not in self._lazy_objects:
            obj = self._lazy_factories[name]()
            state = self._pending_states.pop(name, None)
            if obj is not None and state is not None:
                obj.load_state_dict(state)
            self._lazy_objects[name] = obj
        return self._lazy_objects[name]

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        for name, obj in self._lazy_objects.items():
            if obj is not None:
                checkpoint[name] = obj.state_dict()
        self._gather_rank_states(checkpoint)
        self._reopen_a_cut_last_batch(checkpoint)

    def _reopen_a_cut_last_batch(self, checkpoint: dict) -> None:
        """A step limit that cut the epoch's last batch short (``batch_cut_after``): Lightning
        counts that batch as trained, and resumed from there it closes the epoch, so the batch's
        other updates never ran and the next epoch started without ``on_train_epoch_start``
        (GRU4Rec carried its sessions in flight into it). The checkpoint's batch progress is put
        back to the end of the batch before, as if saved there: the resumed epoch takes the cut
        batch's other updates from the loader (its state says where the cut was) and ends as
        usual. A cut inside the epoch needs none of this: the loader joins the rest to the next
        batch, and Lightning's count holds."""
        if not self.batch_cut_after:
            return
        progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
        if not progress or not progress.get("is_last_batch"):
            return
        for part in ("total", "current"):
            counts = progress[part]
            if counts["completed"] != counts["processed"] - 1:  # not saved at the batch's end
                return
        for part in ("total", "current"):
            for key in ("ready", "started", "processed", "completed"):
                progress[part][key] -= 1
        progress["is_last_batch"] = False

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._take_own_rank_state(checkpoint)
        self._pending_states = {n: checkpoint[n] for n in self._lazy_factories if n in checkpoint}
        self._lazy_objects.clear()

    # Under DDP each rank draws its own negatives (a stream per rank: the samplers registered
    # lazily, the losses' generators in their "_extra_state") and GRU4Rec's ranks hold their own
    # sessions in flight (``rank_local_keys``), while rank 0 alone writes the checkpoint. Every
    # rank's entries travel in it, gathered as it is saved (every rank takes part in a save), and
    # a resume on as many ranks gives each its own back. On another number of ranks (more than
    # one) each rank restarts its own stream from (seed, rank), as a fresh run does: Lightning
    # alone gave every rank rank 0's, so they all drew the same negatives.
    rank_local_keys: ClassVar[tuple[str, ...]] = ()

    @property
    def has_own_rank_state(self) -> bool:
        """Whether the checkpoint this run resumed from gave this rank its own entries."""
        return self._own_rank_state

    def _rank_local_names(self, checkpoint: dict) -> tuple[list[str], list[str]]:
        """The checkpoint's entries and state-dict keys that each rank holds its own of."""
        entries = [key for key in (*self._lazy_factories, *self.rank_local_keys) if key in checkpoint]
        extra = [key for key in checkpoint.get("state_dict", {}) if key.endswith("_extra_state")]
        return entries, extra

    def _gather_rank_states(self, checkpoint: dict) -> None:
        trainer = self._trainer
        if trainer is None or trainer.world_size == 1 or not torch.distributed.is_initialized():
            return
        entries, extra = self._rank_local_names(checkpoint)
        # what a rank may hold is the model's, the same on every rank: no rank skips the gather alone
        if not (self._lazy_factories or self.rank_local_keys or extra):
            return
        mine = {"entries": {k: checkpoint[k] for k in entries},
                "state_dict": {k: checkpoint["state_dict"][k] for k in extra}}
        states: list[Any] = [None] * trainer.world_size
        torch.distributed.all_gather_object(states, mine)
        checkpoint["rank_states"] = states

    def _take_own_rank_state(self, checkpoint: dict) -> None:
        states, trainer = checkpoint.get("rank_states"), self._trainer
        self._own_rank_state = False
        if trainer is None or trainer.world_size == 1:
            return  # one process continues with rank 0's, which the checkpoint holds
        if states is None or trainer.world_size != len(states):
            entries, extra = self._rank_local_names(checkpoint)
            if not (entries or extra):
                return  # nothing a rank holds of its own (DLRM)
            own = self.state_dict()  # after setup: each stream seeded from (seed, rank)
            for key in extra:
                checkpoint["state_dict"][key] = own[key]
            for key in entries:
                checkpoint.pop(key)
            if trainer.is_global_zero:
                log.info("the checkpoint holds the negatives' streams of %s process(es), not of these %d: "
                         "each rank restarts its own", len(states) if states else 1, trainer.world_size)
            return
        mine = states[trainer.global_rank]
        checkpoint.update(mine["entries"])
        for key in self.rank_local_keys:
            if key not in mine["entries"]:
                checkpoint.pop(key, None)  # this rank had none when it was saved
        checkpoint["state_dict"].update(mine["state_dict"])
        self._own_rank_state = True

    # ------------------------------------------------------------------ evaluation
    def _log_evaluation(self, split: str) -> None:
        # computed once per epoch: the metric sums are reduced across DDP ranks inside
        values = self.evaluation.compute_and_reset(split)
        self.log_dict(values, sync_dist=False)
        if split == "val" and not self.trainer.sanity_checking:
            # Lightning drops what the sanity check logs: no callback may take it as logged
            self.last_validation_logged = set(values)

    def on_validation_epoch_end(self) -> None:
        self._log_evaluation("val")

    def on_test_epoch_end(self) -> None:
        self._log_evaluation("test")
