"""RecDataModule (data/base.py), the one resumable training loader, the DataModule contract and
the construction-time range check, on a minimal subclass and on the three families."""
from __future__ import annotations

import typing
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import CONF_DIR

from recforge.config_values import ConfigValueError, Range, checks_ranges
from recforge.contracts import DataModule, Task
from recforge.data.base import (
    GeneratedData,
    RecDataModule,
    item_map_identity,
    item_map_mismatch,
)
from recforge.data.resumable import ResumesInsideEpoch
from recforge.data.sessions.datamodule import SessionDataModule
from recforge.errors import UserInputError


class Letters(RecDataModule):
    """A data module of a fixed catalogue, its identity read from ``self.items`` (counted)."""

    batch_type = str

    def __init__(self, items, has_validation=True, known=True) -> None:
        super().__init__()
        self.items = list(items)
        self.has_validation = has_validation
        self.known = known
        self.identities = 0

    def task_inputs(self) -> dict:
        return {"n_items": len(self.items)}

    def train_dataloader(self):
        return self.resumable(self.items)

    def eval_dataloader(self, split):
        return [split]

    def identity(self) -> dict:
        self.identities += 1
        return item_map_identity(self.items)

    def identity_known(self) -> bool:
        return self.known

    def identity_mismatch(self, theirs, mine):
        return item_map_mismatch(theirs, mine, "alphabet", "data.items gives", "use the same letters")


# ---------------------------------------------------------------------------- the trainer's view
def test_rank_and_progress_without_a_trainer():
    dm = Letters("ab")
    assert dm.rank_and_world() == (0, 1) and dm.fit_progress() is None
    dm.trainer = SimpleNamespace(global_rank=2, world_size=3)
    assert dm.rank_and_world() == (2, 3)
    assert dm.fit_progress() is None  # a stand-in is not a fit


def test_validation_guard():
    assert Letters("ab").val_dataloader() == ["val"] and Letters("ab").test_dataloader() == ["test"]
    assert Letters("ab", has_validation=False).val_dataloader() == []


def test_the_three_families_and_a_task_declare_the_contracts(tmp_path):
    from recforge.data.criteo.datamodule import SyntheticCriteoDataModule
    from recforge.data.sequences.datamodule import SyntheticHistoryDataModule
    from recforge.data.sessions.datamodule import SyntheticSessionDataModule
    from recforge.tasks.base import RecTask

    modules = [
        SyntheticSessionDataModule(cache_dir=str(tmp_path), generator={"n_items": 30, "n_sessions": 200}),
        SyntheticHistoryDataModule(cache_dir=str(tmp_path), generator={"n_users": 40, "n_items": 30,
                                                                       "min_length": 5, "max_length": 10}),
        SyntheticCriteoDataModule(cache_dir=str(tmp_path), generator={"n_rows": 300}),
    ]
    for dm in modules:
        assert isinstance(dm, DataModule) and dm.has_validation
        # what it hands the task is what its task_inputs() declares, key for key
        declared = typing.get_type_hints(typing.get_type_hints(type(dm).task_inputs)["return"])
        assert list(dm.task_inputs()) == list(declared), type(dm).__name__
        assert dm.state_dict() == dm.identity()
    assert RecTask.min_batch_rows == 1 and "min_batch_rows" in Task.__annotations__


# ---------------------------------------------------------------------------- checkpoint identity
def test_identity_is_the_item_maps_size_and_digest():
    # the digest of "a\nb", from sha256sum: the ids joined by newlines in index order
    assert item_map_identity(["a", "b"]) == {
        "n_items": 2, "item_map_sha256": "7e18f737311b2dc3b2f269dd78396b0351f14fb66efa879f768cb23181883c78"}
    assert item_map_identity(np.array([1, 2]))["item_map_sha256"] != item_map_identity([2, 1])["item_map_sha256"]


def test_a_checkpoint_of_other_data_is_refused_in_one_line():
    state = Letters("abc").state_dict()
    Letters("abc").load_state_dict(state)  # the same data: fine
    with pytest.raises(UserInputError) as error:
        Letters("abd").load_state_dict(state)
    message = str(error.value)
    assert message.startswith("the checkpoint was trained on another alphabet (3 items, sha256 ")
    assert message.endswith("than data.items gives (3 items, sha256 " + item_map_identity("abd")["item_map_sha256"][:12]
                            + "): use the same letters") and "\n" not in message


def test_the_check_waits_for_the_data_when_its_identity_is_not_known_yet():
    state = Letters("abc").state_dict()
    dm = Letters("xyz", known=False)
    dm.load_state_dict(state)  # nothing read yet: nothing compared
    assert dm.identities == 0
    with pytest.raises(UserInputError, match="another alphabet"):
        dm.check_identity()  # the module calls it when it reads its data
    dm.check_identity()  # compared once: a later read does not compare again
    assert dm.identities == 1


def test_a_session_module_checks_its_item_map_once_when_it_reads_it(tmp_path):
    import pandas as pd

    from recforge.data.sessions.io import write_session_file

    path = tmp_path / "train.txt"
    write_session_file(pd.DataFrame([(1, "a", 1.0), (1, "b", 2.0)], columns=["SessionId", "ItemId", "Time"]), path)
    dm = SessionDataModule(str(path), None)
    dm.load_state_dict(item_map_identity(["a", "b"]))  # reads the training file to compare
    assert dm.catalog.n_items == 2
    with pytest.raises(UserInputError, match=r"^the checkpoint was trained on another item map \(2 items"):
        SessionDataModule(str(path), None).load_state_dict(item_map_identity(["b", "a"]))


