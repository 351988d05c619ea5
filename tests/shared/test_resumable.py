"""ResumesInsideEpoch: the state a checkpoint keeps, and which pass skips how many batches."""
from __future__ import annotations

from recforge.data.resumable import ResumesInsideEpoch


class Loader(ResumesInsideEpoch):
    def __init__(self, progress=None):
        self._progress = progress


def test_state_is_the_progress_at_save_time():
    assert Loader(lambda: (3, 17, 0)).state_dict() == {"epoch": 3, "batches": 17, "updates": 0}
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


class Group:
    """A batch of several updates, as GRU4Rec's grouped session steps are."""

    def __init__(self, updates: list[str]) -> None:
        self.updates = updates

    def after(self, k: int, then: "Group | None" = None) -> "Group":
        return Group(self.updates[k:] + (then.updates if then is not None else []))


def test_a_batch_a_step_limit_cut_short_resumes_with_its_other_updates():
    # a state saved after 2 whole batches and 3 updates of the third: Lightning counts 3 batches
    # trained, so the pass hands out one batch (the cut one's last update, then the fourth's) more
    batches = [Group([f"{b}{u}" for u in range(4)]) for b in "abcd"]
    loader = Loader()
    loader.load_state_dict({"epoch": 1, "batches": 2, "updates": 3})
    assert [g.updates for g in loader.skip_trained(iter(batches), epoch=1, n_batches=4)] == [
        ["c3", "d0", "d1", "d2", "d3"]]
    loader.load_state_dict({"epoch": 1, "batches": 0, "updates": 1})  # cut inside the first batch
    assert [g.updates[:4] for g in loader.skip_trained(iter(batches), epoch=1, n_batches=4)] == [
        ["a1", "a2", "a3", "b0"], ["c0", "c1", "c2", "c3"], ["d0", "d1", "d2", "d3"]]
    loader.load_state_dict({"epoch": 1, "batches": 3, "updates": 2})  # inside the last: nothing after it
    assert [g.updates for g in loader.skip_trained(iter(batches), epoch=1, n_batches=4)] == [["d2", "d3"]]
    loader.load_state_dict({"epoch": 1, "batches": 2})  # written before updates were kept
    assert [g.updates[0] for g in loader.skip_trained(iter(batches), epoch=1, n_batches=4)] == ["c0", "d0"]
