"""Every declared-valid config combination composes and builds; invalid ones fail clearly."""
from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.utils import instantiate

from conftest import CONF_DIR, REPO_ROOT
from recforge.config_checks import IncompatibleConfigError, check_combination
from recforge.data.sessions.io import write_session_file
from recforge.data.synthetic import SyntheticSessionsConfig, generate_sessions, split_by_time
from recforge.pipeline import build



def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


# What is declared to work: GRU4Rec on every session dataset with every next-item loss; the CTR
# loss (bce) must be refused.
SESSION_DATA = ["synthetic", "rsc15", "yoochoose", "retailrocket", "diginetica", "coveo", "rees46"]
CTR_LOSSES = ["bce"]
VALID = {
    (data, "gru4rec", loss)
    for data in SESSION_DATA
    for loss in _options("loss")
    if loss not in CTR_LOSSES
}


@pytest.fixture(scope="module")
def session_files(tmp_path_factory) -> dict[str, Path]:
    """Tiny prepared files in the GRU4Rec text format, for the file-based data configs."""
    root = tmp_path_factory.mktemp("prepared")
    frame = generate_sessions(SyntheticSessionsConfig(n_items=50, n_sessions=300, seed=3))
    train, test = split_by_time(frame, 2)
    paths = {"train": root / "train.txt", "test": root / "test.txt"}
    write_session_file(train, paths["train"])
    write_session_file(test, paths["test"])
    return paths


def _data_overrides(data: str, files: dict[str, Path]) -> list[str]:
    if data == "synthetic":
        return []
    return [f"data.train_path={files['train']}", f"data.test_path={files['test']}"]


COMBINATIONS = list(itertools.product(_options("data"), _options("model"), _options("loss")))


def test_the_declared_combinations_exist():
    assert VALID <= set(COMBINATIONS)


@pytest.mark.parametrize("data,model,loss", COMBINATIONS)
def test_combination_builds_or_fails_clearly(data, model, loss, make_cfg, session_files):
    cfg = make_cfg(f"data={data}", f"model={model}", f"loss={loss}", *_data_overrides(data, session_files))
    choices = {"data": data, "model": model, "loss": loss}
    if (data, model, loss) in VALID:
        check_combination(cfg, CONF_DIR, choices)
        datamodule, task = build(cfg)
        trainer = instantiate(cfg.trainer, logger=False, enable_checkpointing=False)
        assert trainer is not None
        assert task.model.n_items == datamodule.catalog.n_items
    else:
        with pytest.raises(IncompatibleConfigError) as err:
            check_combination(cfg, CONF_DIR, choices)
        message = str(err.value)
        assert "\n" not in message
        assert f"model={model}" in message and (f"loss={loss}" in message or f"data={data}" in message)
        assert "options for" in message


def test_ctr_loss_on_next_item_model_names_the_allowed_losses(make_cfg):
    cfg = make_cfg("loss=bce")
    allowed = ", ".join(loss for loss in _options("loss") if loss not in CTR_LOSSES)
    with pytest.raises(IncompatibleConfigError, match=rf"loss options for model=gru4rec: {allowed}$"):
        check_combination(cfg, CONF_DIR, {"model": "gru4rec", "loss": "bce"})


def test_invalid_combination_fails_at_start_in_one_line(tmp_path):
    done = subprocess.run(
        # the run directory Hydra opens before recforge refuses the config: not the repo's outputs/
        [sys.executable, "src/train.py", "loss=bce", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    allowed = ", ".join(loss for loss in _options("loss") if loss not in CTR_LOSSES)
    assert last.startswith("recforge: model=gru4rec with loss=bce") and last.endswith(allowed)
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
def test_every_experiment_runs_a_few_batches(experiment, make_cfg, session_files):
    from recforge.pipeline import train

    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        data = compose("train", overrides=[f"experiment={experiment}"]).data
    extra = [] if "generator" in data else _data_overrides("rsc15", session_files)
    # tiny widths keep the 512-unit presets cheap; everything else is the preset's own
    cfg = make_cfg(f"experiment={experiment}", "trainer.fast_dev_run=3", "model.hidden_size=16", *extra)
    metrics = train(cfg)
    assert "test/recall@20" in metrics


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
