"""Every declared-valid config combination composes and builds; invalid ones fail clearly."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from processes import run_child
import yaml
from hydra.utils import get_class, instantiate

from conftest import CONF_DIR, REPO_ROOT
from recforge.config_checks import IncompatibleConfigError, check_combination
from recforge.contracts import missing_parameters
from recforge.data.sessions.io import write_session_file
from recforge.data.sessions.synthetic import SyntheticSessionsConfig, generate_sessions, split_by_time
from recforge.pipeline import build


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _target(group: str, option: str) -> type:
    node = yaml.safe_load((CONF_DIR / group / f"{option}.yaml").read_text())
    return get_class(node["_target_"]) if "_target_" in node else type(None)  # a renamed option's alias


def _task(model: str) -> type:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return get_class(compose("train", overrides=[f"model={model}"]).task._target_)


def accepted(model: str, group: str) -> list[str]:
    """The options of ``group`` a model's task declares it accepts (contracts, not a list here)."""
    task = _task(model)
    fits = {
        "data": lambda cls: getattr(cls, "batch_type", None) is task.batch_type,
        "loss": lambda cls: getattr(cls, "consumes", None) == task.produces,
        "evaluation": lambda cls: getattr(cls, "kind", None) == task.evaluation_kind,
    }[group]
    return [o for o in _options(group) if fits(_target(group, o))]


# An independent statement of what each family is meant to accept: the declarations above must
# produce exactly this (a new family adds a line here and its configs, nothing else).
EXPECTED = {
    ("gru4rec", "data"): ["coveo", "diginetica", "rees46", "retailrocket", "rsc15", "synthetic", "yoochoose"],
    ("gru4rec", "loss"): ["bpr", "bprmax", "top1", "top1max", "xe"],
    ("sasrec", "data"): ["amzn-books", "ml-1m", "ml-20m", "synthetic_histories"],
    ("sasrec", "loss"): ["full_softmax", "sampled_softmax"],
    ("hstu", "data"): ["amzn-books", "ml-1m", "ml-20m", "synthetic_histories"],
    ("hstu", "loss"): ["full_softmax", "sampled_softmax"],
    ("dlrm", "data"): ["criteo_kaggle", "criteo_terabyte", "synthetic_criteo"],
    ("dlrm", "loss"): ["bce"],
}
MODELS = _options("model")


@pytest.mark.parametrize("model", MODELS)
def test_each_model_declares_what_it_accepts(model):
    for group in ("data", "loss"):
        assert accepted(model, group) == EXPECTED[(model, group)], group
    assert accepted(model, "evaluation"), "no evaluation fits the model's task"
    model_cls = _target("model", model)
    for contract in model_cls.implements:  # the declaration is a promise an instance keeps
        assert isinstance(_tiny(model_cls), contract), contract
        assert missing_parameters(model_cls, contract) == [], contract


def test_a_model_missing_a_keyword_of_its_contract_is_found():
    from recforge.contracts import SessionModel

    class Partial:  # train_step without the fast step's keyword; step with every parameter by **kwargs
        def train_step(self, items, hidden, columns): ...

        def step(self, **kwargs): ...

    assert missing_parameters(Partial, SessionModel) == ["train_step(distinct_rows)", "item_weights()"]


def _tiny(model_cls: type):
    """A small instance of a model, built from what its family's data hands it."""
    from recforge.contracts import CTRModel

    if CTRModel in model_cls.implements:
        return model_cls(cardinalities=[5] * 26, n_dense=13)
    return model_cls(n_items=5)


@pytest.fixture(scope="module")
def data_files(tmp_path_factory) -> dict[str, Path]:
    """Tiny inputs for the file-based data configs: GRU4Rec text files, a prepared histories dir."""
    from recforge.data.sequences.synthetic import SyntheticHistoriesConfig, write_synthetic_histories

    root = tmp_path_factory.mktemp("prepared")
    frame = generate_sessions(SyntheticSessionsConfig(n_items=50, n_sessions=300, seed=3))
    train, test = split_by_time(frame, 2)
    paths = {"train": root / "train.txt", "test": root / "test.txt"}
    write_session_file(train, paths["train"])
    write_session_file(test, paths["test"])
    histories = SyntheticHistoriesConfig(n_users=60, n_items=40, min_length=5, max_length=20)
    paths["histories"] = write_synthetic_histories(histories, root / "histories")
    for day in range(2):  # raw Criteo text: a Kaggle train.txt, or two Terabyte day files
        paths[f"criteo_day_{day}"] = _raw_criteo(root / f"day_{day}", rows=160, seed=day)
    return paths


def _raw_criteo(path: Path, rows: int, seed: int) -> Path:
    """Raw Criteo lines: label, 13 integers, 26 hex values, tab-separated, some fields empty."""
    import random

    rng = random.Random(seed)
    lines = []
    for _ in range(rows):
        dense = ["" if rng.random() < 0.1 else str(rng.randint(0, 50)) for _ in range(13)]
        cats = ["" if rng.random() < 0.1 else f"{rng.randint(0, 40):08x}" for _ in range(26)]
        lines.append("\t".join([str(int(rng.random() < 0.3)), *dense, *cats]))
    path.write_text("\n".join(lines) + "\n")
    return path


