"""lwo.torch's prefetch planner (lwo._plan): pure Python, no torch, no GPU."""

from lwo._plan import FORWARD, TRAIN, Planner


def run_step(p, forward, backward=(), grad=True):
    hits = []
    for r in forward:
        hits.append(p.observe(r, grad_enabled=grad, in_backward=False))
    for r in backward:
        hits.append(p.observe(r, grad_enabled=True, in_backward=True))
    if backward:
        p.end()
    return hits


def test_initial_plans_follow_registration_order():
    p = Planner([0, 1, 2])
    assert p.plans[TRAIN] == [0, 1, 2, 2, 1, 0]
    assert p.plans[FORWARD] == [0, 1, 2]
    assert p.upcoming(2) == [(0, False), (1, False)]


def test_a_predicted_training_step_keeps_its_plan():
    p = Planner([0, 1, 2])
    hits = run_step(p, [0, 1, 2], [2, 1, 0])
    assert all(hits)
    assert p.replans == 0 and p.mispredictions == 0 and p.steps == 1


def test_upcoming_and_next_is_within_a_step():
    p = Planner([0, 1, 2])
    p.observe(0)
    assert p.upcoming(2) == [(1, False), (2, False)]
    assert p.upcoming(2, exclude=1) == [(2, False), (0, False)]
    p.observe(1)
    p.observe(2)
    assert p.next_is(2)  # the backward of the last layer comes next
    assert p.upcoming(3, exclude=2) == [(1, False), (0, False)]
    p.observe(2, in_backward=True)
    p.observe(1, in_backward=True)
    p.observe(0, in_backward=True)
    # past the end: the next step's records, marked as such
    assert p.upcoming(2, exclude=0) == [(1, True), (2, True)]
    assert not p.next_is(0)


def test_a_changed_order_is_replanned_after_one_step():
    p = Planner([0, 1, 2])
    hits = run_step(p, [2, 0, 1], [1, 0, 2])
    assert not all(hits)
    assert p.replans == 1
    assert p.plans[TRAIN] == [2, 0, 1, 1, 0, 2]
    hits = run_step(p, [2, 0, 1], [1, 0, 2])
    assert all(hits)
    assert p.replans == 1


def test_recomputation_in_backward_becomes_part_of_the_plan():
    # activation checkpointing: each block's forward runs again in backward
    p = Planner([0, 1])
    fwd, bwd = [0, 1], [1, 1, 0, 0]  # recompute 1, backward 1, recompute 0, backward 0
    run_step(p, fwd, bwd)
    assert p.plans[TRAIN] == [0, 1, 1, 1, 0, 0]
    assert all(run_step(p, fwd, bwd))


def test_forward_only_steps_find_their_end_by_the_first_record():
    p = Planner([0, 1, 2])
    for _ in range(3):
        assert all(run_step(p, [0, 1, 2], grad=False))
    assert p.kind == FORWARD
    assert p.upcoming(1) == [(0, True)]
    p.observe(0, grad_enabled=False)
    assert p.steps == 3 and p.replans == 0


def test_forward_only_and_training_steps_have_their_own_plans():
    p = Planner([0, 1])
    run_step(p, [0, 1], [1, 0])
    run_step(p, [0, 1], grad=False)       # an evaluation step
    run_step(p, [0, 1], [1, 0])           # training again: predicted
    assert p.mispredictions == 0
    assert p.plans[TRAIN] == [0, 1, 1, 0] and p.plans[FORWARD] == [0, 1]


def test_a_group_record_repeats_and_next_is_says_so():
    # one record (0) for three modules, then record 1
    p = Planner([0, 0, 0, 1])
    p.observe(0)
    assert p.next_is(0)
    assert p.upcoming(2, exclude=0) == [(1, False)]
    p.observe(0)
    p.observe(0)
    assert not p.next_is(0)


def test_an_unknown_record_is_a_misprediction_not_an_error():
    p = Planner([0, 1])
    assert not p.observe(7)
    assert p.mispredictions == 1
    assert p.observe(0) is False or True  # resynchronises on known records


def test_a_step_without_end_is_bounded():
    p = Planner([0], max_trace=10)
    for _ in range(25):
        p.observe(5)  # never the plan's, never a backward
    assert len(p.trace) <= 10
    assert p.steps >= 2


