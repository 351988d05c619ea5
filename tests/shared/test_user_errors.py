"""What a new user hits: useless input, bad values, missing checkpoints. Each is refused at start,
before any training, in one ``recforge:`` line that names the key the user set and what is allowed."""
from __future__ import annotations

import logging
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from processes import run_child
import torch
from conftest import (
    CHEAP,
    TINY_RUN,
    compose_config,
    run_command,
    shrinks_for,
    user_checkout,
)

from recforge.errors import UserInputError
from recforge.pipeline import evaluate, metric_value, train

HEADER = "SessionId\tItemId\tTime\n"
# the checkout's local profile for runs on prepared files (data.generator is synthetic data's)
FILES_RUN = [o for o in TINY_RUN if not o.startswith("data.generator.")]


def _sessions(path: Path, sessions: list[list[str]], start: int = 1000) -> Path:
    """A session file: one list of item ids per session, one second between events."""
    rows, t = [HEADER], start
    for sid, items in enumerate(sessions):
        for item in items:
            t += 1
            rows.append(f"{sid}\t{item}\t{t}\n")
    path.write_text("".join(rows))
    return path


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """Tiny prepared files: 300 training sessions over items 0..39, and a test split over them."""
    train_sessions = [[str((s * 7 + k * 3) % 40) for k in range(2 + s % 4)] for s in range(300)]
    test_sessions = [[str((s * 5 + k) % 40) for k in range(3)] for s in range(40)]
    return {
        "train": _sessions(tmp_path / "train.txt", train_sessions),
        "test": _sessions(tmp_path / "test.txt", test_sessions, start=10**6),
        "single": _sessions(tmp_path / "single.txt", [[str(s % 40)] for s in range(200)]),
        "unknown": _sessions(tmp_path / "unknown.txt", [[f"new{s}", f"new{s}b", f"new{s}c"] for s in range(50)], 10**6),
        # 40 sessions of known items, 60 of unknown ones: 60% of the events are dropped
        "mostly_unknown": _sessions(
            tmp_path / "mostly_unknown.txt",
            test_sessions + [[f"new{s}", f"new{s}b", f"new{s}c"] for s in range(60)], 10**6,
        ),
        "bad": tmp_path / "bad.txt",
    }


def _rsc15(files: dict[str, Path], train: str = "train", test: str = "test") -> list[str]:
    return ["data=rsc15", f"data.train_path={files[train]}", f"data.test_path={files[test]}"]


def _cfg(tmp_path: Path, *overrides: str, name: str = "train", run: str = "run", shrink: bool = True):
    """``shrink=False`` for a resume: test sizes given on its command line would apply over the
    run's own sections, as a user's overrides do."""
    cheap = CHEAP if name == "train" else []
    if any(o.startswith("callbacks=") for o in overrides):
        cheap = [o for o in cheap if not o.startswith("callbacks.")]
    cfg = compose_config(name, [*cheap, *overrides], tmp_path / run, tmp_path / "data")
    sizes = shrinks_for(cfg, list(overrides)) if name == "train" and shrink else []
    return compose_config(name, [*cheap, *sizes, *overrides], tmp_path / run, tmp_path / "data")


def _refused(cfg, match: str | None, fn=train, announced: bool = False) -> UserInputError:
    """``announced``: the refusal comes from the Trainer's first call into the data (after the
    config tree was printed), not from the checks before it."""
    with pytest.raises(UserInputError, match=match) as error:
        fn(cfg)
    assert "\n" not in str(error.value)
    # at start: nothing was trained or written
    run_dir = Path(cfg.paths.output_dir)
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.json").exists()
    # nor was the config tree printed: the error is the first thing the user reads
    assert (run_dir / "config_tree.log").exists() == announced
    return error.value


# ---------------------------------------------------------------- useless input
def test_training_file_without_training_pairs_is_refused(tmp_path, files):
    _refused(
        _cfg(tmp_path, *_rsc15(files, train="single")),
        r"^data\.train_path=.*single\.txt: nothing to train on: 200 session\(s\) with 200 event\(s\) "
        r"were read and no session has two events",
    )