def _data_overrides(data: str, files: dict[str, Path]) -> list[str]:
    """What a data option needs on top of its config: nothing when it generates its data."""
    if "generator" in yaml.safe_load((CONF_DIR / "data" / f"{data}.yaml").read_text()):
        return []
    batch_type = _target("data", data).batch_type.__name__
    if batch_type == "HistoryBatch":
        return [f"data.prepared_dir={files['histories']}"]
    if batch_type == "CTRBatch":
        node = yaml.safe_load((CONF_DIR / "data" / f"{data}.yaml").read_text())
        days = (node.get("prepare") or {}).get("split") == "days"
        raw = f"[{files['criteo_day_0']},{files['criteo_day_1']}]" if days else str(files["criteo_day_0"])
        return [f"data.raw_path={raw}"]
    return [f"data.train_path={files['train']}", f"data.test_path={files['test']}"]


# Linear in the options: each model with each data option (its default loss) and each loss
# option (its default data), not the data x model x loss product.
CASES = [(m, g, o) for m in MODELS for g in ("data", "loss") for o in _options(g)]


@pytest.mark.parametrize("model,group,option", CASES)
def test_option_builds_with_the_model_or_fails_clearly(model, group, option, make_cfg, data_files):
    # the loss cases run on the model's default data, which every model generates
    overrides = [f"model={model}", f"{group}={option}"]
    cfg = make_cfg(*overrides, *(_data_overrides(option, data_files) if group == "data" else []))
    choices = {"model": model, group: option}
    if option in EXPECTED[(model, group)]:
        check_combination(cfg, CONF_DIR, choices)
        datamodule, task = build(cfg)
        assert task.model is not None and datamodule.task_inputs()
    else:
        with pytest.raises(IncompatibleConfigError) as err:
            check_combination(cfg, CONF_DIR, choices)
        message = str(err.value)
        assert "\n" not in message
        assert message.startswith(f"model={model} with {group}={option}: ")
        assert message.endswith(f"{group} options for model={model}: {', '.join(EXPECTED[(model, group)])}")


def test_ctr_loss_on_next_item_model_names_the_allowed_losses(make_cfg):
    cfg = make_cfg("loss=bce")
    allowed = ", ".join(EXPECTED[("gru4rec", "loss")])
    with pytest.raises(IncompatibleConfigError, match=rf"loss options for model=gru4rec: {allowed}$"):
        check_combination(cfg, CONF_DIR, {"model": "gru4rec", "loss": "bce"})


def test_a_task_that_cannot_drive_the_model_names_the_tasks_that_can(make_cfg):
    cfg = make_cfg("model=sasrec", "task=session_next_item")
    with pytest.raises(IncompatibleConfigError, match=r"^model=sasrec with task=session_next_item: the task "
                       r"drives a SessionModel but the model implements SequenceModel; task options for "
                       r"model=sasrec: sequential_retrieval$"):
        check_combination(cfg, CONF_DIR, {"model": "sasrec", "task": "session_next_item"})


def test_invalid_combination_fails_at_start_in_one_line(tmp_path):
    done = run_child(
        # the run directory Hydra opens before recforge refuses the config: not the repo's outputs/
        [sys.executable, "src/train.py", "loss=bce", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("recforge: model=gru4rec with loss=bce")
    assert last.endswith(", ".join(EXPECTED[("gru4rec", "loss")]))
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("hardware", _options("hardware"))
def test_hardware_presets_compose(hardware, make_cfg):
    cfg = make_cfg(f"hardware={hardware}")
    assert cfg.trainer.accelerator in ("cpu", "gpu")
    if cfg.trainer.accelerator == "cpu":
        trainer = instantiate(cfg.trainer, logger=False, enable_checkpointing=False)
        assert trainer.num_devices == cfg.trainer.devices


@pytest.mark.parametrize("logger", _options("logger"))
def test_logger_presets_compose(logger, make_cfg):
    cfg = make_cfg(f"logger={logger}")
    assert all("_target_" in node for node in cfg.logger.values())


@pytest.mark.parametrize("search", _options("hparams_search"))
def test_search_presets_compose(search, make_cfg):
    cfg = make_cfg(f"hparams_search={search}")
    for key in cfg.hydra.sweeper.params:
        assert OmegaConf_select(cfg, key) is not None, f"{search} searches {key}, which is not a config key"


def OmegaConf_select(cfg, key):
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key, default=None)


@pytest.mark.slow
@pytest.mark.parametrize("experiment", _options("experiment"))
def test_every_experiment_runs_a_few_batches(experiment, make_cfg, data_files):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from recforge.pipeline import train

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        probe = compose("train", overrides=[f"experiment={experiment}"], return_hydra_config=True)
    data = probe.hydra.runtime.choices.data
    # tiny widths keep the 512-unit presets cheap; everything else is the preset's own
    narrow = ["model.hidden_size=16"] if OmegaConf.select(probe, "model.hidden_size") else []
    cfg = make_cfg(f"experiment={experiment}", "trainer.fast_dev_run=3", *narrow,
                   *_data_overrides(data, data_files))
    metrics = train(cfg)
    assert cfg.evaluation.monitor.replace("val/", "test/") in metrics


@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["dlrm_criteo_x1", "sasrec_ml-1m", "hstu_ml-1m"])
def test_a_step_limit_before_the_first_validation_ends_the_run(experiment, make_cfg, data_files):
    # Presets that validate every epoch and stop early on a validation metric: one update, then
    # trainer.max_steps ends the fit before any validation. Early stopping has nothing to act on
    # (the sanity check's figures are not a pass), and the last checkpoint is tested.
    import torch
    from hydra import compose, initialize_config_dir

    from recforge.pipeline import train

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        probe = compose("train", overrides=[f"experiment={experiment}"], return_hydra_config=True)
    assert probe.callbacks.early_stopping.monitor.startswith("val/")
    cfg = make_cfg(f"experiment={experiment}", "trainer.max_epochs=2", "trainer.max_steps=1",
                   *_data_overrides(probe.hydra.runtime.choices.data, data_files))
    metrics = train(cfg)
    assert not [key for key in metrics if key.startswith("val/")]  # no validation pass ran
    assert Path(metrics["test_checkpoint"]).name == "last.ckpt"
    assert torch.load(metrics["test_checkpoint"], map_location="cpu", weights_only=False)["global_step"] == 1
    assert cfg.evaluation.monitor.replace("val/", "test/") in metrics