# ---------------------------------------------------------------------------- the training loader
class Order:
    def __init__(self) -> None:
        self.epochs = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


def test_the_loader_orders_by_the_fits_epoch_and_skips_the_trained_batches_once():
    progress = [(4, 0, 0)]
    sampler = Order()
    loader = ResumesInsideEpoch(list(range(10)), lambda: progress[0], sampler)
    assert len(loader) == 10 and loader.sampler is sampler
    loader.load_state_dict({"epoch": 4, "batches": 6})
    passes = iter(loader)  # Lightning's iterability check: nothing starts, nothing is used up
    assert sampler.epochs == []
    del passes
    assert list(loader) == [6, 7, 8, 9] and sampler.epochs == [4]
    assert list(loader) == list(range(10)) and sampler.epochs == [4, 4]
    progress[0] = (5, 3, 0)
    assert loader.state_dict() == {"epoch": 5, "batches": 3, "updates": 0}
    assert list(loader) == list(range(10)) and sampler.epochs == [4, 4, 5]


def test_outside_a_fit_the_loader_neither_orders_nor_skips():
    sampler = Order()
    loader = Letters("abcd").train_dataloader()
    loader.sampler = sampler
    loader.load_state_dict({"epoch": 0, "batches": 2})
    assert list(loader) == list("abcd") and sampler.epochs == [] and loader.state_dict() == {}


# ---------------------------------------------------------------------------- construction checks
class Sized_:
    @checks_ranges("data")
    def __init__(self, size: typing.Annotated[int, Range(ge=1)], rate: typing.Annotated[float, Range(gt=0)] | None = None,
                 name: str = "x") -> None:
        self.size, self.rate, self.name = size, rate, name


def test_ranges_are_checked_on_a_direct_call_in_the_configs_words():
    assert Sized_(3, rate=None).size == 3 and Sized_(size=1, rate=0.5, name=7).name == 7  # only ranges
    for kwargs, message in (({"size": 0}, r"^data\.size=0: expected an integer >= 1$"),
                            ({"size": True}, r"^data\.size=true: expected an integer >= 1$"),
                            ({"size": 2, "rate": 0}, r"^data\.rate=0: expected a number > 0 or null$")):
        with pytest.raises(ConfigValueError, match=message):
            Sized_(**kwargs)


def test_the_families_check_their_ranges_on_a_direct_call(tmp_path):
    from recforge.data.criteo.datamodule import CriteoDataModule

    with pytest.raises(ConfigValueError, match=r"^data\.eval_batch_size=0: expected an integer >= 1$"):
        SessionDataModule("train.txt", None, eval_batch_size=0)
    with pytest.raises(ConfigValueError, match=r"^data\.shuffle_buffer=-1: expected an integer >= 0$"):
        CriteoDataModule(prepared_dir=str(tmp_path), shuffle_buffer=-1)


# ---------------------------------------------------------------------------- generated data
@dataclass(frozen=True)
class Recipe:
    n: int = 3

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")


class Made(RecDataModule):
    def __init__(self, path: str, batch_size: int = 1) -> None:
        super().__init__()
        self.path, self.batch_size = path, batch_size


class SyntheticMade(GeneratedData, Made):
    generator_config = Recipe
    describes = "letters"

    def generate(self, cache_dir: Path, kwargs):
        target = cache_dir / f"n{self.generator.n}"
        target.mkdir(parents=True, exist_ok=True)
        return target, {"path": str(target), **kwargs}


def test_generated_data_is_written_then_read_as_the_family_reads_it(tmp_path, caplog):
    caplog.set_level("INFO")
    dm = SyntheticMade(str(tmp_path), {"n": 2}, batch_size=4)
    assert dm.path == str(tmp_path / "n2") and dm.batch_size == 4 and dm.generator == Recipe(2)
    assert f"synthetic letters {{'n': 2}} in {tmp_path / 'n2'}" in caplog.text
    assert SyntheticMade(str(tmp_path), path="elsewhere").path == "elsewhere"  # a given path wins
    for generator, message in (({"n": 0}, r"^data\.generator: n must be >= 1, got 0$"),
                               ({"m": 1}, r"^data\.generator: .*'m'")):
        with pytest.raises(UserInputError, match=message):
            SyntheticMade(str(tmp_path), generator)


# ---------------------------------------------------------------------------- data -> task arguments
class WiderInputs(typing.TypedDict):
    n_items: int
    item_popularity: np.ndarray
    max_seq_len: int


class WiderSessions(SessionDataModule):
    """Session data that would hand its task an argument no session task takes."""

    def task_inputs(self) -> WiderInputs:
        raise AssertionError("never built: the config check refuses it first")


def test_data_handing_the_task_an_unknown_argument_is_refused_in_one_line(make_cfg):
    from recforge.config_checks import IncompatibleConfigError, check_combination

    cfg = make_cfg("model=gru4rec", f"data._target_={__name__}.WiderSessions")
    with pytest.raises(IncompatibleConfigError) as error:
        check_combination(cfg, CONF_DIR, {"model": "gru4rec"})
    message = str(error.value)
    assert message.startswith(f"model=gru4rec with data={__name__}.WiderSessions: the data hands the task "
                              "max_seq_len, which SessionNextItemTask does not take; data options for model=gru4rec: ")
    assert "synthetic" in message.split(": ")[-1] and "ml-1m" not in message and "\n" not in message
