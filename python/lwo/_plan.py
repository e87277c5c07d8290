"""The prefetch plan of lwo.torch: which record comes next.

Pure Python (no torch, no GPU), so that its logic is tested anywhere.

A *step* is one pass over the model: a training step (forward, then
backward, ended by the end of the backward pass) or a forward-only step
(inference, evaluation under torch.no_grad). Each kind of step has its own
plan: the list of record accesses, one entry per streamed module call, in
the order they happened during the last step of that kind that the plan
did not predict. Before the first step, a training plan is the modules'
registration order followed by its reverse (forward, then backward), and a
forward-only plan is the registration order.

The adapter calls :meth:`Planner.observe` on every access. While the
accesses follow the plan, :meth:`upcoming` names the records to stage
ahead; when an access departs from it, the planner resynchronises on the
record it saw (its next occurrence in the plan), counts a misprediction,
and at the end of that step replaces the plan with what really ran.
Predictions only decide what is prefetched: a wrong one costs a stall,
never a wrong result.
"""

TRAIN = "train"
FORWARD = "forward"


class Planner:
    """Plans of record ids per kind of step, and the position in the current
    one. `order` is the registration order of the records' accesses (one
    entry per streamed module, repeated for the modules of a group)."""

    def __init__(self, order, max_trace=1 << 20):
        order = list(order)
        self.max_trace = int(max_trace)
        self.plans = {TRAIN: order + order[::-1], FORWARD: list(order)}
        self.kind = None           # the current step's kind (None: between steps)
        self.pos = 0               # index of the next expected entry of the plan
        self.trace = []            # the accesses of the current step
        self.deviated = False      # the current step departed from its plan
        self.steps = 0             # steps finished
        self.replans = 0           # plans replaced by what ran
        self.mispredictions = 0    # accesses the plan did not predict
        self.saw_backward = False  # the current step has had a backward access
        self._current = ()         # the plan of the current step (() between steps)
        self._upcoming = {}        # (kind, pos, limit, exclude) -> upcoming()

    # ----------------------------------------------------------------
    @property
    def plan(self):
        """The plan of the current step (or of a training step between steps)."""
        return self.plans[self.kind or TRAIN]

    def begin(self, kind):
        """Starts a step of `kind` (TRAIN or FORWARD)."""
        self.kind = kind
        self._current = self.plans[kind]
        self.pos = 0
        self.trace = []
        self.deviated = False
        self.saw_backward = False

    def end(self):
        """Ends the current step (the end of a backward pass, or a forward-only
        step found to be over). A step with a backward pass is a training
        step, any other a forward-only one; one that departed from the plan
        it followed, or ran only part of it, becomes the plan of its kind."""
        if self.kind is None:
            return
        kind = TRAIN if self.saw_backward else FORWARD
        if self.trace:
            if kind != self.kind:
                if self.trace != self.plans[kind]:
                    self.plans[kind] = list(self.trace)
                    self.replans += 1
                    self._upcoming = {}
            elif self.deviated or self.pos != len(self.plans[kind]):
                self.plans[kind] = list(self.trace)
                self.replans += 1
                self._upcoming = {}
        self.steps += 1
        self.kind = None
        self._current = ()
        self.pos = 0
        self.trace = []
        self.deviated = False
        self.saw_backward = False

    def observe(self, record, grad_enabled=True, in_backward=False):
        """One access of `record`; returns True if the plan predicted it.
        grad_enabled: torch.is_grad_enabled() in a forward; in_backward: the
        access runs inside a backward pass (a module's backward, or a forward
        recomputed by activation checkpointing)."""
        # The common case first: the plan's next entry, in a running step.
        plan = self._current
        pos = self.pos
        if (pos < len(plan) and plan[pos] == record and self.kind is not None
                and len(self.trace) < self.max_trace):
            if in_backward:
                self.saw_backward = True
            self.trace.append(record)
            self.pos = pos + 1
            return True
        if self.kind is None:
            self.begin(TRAIN if (grad_enabled or in_backward) else FORWARD)
        elif (not in_backward and not self.saw_backward and self.trace
              and record == self.trace[0] and not self.next_is(record)):
            # The step's first record again, unexpected, and no backward pass
            # since the step began: that step was forward-only and is over.
            self.end()
            self.begin(TRAIN if grad_enabled else FORWARD)
        elif len(self.trace) >= self.max_trace:
            self.end()  # a step that never ends (no backward, no repeat): bound it
            self.begin(TRAIN if (grad_enabled or in_backward) else FORWARD)
        if in_backward:
            self.saw_backward = True
        self.trace.append(record)
        plan = self.plans[self.kind]
        if self.pos < len(plan) and plan[self.pos] == record:
            self.pos += 1
            return True
        self.deviated = True
        self.mispredictions += 1
        j = _index(plan, record, self.pos)
        if j < 0:
            j = _index(plan, record, 0, self.pos)
        if j >= 0:
            self.pos = j + 1
        return False

    # ----------------------------------------------------------------
    def next_is(self, record):
        """True if the plan's next access (in this step) is `record` again."""
        plan = self.plan
        return self.pos < len(plan) and plan[self.pos] == record

    def upcoming(self, limit, exclude=None):
        """The next distinct records of the plan after the current position
        (at most `limit`, none equal to `exclude`), as (record, next_step)
        pairs: next_step is True for records past the end of this step's plan,
        which belong to the next step of the same kind."""
        key = (self.kind, self.pos, limit, exclude)
        got = self._upcoming.get(key)
        if got is not None:
            return got
        out = []
        seen = set()
        if exclude is not None:
            seen.add(exclude)
        plan = self.plan
        n = len(plan)
        if n == 0 or limit <= 0:
            return out
        i = self.pos
        for k in range(n):
            idx = i + k
            wrapped = idx >= n
            r = plan[idx % n] if wrapped else plan[idx]
            if r in seen:
                continue
            seen.add(r)
            out.append((r, wrapped))
            if len(out) >= limit:
                break
        if len(self._upcoming) > 65536:
            self._upcoming = {}
        self._upcoming[key] = out
        return out

    def stats(self):
        return {"steps": self.steps, "replans": self.replans,
                "mispredictions": self.mispredictions,
                "plan_length": {k: len(v) for k, v in self.plans.items()}}


def _index(seq, value, start, stop=None):
    try:
        return seq.index(value, start, len(seq) if stop is None else stop)
    except ValueError:
        return -1