def test_a_block_called_twice_in_one_forward_keeps_the_step_whole():
    # records 0, 1 run twice in one training forward (a shared block), then
    # backward through both calls: one step, planned once
    p = Planner([0, 1])
    fwd, bwd = [0, 1, 0, 1], [1, 0, 1, 0]
    run_step(p, fwd, bwd)
    assert p.steps == 1 and p.replans == 1
    assert p.plans[TRAIN] == fwd + bwd
    for _ in range(3):
        assert all(run_step(p, fwd, bwd))
    assert p.steps == 4 and p.replans == 1


def test_alternating_orders_replan_once_per_pattern():
    # a conditional branch: odd steps skip record 1
    p = Planner([0, 1, 2])
    a = ([0, 1, 2], [2, 1, 0])
    b = ([0, 2], [2, 0])
    for i in range(8):
        run_step(p, *(a if i % 2 == 0 else b))
    assert p.replans == 1  # b; a was the initial plan
    assert p.steps == 8
    before = p.mispredictions
    run_step(p, *a)
    run_step(p, *b)
    assert p.mispredictions - before <= 2  # one access per switch of pattern


def test_a_no_grad_pass_between_training_steps_does_not_replan_each_time():
    # evaluation skips record 0 (a different first record) and needs no gradient
    p = Planner([0, 1, 2])
    for _ in range(4):
        run_step(p, [0, 1, 2], [2, 1, 0])
        run_step(p, [1, 2], grad=False)
    assert p.replans == 1  # the evaluation's plan, once
    assert p.plans[TRAIN] == [0, 1, 2, 2, 1, 0]
    assert p.plans[FORWARD] == [1, 2]
    p.observe(0)  # the training step ends the evaluation step
    assert p.steps == 8 and p.kind == TRAIN


def test_a_training_step_that_begins_without_gradients_follows_its_plan():
    # reentrant checkpointing: the forward's accesses need no gradient, the
    # backward recomputes them
    p = Planner([0, 1])
    fwd, bwd = [0, 1], [1, 1, 0, 0]
    for _ in range(3):
        run_step(p, fwd, bwd, grad=False)
    before = p.mispredictions
    hits = run_step(p, fwd, bwd, grad=False)
    # the forward follows the forward-only plan until the backward shows it
    # was a training step: one access mispredicted, then the training plan
    assert hits[:2] == [True, True] and hits[3:] == [True, True, True]
    assert p.mispredictions - before == 1 and p.replans == 1


def _upcoming_by_scan(plan, pos, limit, exclude=None):
    """upcoming() computed afresh: the reference for its cache."""
    out, seen = [], set() if exclude is None else {exclude}
    for k in range(len(plan)):
        idx = pos + k
        r = plan[idx % len(plan)]
        if r not in seen:
            seen.add(r)
            out.append((r, idx >= len(plan)))
            if len(out) >= limit:
                break
    return out


def test_upcoming_is_the_same_at_every_position_of_a_run():
    # records of several accesses in a row (one record holds several
    # modules), in forward and in backward; the cache is keyed by the run
    order = [0, 0, 0, 1, 1, 2, 3, 3, 3, 3]
    p = Planner(order)
    plan = p.plans[TRAIN]
    for pos, r in enumerate(plan):
        for limit in (1, 2, 3, 5):
            for exclude in (None, r, (r + 1) % 4):
                assert p.upcoming(limit, exclude=exclude) == \
                    _upcoming_by_scan(plan, pos, limit, exclude), (pos, limit, exclude)
        p.observe(r, in_backward=pos >= len(order))
    p.end()
    assert p.steps == 1 and p.mispredictions == 0
    # past the end of the step: the next step's records
    assert p.upcoming(2) == _upcoming_by_scan(p.plans[TRAIN], 0, 2)


def test_save_and_restore_put_every_plan_and_the_step_back():
    p = Planner([0, 1, 2])
    run_step(p, [0, 1, 2], [2, 1, 0])
    p.observe(0, grad_enabled=False)  # a forward-only step under way
    state = p.save()
    before = (p.plans, p.stats(), p.kind, p.pos, list(p.trace), p.upcoming(2))
    run_step(p, [2, 0], [0, 2])  # other orders, a step ended
    run_step(p, [1], grad=False)
    assert p.stats() != before[1]
    p.restore(state)
    assert (p.plans, p.stats(), p.kind, p.pos, list(p.trace), p.upcoming(2)) == before
    p.restore(state)  # a state restores more than once
    assert p.observe(1, grad_enabled=False) and p.observe(2, grad_enabled=False)
    assert p.mispredictions == before[1]["mispredictions"]
