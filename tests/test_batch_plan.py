"""The global batch plan (draftsmith/batch_plan.py): a run cut into phases trains what one uninterrupted run would.

Pure and fast: no features, no model. The special cases the stream design rests on are asserted row for row
against :class:`BatchPlan`, the offline plan.
"""

from __future__ import annotations

import random

import pytest

from draftsmith.batch_plan import BatchPlan, StreamPlan, pack_rows, split_samples


def _data(n=160, seed=0):
    rng = random.Random(seed)
    lengths = [rng.randint(3, 40) for _ in range(n)]
    train, _ = split_samples(list(range(n)), 0.1, seed=5)
    return lengths, train


KW = dict(seed=7, world=2, grad_accum=2)


def _items(plan, first=0, last=None):
    last = plan.total_steps if last is None else last
    out = []
    for rank in range(plan.world):
        for step, key, r in plan.items(first, last, rank):
            out.append((step, rank, tuple(plan.rows(key)[r]), plan.anchor_seed(key, r)))
    return sorted(out)


@pytest.mark.parametrize("epochs", [1, 3, 2.5])
def test_one_slice_used_once_is_the_offline_plan(epochs):
    lengths, train = _data()
    offline = BatchPlan(lengths, train, 64, epochs=epochs, **KW)
    stream = StreamPlan(lengths, train, 64, epochs=epochs, slices=1, reuse=1, **KW)
    assert stream.total_steps == offline.total_steps
    assert _items(stream) == _items(offline)
    assert [(p.first_step, p.end_step) for p in stream.phases] == [
        (sum(offline.steps_per_epoch[:e]), sum(offline.steps_per_epoch[:e + 1]))
        for e in range(len(offline.steps_per_epoch))]


def test_slices_used_once_cut_the_offline_plan_into_step_ranges():
    lengths, train = _data()
    offline = BatchPlan(lengths, train, 64, epochs=3, **KW)
    stream = StreamPlan(lengths, train, 64, epochs=3, slices=4, reuse=1, **KW)
    assert _items(stream) == _items(offline)
    assert len(stream.phases) == 12
    assert [p.first_step for p in stream.phases[1:]] == [p.end_step for p in stream.phases[:-1]]
    for phase in stream.phases:
        used = {s for _, _, row, _ in _items(stream, phase.first_step, phase.end_step) for s, _ in row}
        assert used == set(phase.samples)  # the slice holds exactly what its steps read
    for x in range(3):  # the slices of an epoch are disjoint
        slices = [set(p.samples) for p in stream.phases if p.pass_index == x]
        assert sum(map(len, slices)) == len(set().union(*slices))


def test_one_slice_reused_every_epoch_is_the_offline_plan():
    lengths, train = _data()
    offline = BatchPlan(lengths, train, 64, epochs=3, **KW)
    stream = StreamPlan(lengths, train, 64, epochs=3, slices=1, reuse=3, **KW)
    assert len(stream.phases) == 1 and set(stream.phases[0].samples) <= set(train)
    assert stream.total_steps == offline.total_steps
    assert _items(stream) == _items(offline)


def test_reused_slices_partition_each_pass_and_stay_inside_their_slice():
    lengths, train = _data(n=300)
    stream = StreamPlan(lengths, train, 64, epochs=4, slices=3, reuse=2, **KW)
    assert len(stream.phases) == 6
    for x in range(2):
        slices = [set(p.samples) for p in stream.phases if p.pass_index == x]
        every = [s for sl in slices for s in sl]
        assert len(every) == len(set(every)) and set(every) <= set(train)  # disjoint slices of the training samples
        assert len(every) > 0.9 * len(train)
    for phase in stream.phases:
        used = {s for _, _, row, _ in _items(stream, phase.first_step, phase.end_step) for s, _ in row}
        assert used == set(phase.samples)
    # each slice is trained reuse times: its samples appear about twice in its phase
    phase = stream.phases[0]
    counts = {}
    for _, _, row, _ in _items(stream, phase.first_step, phase.end_step):
        for s, _ in row:
            counts[s] = counts.get(s, 0) + 1
    assert max(counts.values()) <= 2 and sum(c == 2 for c in counts.values()) > len(counts) // 2
    # anchor seeds of slice-local packings differ from slice to slice
    seeds = {stream.anchor_seed((1, k), 0) for k in range(3)}
    assert len(seeds) == 3


