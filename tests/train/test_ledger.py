"""The data ledger across an epoch boundary: a micro-step may mix two epochs, and the same id
is due once in each."""

from __future__ import annotations

import itertools

from hpc.formats.checkpoint_layout import TrainState
from hpc.train.epochs import epoch_sequence

ROWS = list(range(10))


def test_a_restart_inside_a_straddling_step_repeats_and_drops_nothing():
    state = TrainState()
    seq = epoch_sequence(ROWS, seed=3, ledger=[], epoch=0, epochs=2)
    taken = []
    for _ in range(4):  # 12 samples in steps of 3: the fourth step holds epoch 0's last and epoch 1's first two
        step = list(itertools.islice(seq, 3))
        taken += step
        state.record(step, epoch_size=len(ROWS))
    assert {e for e, _ in taken[9:12]} == {0, 1}
    # Epoch 0 is complete and forgotten; epoch 1's two early samples are remembered as pairs.
    assert state.epoch == 1 and state.ledger == [list(p) for p in taken[10:12]] and state.samples_seen == 12

    rest = list(epoch_sequence(ROWS, seed=3, ledger=state.ledger, epoch=state.epoch, epochs=2))
    everything = taken + rest
    assert sorted(everything) == sorted((e, i) for e in (0, 1) for i in ROWS)  # each once per epoch


def test_without_an_epoch_size_the_ledger_keeps_every_pair():
    state = TrainState()
    state.record([(0, 4), (0, 5)])
    state.record([(0, 6), (1, 4)])
    assert state.epoch == 0 and state.ledger == [[0, 4], [0, 5], [0, 6], [1, 4]]
    rest = list(epoch_sequence([4, 5, 6], seed=0, ledger=state.ledger, epoch=0, epochs=2))
    assert sorted(rest) == [(1, 5), (1, 6)]


def test_a_sample_whose_capture_failed_closes_its_epoch_and_is_not_retried():
    """Before skip reports, the epoch waited for a pair that never came: the ledger grew all run."""
    state = TrainState()
    state.record([(0, 0), (0, 1), (0, 2)], epoch_size=4)
    state.record([(1, 7)], epoch_size=4, skipped=[(0, 3)])
    assert state.epoch == 1 and state.ledger == [[1, 7]]
    assert state.samples_seen == 4 and state.samples_skipped == 1
    # A restart inside epoch 0 would not ask for the failed sample again either.
    early = TrainState()
    early.record([(0, 0)], epoch_size=4, skipped=[(0, 3)])
    assert sorted(epoch_sequence([0, 1, 2, 3], seed=0, ledger=early.ledger, epoch=0, epochs=1)) == [(0, 1), (0, 2)]