def test_too_few_sessions_for_the_loss_are_refused_before_a_step(tmp_path, files):
    # one session with two events: without extra samples a mini-batch needs two such sessions
    _sessions(files["single"], [["1", "2"]] + [[str(s % 40)] for s in range(50)])
    _refused(
        _cfg(tmp_path, *_rsc15(files, train="single"), "task.n_sample=0"),
        r"^data\.train_path=.*single\.txt: nothing to train on: no mini-batch has the 2 sessions of two "
        r"or more events that the loss needs",
    )


def test_test_file_of_unknown_items_is_refused(tmp_path, files):
    _refused(
        _cfg(tmp_path, *_rsc15(files, test="unknown")),
        r"^data\.test_path=.*unknown\.txt: nothing to evaluate: 150 of its 150 events \(100%\) were "
        r"dropped as items the training file .* does not have",
    )


def test_dropped_unknown_items_are_counted_and_a_majority_warned(tmp_path, files, caplog):
    cfg = _cfg(tmp_path, *_rsc15(files, test="mostly_unknown"), "trainer.limit_train_batches=2")
    with caplog.at_level(logging.INFO, logger="recforge"):
        metrics = train(cfg)
    assert "test/recall@20" in metrics
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("test: 300 events read, 180 (60.0%) of items unknown to the training file dropped; "
               "40 sessions, 80 targets left" in m for m in info), info
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith("data.test_path=") and "60% of its events (180 of 300)" in m for m in warned), warned


@pytest.mark.parametrize("which", ["test", "valid"])
def test_missing_evaluation_file_is_found_before_training(tmp_path, files, which):
    cfg = _cfg(tmp_path, *_rsc15(files), f"data.{which}_path={tmp_path / 'nope.txt'}")
    _refused(cfg, rf"^data\.{which}_path: session file .*nope\.txt does not exist$")


def test_malformed_validation_file_is_found_before_training(tmp_path, files):
    files["bad"].write_text(HEADER + "1\t3\t100\n1\t4\tlater\n")
    cfg = _cfg(tmp_path, *_rsc15(files), f"data.valid_path={files['bad']}")
    _refused(cfg, r"^data\.valid_path: .*bad\.txt, line 3: column 'Time': expected a finite number, got 'later'$")


# ---------------------------------------------------------------- bad values
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.batch_size=0"], "data.batch_size=0: expected an integer >= 1"),
        (["data.batch_size=-5"], "data.batch_size=-5: expected an integer >= 1"),
        (["data.steps_per_batch=0"], "data.steps_per_batch=0: expected an integer >= 1"),
        (["model.hidden_size=0"], "model.hidden_size=0: expected an integer >= 1"),
        (["model.layers=[64,0]"], "model.layers=[64, 0]: expected a list (each item an integer >= 1) or null"),
        (["model.dropout_p_hidden=1.5"], "model.dropout_p_hidden=1.5: expected a number >= 0 and < 1"),
        (["model.cell=gru"], "model.cell=gru: expected one of torch, original"),
        (["loss=bprmax", "loss.bpreg=abc"], "loss.bpreg=abc: expected a number >= 0"),
        (["optimizer.lr=0"], "optimizer.lr=0: expected a number > 0"),
        (["task.gradient_clip_algorithm=l2"], "task.gradient_clip_algorithm=l2: expected one of norm, value"),
        (["trainer.max_epochs=many"], "trainer.max_epochs=many: expected an integer or null"),
        (["+model.hiden_size=3"], "model.hiden_size: GRU4Rec takes no parameter 'hiden_size'"),
        (["evaluation.chunk_size=0"], "evaluation.chunk_size=0: expected an integer >= 1"),
        (["evaluation.ties=random"], "evaluation: unknown tie policy 'random'"),
        # task.seed is ${oc.select:seed,0}: the key the user set is named
        (["seed=abc"], "seed=abc: expected an integer or null"),
        (["model=sasrec", "model.num_heads=3"],
         "model.num_heads=3: the heads split model.embedding_dim=50 between them; use a divisor of 50"),
        # torch's optimizers check their settings only when built (inside fit, as a traceback)
        (["model=dlrm", "optimizer=rowwise_adagrad", "optimizer.dense.eps=-1"],
         "optimizer.dense.eps=-1: torch.optim.Adagrad refuses it: Invalid epsilon value: -1"),
        (["model=dlrm", "optimizer=adam", "model.sparse_gradients=false", "optimizer.betas=[1.5,0.9]"],
         "optimizer.betas=[1.5, 0.9]: torch.optim.Adam refuses it: Invalid beta parameter at index 0: 1.5"),
        (["model=dlrm", "optimizer=sgd", "optimizer.lr=0.1", "optimizer.momentum=-1"],
         "optimizer.momentum=-1: torch.optim.SGD refuses it: Invalid momentum value: -1"),
    ],
)
def test_bad_value_names_the_key_that_was_set(tmp_path, overrides, message):
    error = _refused(_cfg(tmp_path, *overrides), None)
    assert str(error).startswith(message), str(error)


