"""The prefetch plan of lwo.torch: which record comes next.

Pure Python (no torch, no GPU), so that its logic is tested anywhere.

A *step* is one pass over the model: a training step (forward, then
backward, ended by the end of the backward pass) or a forward-only step
(inference, evaluation under torch.no_grad, or any forward whose outputs
need no gradient). Each kind of step has its plans: lists of record
accesses, one entry per streamed module call, in the order they happened
during a step of that kind. Before the first step, a training plan is the
modules' registration order followed by its reverse (forward, then
backward), and a forward-only plan is the registration order.

The adapter calls :meth:`Planner.observe` on every access, saying whether
the access will have a backward (it made an autograd node) and whether it
runs inside a backward pass. While the accesses follow the plan,
:meth:`upcoming` names the records to stage ahead; when an access departs
from it, the planner first looks among the plans it keeps (up to
``keep`` per kind, the most recent first) for one that begins as this step
did, and follows it; failing that it resynchronises on the record it saw
(its next occurrence in the plan). Either way the access counts as a
misprediction, and at the end of the step what really ran becomes the
first plan of its kind: a re-plan only when it is none of the plans kept.
So a model whose order alternates (a conditional branch, an evaluation
pass between training steps) re-plans once per pattern, not on every
switch. Predictions only decide what is prefetched: a wrong one costs a
stall, never a wrong result.

Where a step ends: a training step at the end of its backward pass; a
forward-only step when its first record comes again unexpected (the next
forward began), or when an access that will have a backward arrives and no
training plan begins as this step did (the training step began).
"""

TRAIN = "train"
FORWARD = "forward"