def test_the_plan_is_deterministic_and_max_steps_cuts_it():
    lengths, train = _data()
    a = StreamPlan(lengths, train, 64, epochs=2, slices=2, reuse=2, **KW)
    b = StreamPlan(lengths, train, 64, epochs=2, slices=2, reuse=2, **KW)
    assert _items(a) == _items(b) and a.phases == b.phases
    whole = StreamPlan(lengths, train, 64, epochs=2, slices=2, reuse=1, **KW)
    cut = StreamPlan(lengths, train, 64, epochs=2, slices=2, reuse=1, max_steps=whole.total_steps - 2, **KW)
    assert cut.total_steps == whole.total_steps - 2 and cut.phases[-1].end_step == cut.total_steps
    assert _items(cut) == _items(whole, 0, cut.total_steps)
    with pytest.raises(ValueError, match="no optimizer steps"):
        StreamPlan(lengths, train, 64, epochs=2, slices=2, reuse=1, max_steps=1, **KW)


def test_refusals_name_the_key():
    lengths, train = _data(n=40)
    with pytest.raises(ValueError, match="stream.reuse 2 must divide"):
        StreamPlan(lengths, train, 64, epochs=3, slices=1, reuse=2, **KW)
    with pytest.raises(ValueError, match="fewer than stream.slices"):
        StreamPlan(lengths, train, 64, epochs=1, slices=50, reuse=1, **KW)


def test_pack_rows_cuts_long_samples():
    assert pack_rows([5, 100, 3], [0, 1, 2], 10) == [[(0, 5)], [(1, 10)], [(2, 3)]]


def test_heldout_subset_is_a_seeded_ordered_choice():
    from draftsmith.batch_plan import heldout_subset

    held = list(range(100, 150))
    assert heldout_subset(held, None, 0) == held and heldout_subset(held, 80, 0) == held
    sub = heldout_subset(held, 10, 3)
    assert len(sub) == 10 and sub == sorted(sub) and set(sub) <= set(held)
    assert heldout_subset(held, 10, 3) == sub and heldout_subset(held, 10, 4) != sub


def test_max_stream_slices_is_the_largest_count_stream_plan_accepts():
    """max_stream_slices (what disk_plan and the disk refusals advise within) equals, with reuse 1, the largest
    stream.slices whose StreamPlan gives every phase a step under train.max_steps (tried one by one)."""
    from draftsmith.batch_plan import max_stream_slices, steps_per_pass

    lengths = [10 + (13 * i) % 70 for i in range(90)]
    train_ids = list(range(80))
    for epochs, max_steps in ((1, None), (1, 9), (2, 20), (2, 13), (1.5, 18), (3, 5)):
        passes = steps_per_pass(lengths, train_ids, 100, seed=1, world=1, grad_accum=1, epochs=epochs)
        accepted = []
        for slices in range(1, min(passes) + 2):
            try:
                StreamPlan(lengths, train_ids, 100, seed=1, world=1, grad_accum=1, epochs=epochs, max_steps=max_steps,
                           slices=slices)
            except ValueError:
                continue
            accepted.append(slices)
        want = max([s for s in accepted if s > 1], default=1)
        assert max_stream_slices(passes, max_steps=max_steps) == want, (epochs, max_steps, passes, accepted)
        assert [s for s in accepted if s > 1] == list(range(2, want + 1))  # every count up to it, none above