def test_max_epochs_minus_one_needs_something_that_stops(tmp_path, files):
    _refused(
        _cfg(tmp_path, *_rsc15(files), "trainer.max_epochs=-1"),
        r"^trainer\.max_epochs=-1 trains until something stops it, and nothing would",
    )
    _refused(
        _cfg(tmp_path, "trainer.max_epochs=-1", "callbacks=none", run="no_callbacks"),
        r"^trainer\.max_epochs=-1 trains until",
    )
    # a step limit stops it
    metrics = train(_cfg(tmp_path, *_rsc15(files), "trainer.max_epochs=-1", "trainer.max_steps=3", run="steps"))
    assert metrics["test/recall@20"] >= 0


@pytest.mark.parametrize("override,message", [
    ("+trainer.accumulate_grad_batches=2",
     r"^trainer\.accumulate_grad_batches=2: recforge's tasks step their optimizers themselves .*data\.batch_size"),
    ("+trainer.gradient_clip_val=0.5",
     r"^trainer\.gradient_clip_val=0\.5: clipping is the task's .* set task\.gradient_clip_val=0\.5 "),
])
def test_the_trainers_own_accumulation_and_clipping_name_what_to_set(tmp_path, override, message):
    _refused(_cfg(tmp_path, override), message)


def test_a_setting_lightning_checks_only_as_it_runs_is_one_line_naming_the_trainer_key(tmp_path):
    """Lightning checks val_check_interval against the epoch's batches only once it sets its loaders
    up (a ValueError, a traceback): the refusal is one line, with the trainer.* keys it mentions."""
    error = _refused(_cfg(tmp_path, "trainer.val_check_interval=100000"), None, announced=True)
    assert str(error).startswith("trainer.val_check_interval (100000) must be less than or equal to the "
                                 "number of the training batches"), str(error)
    assert "set trainer.check_val_every_n_epoch=None" in str(error)


# ---------------------------------------------------------------- checkpoints
def test_eval_without_ckpt_path_says_how_to_give_one(tmp_path):
    _refused(_cfg(tmp_path, name="eval"), r"^ckpt_path is not set: give the checkpoint", fn=evaluate)


@pytest.mark.parametrize("name", ["train", "eval"])
def test_missing_checkpoint_is_refused_at_start(tmp_path, name):
    cfg = _cfg(tmp_path, f"ckpt_path={tmp_path / 'gone.ckpt'}", name=name)
    _refused(cfg, r"^ckpt_path=.*gone\.ckpt does not exist$", fn=train if name == "train" else evaluate)


def test_a_file_that_is_no_checkpoint_is_refused(tmp_path, files):
    cfg = _cfg(tmp_path, f"ckpt_path={files['train']}", name="eval")
    _refused(cfg, r"is not a checkpoint written by recforge/Lightning", fn=evaluate)


