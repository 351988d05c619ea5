"""ResumesInsideEpoch: the state a checkpoint keeps, and which pass skips how many batches."""
from __future__ import annotations

from recforge.data.resumable import ResumesInsideEpoch


class Loader(ResumesInsideEpoch):
    def __init__(self, progress=None):
        self._progress = progress


def test_state_is_the_progress_at_save_time():
    assert Loader(lambda: (3, 17)).state_dict() == {"epoch": 3, "batches": 17}
    assert Loader(lambda: None).state_dict() == {} and Loader().state_dict() == {}


def test_the_first_pass_of_the_saved_epoch_skips_its_trained_batches_once():
    loader = Loader()
    loader.load_state_dict({"epoch": 2, "batches": 3})
    assert list(loader.skip_trained(iter(range(10)), epoch=2, n_batches=10)) == list(range(3, 10))
    assert list(loader.skip_trained(iter(range(10)), epoch=2, n_batches=10)) == list(range(10))


def test_no_skip_for_another_epoch_a_finished_epoch_or_no_state():
    for state, epoch in (({"epoch": 2, "batches": 3}, 3), ({"epoch": 2, "batches": 10}, 2), ({}, 2),
                         ({"epoch": 2, "batches": 0}, 2)):
        loader = Loader()
        loader.load_state_dict(state)
        assert list(loader.skip_trained(iter(range(10)), epoch=epoch, n_batches=10)) == list(range(10)), state