class Planner:
    """Plans of record ids per kind of step, and the position in the current
    one. `order` is the registration order of the records' accesses (one
    entry per streamed module, repeated for the modules of a group)."""

    def __init__(self, order, max_trace=1 << 20, keep=4):
        order = list(order)
        self.max_trace = int(max_trace)
        self.keep = max(1, int(keep))
        # per kind, the plans kept, most recent first; plans[kind] is the first
        self.candidates = {TRAIN: [order + order[::-1]], FORWARD: [list(order)]}
        self.kind = None           # the current step's kind (None: between steps)
        self.pos = 0               # index of the next expected entry of the plan
        self.trace = []            # the accesses of the current step
        self.deviated = False      # the current step departed from its plan
        self.steps = 0             # steps finished
        self.replans = 0           # steps whose order was none of the plans kept
        self.switches = 0          # steps that moved to another plan kept
        self.mispredictions = 0    # accesses the plan did not predict
        self.saw_backward = False  # the current step has had a backward access
        self.last_kind = None      # the kind of the step that ended last
        self._current = ()         # the plan of the current step (() between steps)
        self._upcoming = {}        # (id(plan), run start, limit, exclude) -> upcoming()
        self._run_starts = {}      # id(plan) -> (plan, the start of each entry's run)

    # ----------------------------------------------------------------
    @property
    def plans(self):
        """The most recent plan of each kind."""
        return {k: v[0] for k, v in self.candidates.items()}

    @property
    def plan(self):
        """The plan of the current step (or of a training step between steps)."""
        return self._current if self.kind is not None else self.candidates[TRAIN][0]

    def begin(self, kind):
        """Starts a step of `kind` (TRAIN or FORWARD)."""
        self.kind = kind
        self._current = self.candidates[kind][0]
        self.pos = 0
        self.trace = []
        self.deviated = False
        self.saw_backward = False

    def end(self):
        """Ends the current step (the end of a backward pass, or a forward-only
        step found to be over). A step with a backward pass is a training
        step, any other a forward-only one; what it ran becomes the first
        plan of its kind (a re-plan when it is none of the plans kept)."""
        if self.kind is None:
            return
        kind = TRAIN if self.saw_backward else FORWARD
        self.last_kind = kind
        trace = self.trace
        if trace:
            cands = self.candidates[kind]
            for i, c in enumerate(cands):
                if c == trace:
                    if i:
                        cands.insert(0, cands.pop(i))
                        self.switches += 1
                    break
            else:
                cands.insert(0, list(trace))
                del cands[self.keep:]
                self.replans += 1
        self.steps += 1
        self._between_steps()
        if len(self._upcoming) > 65536:
            self._upcoming = {}

    def _matching(self, kinds):
        """A plan kept for one of `kinds` that begins as the current step's
        trace does (and goes on past it), or None."""
        trace = self.trace
        n = len(trace)
        last = trace[-1]
        for kind in kinds:
            for c in self.candidates[kind]:
                if c is not self._current and len(c) > n - 1 and c[n - 1] == last \
                        and c[:n] == trace:
                    return kind, c
        return None

    def observe(self, record, grad_enabled=True, in_backward=False):
        """One access of `record`; returns True if the plan predicted it.
        grad_enabled: the access will have a backward (in a forward: it made
        an autograd node); in_backward: the access runs inside a backward
        pass (a module's backward, or a forward recomputed by activation
        checkpointing)."""
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
        elif self.kind == FORWARD and not in_backward and not self.saw_backward and \
                self.trace and (grad_enabled or (record == self.trace[0]
                                                 and not self.next_is(record))):
            # A forward-only step meets the start of another step: the
            # training step's first access, or its own first record again.
            self.trace.append(record)
            got = self._matching((TRAIN,)) if grad_enabled else None
            self.trace.pop()
            if got is None:
                self.end()
                self.begin(TRAIN if grad_enabled else FORWARD)
            else:  # a training step that began with accesses needing no gradient
                self.kind, self._current = got
        elif len(self.trace) >= self.max_trace:
            self.end()  # a step that never ends (no backward, no repeat): bound it
            self.begin(TRAIN if (grad_enabled or in_backward) else FORWARD)
        if in_backward:
            self.saw_backward = True
        self.trace.append(record)
        plan = self._current
        if self.pos < len(plan) and plan[self.pos] == record:
            self.pos += 1
            return True
        self.deviated = True
        self.mispredictions += 1
        got = self._matching((self.kind, TRAIN if self.kind == FORWARD else FORWARD))
        if got is not None:
            if got[0] == TRAIN or not self.saw_backward:
                self.kind, self._current = got
                self.pos = len(self.trace)
                return False
        j = _index(plan, record, self.pos)
        if j < 0:
            j = _index(plan, record, 0, self.pos)
        if j >= 0:
            self.pos = j + 1
        return False

    def save(self):
        """The planner's whole state (plans kept, the step in progress, the
        counts), for :meth:`restore`: what a CUDA graph capture observes is
        put aside this way (lwo.torch)."""
        return (self.kind, self.pos, list(self.trace), self.deviated, self.steps, self.replans,
                self.switches, self.mispredictions, self.saw_backward, self.last_kind,
                self._current, {k: list(v) for k, v in self.candidates.items()})

    def restore(self, state):
        """Puts back a state :meth:`save` returned."""
        (self.kind, self.pos, trace, self.deviated, self.steps, self.replans, self.switches,
         self.mispredictions, self.saw_backward, self.last_kind, self._current,
         cands) = state
        self.trace = list(trace)
        self.candidates = {k: list(v) for k, v in cands.items()}

    def remap(self, mapping):
        """The records were rebuilt: record r is now mapping[r]. Every plan
        kept is renamed (same accesses, same order); the current step, if
        any, is dropped (the caller starts a new one)."""
        for kind, cands in self.candidates.items():
            self.candidates[kind] = [[mapping[r] for r in c] for c in cands]
        self._between_steps()
        self._upcoming = {}
        self._run_starts = {}

    def _between_steps(self):
        self.kind = None
        self._current = ()
        self.pos = 0
        self.trace = []
        self.deviated = False
        self.saw_backward = False

    # ----------------------------------------------------------------
    def next_is(self, record):
        """True if the plan's next access (in this step) is `record` again."""
        # self.plan written out: a streamed module's forward asks this once
        # per access, and the property would be one more call each time
        plan = self._current if self.kind is not None else self.candidates[TRAIN][0]
        return self.pos < len(plan) and plan[self.pos] == record

    def upcoming(self, limit, exclude=None):
        """The next distinct records of the plan after the current position
        (at most `limit`, none equal to `exclude`), as (record, next_step)
        pairs: next_step is True for records past the end of this step's plan,
        which belong to the next step of the same kind."""
        plan = self.plan
        # Every position inside one run of equal entries has the same answer:
        # keyed by the run's start, a step of 32 accesses to one record
        # computes it once.
        pos = self.pos
        starts = self._run_starts.get(id(plan))
        if starts is None or starts[0] is not plan:
            starts = (plan, _run_starts(plan))
            if len(self._run_starts) > 64:
                self._run_starts = {}
            self._run_starts[id(plan)] = starts
        key = (id(plan), starts[1][pos] if pos < len(plan) else pos, limit, exclude)
        got = self._upcoming.get(key)
        if got is not None and got[0] is plan:
            return got[1]
        out = []
        seen = set()
        if exclude is not None:
            seen.add(exclude)
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
        self._upcoming[key] = (plan, out)
        return out

    def stats(self):
        return {"steps": self.steps, "replans": self.replans, "switches": self.switches,
                "mispredictions": self.mispredictions,
                "plan_length": {k: len(v[0]) for k, v in self.candidates.items()},
                "plans_kept": {k: len(v) for k, v in self.candidates.items()}}


def _run_starts(plan):
    """For each entry of `plan`, the index where its run of equal entries
    begins."""
    out = [0] * len(plan)
    start = 0
    for i in range(1, len(plan)):
        if plan[i] != plan[i - 1]:
            start = i
        out[i] = start
    return out


def _index(seq, value, start, stop=None):
    try:
        return seq.index(value, start, len(seq) if stop is None else stop)
    except ValueError:
        return -1