@pytest.fixture
def rsc15_run(tmp_path, files) -> Path:
    """A one-epoch run on the rsc15-format files; its last checkpoint."""
    train(_cfg(tmp_path, *_rsc15(files), "trainer.max_epochs=1", run="first"))
    return tmp_path / "first" / "checkpoints" / "last.ckpt"


def test_resume_takes_the_runs_experiment_without_repeating_it(tmp_path, files, rsc15_run):
    # the default data is synthetic; the run trained on the rsc15 files
    cfg = _cfg(tmp_path, f"ckpt_path={rsc15_run}", "trainer.max_epochs=2", run="resumed", shrink=False)
    metrics = train(cfg)
    assert metrics["epochs"] == 2
    tree = (tmp_path / "resumed" / "config_tree.log").read_text()
    assert f"train_path: {files['train']}" in tree


def test_resume_with_a_different_model_names_the_key(tmp_path, rsc15_run):
    cfg = _cfg(tmp_path, f"ckpt_path={rsc15_run}", "trainer.max_epochs=2", "model.hidden_size=16", run="resumed",
               shrink=False)
    _refused(
        cfg,
        r"does not fit the model this config builds: model\.Wy\.weight is \[40, 32\] in the checkpoint, "
        r"\[40, 16\] here .*; this config differs from the run's in model\.hidden_size \(32 in the run, 16 here\)",
    )


def test_resume_of_a_finished_run_says_to_raise_max_epochs(tmp_path, rsc15_run):
    cfg = _cfg(tmp_path, f"ckpt_path={rsc15_run}", "trainer.max_epochs=1", run="resumed", shrink=False)
    _refused(cfg, r"has trained 1 epoch\(s\) and trainer\.max_epochs=1: nothing left to train")


def test_a_resume_or_eval_takes_keys_only_the_runs_family_has(tmp_path):
    """``src/eval.py ckpt_path=<a DLRM run> data.generator.n_rows=8000``: Hydra composes the default
    (GRU4Rec) experiment first, which has no such key and refused it; the command passes it as
    ``++`` (recforge.cli.onto_the_run), so it lands on the run's own section, as if the run's
    model had been named. A key the run's section does not take is still refused in one line."""
    from recforge.cli import onto_the_run

    trained = train(_cfg(tmp_path, "model=dlrm", "data.generator.n_rows=6000", run="dlrm"))
    ckpt = tmp_path / "dlrm" / "checkpoints" / "last.ckpt"
    command = onto_the_run(["src/eval.py", f"ckpt_path={ckpt}", "data.generator.n_rows=8000"])[1:]
    assert command == [f"ckpt_path={ckpt}", "++data.generator.n_rows=8000"]
    got = evaluate(_cfg(tmp_path, *command, name="eval", run="onto"))
    named = evaluate(_cfg(tmp_path, "model=dlrm", f"ckpt_path={ckpt}", "data.generator.n_rows=8000", name="eval",
                          run="named"))
    assert got["test/auc"] == named["test/auc"] != trained["test/auc"]  # the other rows were tested
    typo = onto_the_run(["src/eval.py", f"ckpt_path={ckpt}", "data.generator.n_rowz=8000"])[1:]
    _refused(_cfg(tmp_path, *typo, name="eval", run="typo"), r"^data\.generator: .*unexpected keyword argument .n_rowz.$",
             fn=evaluate)