@pytest.mark.slow
def test_validation_twice_an_epoch_is_one_override(make_cfg):
    # trainer.val_check_interval is in the trainer's config, so no '+' is needed; early stopping and
    # checkpointing act on each of the passes
    import csv

    from recforge.pipeline import train

    cfg = make_cfg("model=dlrm", "data.generator.n_rows=6000", "trainer.max_epochs=2",
                   "trainer.val_check_interval=0.5", "logger=csv")
    metrics = train(cfg)
    with open(Path(cfg.paths.output_dir) / "csv" / "metrics.csv", newline="") as f:
        passes = [row for row in csv.DictReader(f) if row.get("val/auc")]
    assert [int(row["epoch"]) for row in passes] == [0, 0, 1, 1]
    assert 0 < metrics["test/auc"] < 1


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_every_model_trains_and_evaluates_under_bf16_autocast(model, make_cfg, monkeypatch):
    # hardware=bf16's precision (a GPU preset) on this CPU: Lightning's autocast around the
    # training step, its manual backward and the evaluation
    import lightning as L
    import torch

    from recforge import pipeline

    class AutocastInBackward(L.Callback):
        """Whether autocast was on when each parameter's gradient arrived (hooks fire inside the
        backward, on this thread)."""

        def __init__(self) -> None:
            self.seen: list[bool] = []

        def on_train_start(self, trainer, pl_module) -> None:
            for param in pl_module.parameters():
                if param.requires_grad:
                    param.register_hook(lambda grad: self.seen.append(torch.is_autocast_enabled("cpu")))

    probe = AutocastInBackward()
    callbacks = pipeline._callbacks
    monkeypatch.setattr(pipeline, "_callbacks", lambda cfg, has_validation: [*callbacks(cfg, has_validation), probe])
    metrics = pipeline.train(make_cfg(f"model={model}", "trainer.precision=bf16-mixed", "trainer.fast_dev_run=3"))
    monitored = [key for key in metrics if key.startswith("test/") and not key.endswith("_per_s")]
    assert monitored and all(math.isfinite(metrics[key]) for key in monitored)
    # the task's backward runs outside the step's autocast (RecTask.manual_backward), as PyTorch's
    # AMP guidance has it: a custom Function's backward is not autocast anew
    assert probe.seen and not any(probe.seen)


@pytest.mark.slow
@pytest.mark.parametrize("debug", ["fdr", "limit", "overfit"])
def test_debug_presets_run(debug, make_cfg):
    from recforge.pipeline import train

    extra = {
        "fdr": [],
        "limit": ["trainer.limit_train_batches=5", "trainer.limit_val_batches=2", "trainer.limit_test_batches=2"],
        "overfit": ["trainer.max_epochs=2", "trainer.overfit_batches=3"],
    }[debug]
    cfg = make_cfg(f"debug={debug}", *extra)
    metrics = train(cfg)
    assert metrics.get("test/recall@20") is not None


def test_family_test_sizes_are_gathered_and_a_contradiction_is_refused(tmp_path):
    from conftest import family_sizes

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "cheap_sizes.yaml").write_text("data.generator.n_items: 300\nmodel.hidden_size: 32\n")
    (tmp_path / "b" / "cheap_sizes.yaml").write_text("data.generator.n_items: 300\n")
    assert family_sizes(tmp_path) == ["data.generator.n_items=300", "model.hidden_size=32"]
    (tmp_path / "b" / "cheap_sizes.yaml").write_text("data.generator.n_items: 400\n")
    with pytest.raises(ValueError, match="n_items=400 contradicts data.generator.n_items=300"):
        family_sizes(tmp_path)
