"""What a run tells the user, as printed by the command line: the config tree and the run directory
at start, no known library noise, a project --help, and the README's examples of errors verbatim."""
from __future__ import annotations

import os
import platform
import re
from pathlib import Path

import pytest

from conftest import TINY_RUN, run_command, user_checkout
from recforge.utils.allocator import USER_VARIABLES

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# Known and harmless (recforge/utils/quiet.py) or fixed at the source; none may reach a user.
NOISE = [
    "litlogger", "litmodels", "LeafSpec", "transfer_batch_to_device", "across ranks is zero",
    "was not logged", "Traceback",
]


def _noise(output: str) -> list[str]:
    return [n for n in NOISE if n in output]


def test_default_run_prints_its_config_and_directory_before_training(tmp_path: Path):
    checkout = user_checkout(tmp_path / "repo")
    done = run_command("python src/train.py", cwd=checkout)
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (checkout / "outputs" / "train" / "runs").iterdir()
    out = done.stdout
    tree = (run_dir / "config_tree.log").read_text()
    # once its inputs are read and checked (a refused run prints its one line, no tree), before training
    assert tree.startswith("CONFIG\n") and tree in out
    assert out.index(tree) > out.index("test: ") and "Trainer.fit" not in out[: out.index(tree)]
    for section in ("data", "model", "task", "loss", "optimizer", "evaluation", "trainer"):
        assert re.search(rf"^[├└]── {section}$", tree, flags=re.M), section
    assert "hidden_size: 100" in tree
    everything = out + done.stderr
    said = everything.index(f"training; run directory: {run_dir}")
    assert said < everything.index("Trainer.fit")  # at start, not only in the last line
    if platform.libc_ver()[0] == "glibc" and not set(USER_VARIABLES) & set(os.environ):
        # extras.malloc=keep by default, said once, with how to turn it off
        assert everything.count("malloc: freed memory kept for reuse") == 1
        # the thread count, said once (the tests pin it through OMP_NUM_THREADS)
        assert everything.count(f"threads: {os.environ['OMP_NUM_THREADS']} (OMP_NUM_THREADS") == 1
        assert everything.index("malloc: freed memory kept for reuse") < said
    assert not _noise(everything), _noise(everything)
    assert (run_dir / "metrics.json").exists()


def test_run_without_validation_ends_quietly(tmp_path: Path):
    checkout = user_checkout(tmp_path / "repo", [o for o in TINY_RUN if not o.startswith("data.generator.")])
    lines = ["SessionId\tItemId\tTime"] + [f"{s}\t{(s * 7 + k) % 30}\t{100 * s + k}" for s in range(400) for k in range(3)]
    (checkout / "s.txt").write_text("\n".join(lines) + "\n")
    done = run_command("python src/train.py data=rsc15 data.train_path=s.txt data.test_path=s.txt", cwd=checkout)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not _noise(done.stdout + done.stderr), _noise(done.stdout + done.stderr)
    assert "no validation split: early stopping is off" in done.stdout + done.stderr


def test_help_has_a_project_header(tmp_path: Path):
    done = run_command("python src/train.py --help", cwd=REPO)
    assert done.returncode == 0
    assert done.stdout.startswith("recforge: train, sweep and compare")
    for text in ("python src/eval.py ckpt_path=", "== Config groups (group=option) ==",
                 "model: dlrm, gru4rec, hstu, sasrec", "loss: bce, bpr, bprmax", "HYDRA_FULL_ERROR=1"):
        assert text in done.stdout, text


def _readme_error_examples() -> list[tuple[str, str]]:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## When something is wrong"):]
    block = re.search(r"```\n(.*?)```", section, flags=re.S).group(1).splitlines()
    return [(block[i][2:], block[i + 1]) for i in range(0, len(block), 2)]


def test_readme_error_examples_are_what_the_program_says(tmp_path: Path):
    examples = _readme_error_examples()
    assert len(examples) >= 2
    checkout = user_checkout(tmp_path / "repo")
    for command, shown in examples:
        done = run_command(command, cwd=checkout)
        assert done.returncode != 0, command
        assert done.stderr.strip().splitlines()[-1] == shown, command
        assert not list((checkout / "outputs").rglob("*.ckpt")), "refused only after training"