def test_eval_tells_where_it_wrote(tmp_path, rsc15_run, caplog):
    with caplog.at_level(logging.INFO, logger="recforge"):
        evaluate(_cfg(tmp_path, f"ckpt_path={rsc15_run}", name="eval", run="eval"))
    written = tmp_path / "eval" / "metrics.json"
    assert written.exists()
    assert f"metrics: {written}" in [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("override,message", [
    ("evaluation.monitor=test/mrr@20",
     r"^callbacks\.model_checkpoint\.monitor=test/mrr@20 \(optimized_metric\): not a figure validation logs "
     r"while training; it logs val/recall@1, "),
    ("optimized_metric=val/mrr@21", r"^callbacks\.model_checkpoint\.monitor=val/mrr@21 \(optimized_metric\): "),
    ("callbacks.early_stopping.monitor=val/auc", r"^callbacks\.early_stopping\.monitor=val/auc: not a figure "),
])
def test_a_monitor_no_validation_logs_is_refused_at_start(tmp_path, override, message):
    # the default synthetic sessions have a validation split, so both callbacks follow the
    # monitor; Lightning alone stopped after the first epoch ("could not find the monitored key")
    _refused(_cfg(tmp_path, override), message)


# ---------------------------------------------------------------- what a run says
def test_optimized_metric_is_only_required_by_an_optimising_sweeper(tmp_path, caplog):
    _cfg(tmp_path)  # a plain run's Hydra config: the basic sweeper
    with caplog.at_level(logging.DEBUG):
        assert metric_value({"test/mrr@20": 0.5}, "val/mrr@20") is None
    assert not caplog.records
    _cfg(tmp_path, "hparams_search=gru4rec_optuna", run="search")
    with pytest.raises(UserInputError, match=r"optimized_metric=val/mrr@20 was not logged"):
        metric_value({"test/mrr@20": 0.5}, "val/mrr@20")


# ---------------------------------------------------------------- hardware the machine lacks
@pytest.mark.parametrize("hardware,visible,words", [
    ("gpu", 0, "hardware=gpu: trainer.accelerator=gpu, but torch sees no GPU on this machine; run on the CPU with hardware=cpu"),
    ("ddp", 0, "hardware=ddp: trainer.accelerator=gpu, but torch sees no GPU"),
    ("ddp", 1, None),  # devices: -1 takes what there is
    ("gpu", 1, None),
])
def test_a_gpu_run_on_a_machine_without_enough_gpus_is_refused_in_one_line(tmp_path, hardware, visible, words):
    from recforge.config_checks import check_hardware

    cfg = _cfg(tmp_path, f"hardware={hardware}")
    if words is None:
        check_hardware(cfg, {"hardware": hardware}, cuda_devices=visible)
        return
    with pytest.raises(UserInputError, match=words.replace("(", r"\(")) as error:
        check_hardware(cfg, {"hardware": hardware}, cuda_devices=visible)
    assert "\n" not in str(error.value)


def test_more_gpus_than_the_machine_has_are_refused_naming_the_count(tmp_path):
    from recforge.config_checks import check_hardware

    cfg = _cfg(tmp_path, "hardware=gpu", "trainer.devices=4")
    with pytest.raises(UserInputError, match=r"trainer.devices=4, but torch sees 2 GPUs here; set trainer.devices=2"):
        check_hardware(cfg, {"hardware": "gpu"}, cuda_devices=2)
    check_hardware(_cfg(tmp_path, "hardware=cpu"), {"hardware": "cpu"}, cuda_devices=0)  # a CPU run never asks


# ---------------------------------------------------------------- the command line itself
@pytest.mark.slow
def test_errors_are_one_line_on_the_command_line(tmp_path, files):
    cases = [
        ("python src/train.py loss=bprmax loss.bpreg=abc", "recforge: loss.bpreg=abc: expected a number >= 0"),
        (f"python src/train.py data=rsc15 data.train_path={files['single']} data.test_path={files['test']}",
         f"recforge: data.train_path={files['single']}: nothing to train on"),
        ("python src/eval.py", "recforge: ckpt_path is not set"),
        *([("python src/train.py -m launcher=submitit_slurm",
            "recforge: launcher=submitit_slurm submits every job to SLURM and runs only on a SLURM login node")]
          if shutil.which("srun") is None else []),
        *([("python src/train.py hardware=gpu", "recforge: hardware=gpu: trainer.accelerator=gpu, but torch sees no GPU")]
          if not torch.cuda.is_available() else []),
    ]
    # each command in a checkout of its own (run folders are named to the second), all at once:
    # most of each is the interpreter's start-up, which two cores overlap
    checkouts = [user_checkout(tmp_path / f"repo{i}", FILES_RUN) for i in range(len(cases))]
    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        runs = list(pool.map(lambda case, checkout: run_command(case[0], cwd=checkout), cases, checkouts))
    for (command, line), checkout, done in zip(cases, checkouts, runs, strict=True):
        assert done.returncode != 0, command
        assert done.stderr.strip().splitlines()[-1].startswith(line), done.stderr[-2000:]
        assert "Traceback" not in done.stderr, command
        # the one line is all: no config tree, no seed banner before it
        assert len((done.stdout + done.stderr).strip().splitlines()) == 1, done.stdout[-2000:] + done.stderr[-2000:]
        if " -m " not in command:  # the run directory it leaves says why it stopped
            (log,) = (checkout / "outputs").glob("*/runs/*/*.log")
            assert line in log.read_text(), (command, log)
        assert not list((checkout / "outputs").rglob("*.ckpt"))


@pytest.mark.slow
def test_readme_resume_line_continues_the_run_and_eval_reads_the_resumed_config(tmp_path, files):
    """The README's resume command as written (only <time> filled in), with none of the run's
    data overrides repeated; then eval.py on the resumed run finds the rsc15 data again."""
    from conftest import readme_commands

    checkout = user_checkout(tmp_path / "repo", FILES_RUN)
    first = run_command(
        f"python src/train.py data=rsc15 data.train_path={files['train']} data.test_path={files['test']} "
        "trainer.max_epochs=1", cwd=checkout,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    (run,) = (checkout / "outputs" / "train" / "runs").iterdir()
    resume_line = next(c for c in readme_commands() if c.startswith("python src/train.py ckpt_path="))
    resumed = run_command(resume_line.replace("<time>", run.name), cwd=checkout)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    second = next(p for p in (checkout / "outputs" / "train" / "runs").iterdir() if p != run)
    trained = (second / "metrics.json").read_text()
    assert '"epochs": 2' in trained  # the checkout's local profile trains 2 epochs
    eval_line = next(c for c in readme_commands() if c.startswith("python src/eval.py ckpt_path="))
    evaluated = run_command(eval_line.replace(run.name, second.name).replace("<time>", second.name), cwd=checkout)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    import json

    eval_dir = next((checkout / "outputs" / "eval" / "runs").iterdir())
    got = json.loads((eval_dir / "metrics.json").read_text())
    expected = json.loads(trained)
    test_ckpt = Path(expected["test_checkpoint"]).name
    assert got["test_checkpoint"].endswith("last.ckpt")
    if test_ckpt == "last.ckpt":
        assert got["test/recall@20"] == pytest.approx(expected["test/recall@20"], abs=1e-7)
    assert f"metrics: {eval_dir / 'metrics.json'}" in evaluated.stdout + evaluated.stderr


# ---------------------------------------------------------------- the data preparation commands
PREPARATION_ERRORS = [
    # module, raw file name, its text, the words the one line must hold after the file's path
    ("recforge.data.sessions.preprocess", "clicks.dat", "1,2014-04-01T08:00:00.000Z,abc,0\n",
     ", line 1, column 3 (ItemID): expected"),
    ("recforge.data.sequences.preprocess", "ratings.dat", "1::x::5::100\n",
     ", line 1, column 2 (MovieID): expected an integer movie id, got 'x'"),
    ("recforge.data.criteo.prepare", "train.txt", "", ": the file is empty (expected Criteo rows)"),
]


@pytest.mark.parametrize("module,name,text,words", PREPARATION_ERRORS)
def test_preparation_commands_end_a_user_error_in_one_line(tmp_path, module, name, text, words):
    import sys

    raw = tmp_path / name
    raw.write_text(text)
    dataset = {"sessions": ["rsc15"], "sequences": ["ml-1m"], "criteo": []}[module.split(".")[2]]
    done = run_child([sys.executable, "-m", module, *dataset, "--raw", str(raw), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"recforge: {raw}{words}"), done.stderr
    assert not (tmp_path / "out").exists()
