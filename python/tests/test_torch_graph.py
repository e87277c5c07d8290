"""lwo.torch and CUDA graph captures (torch.cuda.graph) without a GPU: the
plumbing of a capture that torch begins around a streamed model, on the
host backend (host_lwo). The host backend records no graphs, so stand-ins
play what a GPU would, with the capture state lwo.torch reads
(lt._capturing, lt._capture_stream) set while they capture. Each test that
captures runs on both of lwo.torch's ways of learning of a capture (the
`path` fixture):

- "hooks": FakeGraph plays torch.cuda.CUDAGraph of torch 2.14 on (torch's
  global capture start and end hooks, the graph's capture_end_pre, replay
  start hooks and destroy callbacks): torch's own hook registries where the
  installed torch has them, stand-ins of them where it has not;
- "wrappers": the hooks are taken away and OldGraph plays CUDAGraph of torch
  2.10 to 2.13 (capture_begin, capture_end, replay, reset and nothing more),
  which lwo.torch wraps at offload().

CaptureRing plays the library's lwo_ring_capture_join / _leave / _replay /
_release over the real ring (each call logged, with the library's refusals: a
live ticket at a join or a leave, stages, acquires and releases while a graph
holds the ring, an announcement with no graph held). Stages, acquires,
releases, gradients and the compute are the real library's on the host
backend, eager, so a "captured" pass computes its output (and a captured
training step its gradients; a replay computes nothing). The real captures
and replays run in test_torch_gpu.py. Skipped without torch."""

import collections
import contextlib
import copy
import gc
import types
import weakref

import pytest

try:
    import torch
except ImportError as e:  # not installed, or not importable here
    pytest.skip("torch is not importable: %s" % e, allow_module_level=True)
nn = torch.nn

import lwo  # noqa: E402
import lwo.torch as lt  # noqa: E402
from lwo import _capi as C  # noqa: E402
from lwo import _core  # noqa: E402

import host_lwo  # noqa: E402

from torch.utils.hooks import RemovableHandle  # noqa: E402

torch.manual_seed(0)
graphs = torch.cuda.graphs
TORCH_HOOKS = hasattr(graphs, "register_graph_capture_start_hook")  # torch 2.14 on

CAPTURE_STREAM = 0x10


class FakeGraph:
    """torch.cuda.CUDAGraph of torch 2.14 on, as lwo.torch uses it."""

    def __init__(self, state):
        self.state = state
        self.replay_hooks = collections.OrderedDict()
        self.callbacks = []
        self.replays = 0
        weakref.finalize(self, FakeGraph._fire, self.callbacks)

    @staticmethod
    def _fire(callbacks):  # torch's destroy callbacks (never holding the graph)
        for cb in list(callbacks):
            cb()
        callbacks.clear()

    def capture_begin(self):
        self.state.active = True
        self.state.log.append("torch begin")
        # torch runs its global start hooks with the capture live (it swallows
        # their errors; these calls let them show)
        for hook in list(self.state.start_hooks.values()):
            hook(self)

    def capture_end_pre(self):
        self.state.log.append("torch end")
        self.state.active = False
        if self.state.fail_end:
            raise RuntimeError("cudaStreamEndCapture failed (stand-in)")

    def capture_end(self):
        self.capture_end_pre()
        for hook in list(self.state.end_hooks.values()):
            hook(self)

    def register_replay_start_hook(self, hook):
        h = RemovableHandle(self.replay_hooks)
        self.replay_hooks[h.id] = hook
        return h

    def register_destroy_callback(self, cb):
        self.callbacks.append(cb)

    def replay(self):
        for hook in list(self.replay_hooks.values()):
            hook(self)
        self.replays += 1

    def reset(self):
        FakeGraph._fire(self.callbacks)


class OldGraph:
    """torch.cuda.CUDAGraph of torch 2.10 to 2.13: Python capture_begin,
    capture_end, replay and reset over the C++ graph's, no hooks (lwo.torch
    wraps these four)."""

    def __init__(self, state):
        self.state = state
        self.replays = 0

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.state.active = True
        self.state.log.append("torch begin")

    def capture_end(self):
        self.state.log.append("torch end")
        self.state.active = False
        if self.state.fail_end:
            raise RuntimeError("cudaStreamEndCapture failed (stand-in)")

    def replay(self):
        self.replays += 1

    def reset(self):
        pass


@contextlib.contextmanager
def capture(g):
    """torch.cuda.graph(g): the capture ends however the block ends."""
    g.capture_begin()
    try:
        yield g
    finally:
        g.capture_end()


class CaptureRing(host_lwo.Ring):
    """host_lwo.Ring with the library's joined-capture calls stood in."""

    def __init__(self, obj, depth, resident, state):
        super().__init__(obj, depth, resident)
        self.state = state
        self.mode = None  # "joined", then "held" until the release

    def _busy(self, call):
        if self.mode == "held":
            raise lwo.StateError(C.LWO_ERR_BUSY, "%s: the ring belongs to a CUDA graph the "
                                 "caller captured (stand-in)" % call)

    def stage(self, layer):
        self._busy("lwo_ring_stage")
        return super().stage(layer)

    def acquire(self, ticket, stream):
        self._busy("lwo_ring_acquire")
        return super().acquire(ticket, stream)

    def release(self, ticket, stream):
        self._busy("lwo_ring_release")
        super().release(ticket, stream)

    def capture_join(self, stream):
        if not self.state.active:
            raise lwo.StateError(C.LWO_ERR_CAPTURING, "lwo_ring_capture_join: not capturing")
        if self.mode is not None:
            raise lwo.StateError(C.LWO_ERR_BUSY, "lwo_ring_capture_join: ring %s" % self.mode)
        if self._layer:  # the library: every ticket released before a capture
            raise lwo.StateError(C.LWO_ERR_BUSY, "lwo_ring_capture_join: live tickets of "
                                 "layers %s" % sorted(self._layer.values()))
        self.mode = "joined"
        self.log.append(("join", stream))
        self.state.log.append("join")

    def capture_leave(self, stream):
        if self.mode != "joined":
            raise lwo.StateError(C.LWO_ERR_CAPTURING, "lwo_ring_capture_leave: in no capture")
        if not self.state.active:
            self.mode = None
            raise lwo.StateError(C.LWO_ERR_CAPTURING, "lwo_ring_capture_leave: the capture "
                                 "ended first; dropped")
        if self._layer:
            raise lwo.StateError(C.LWO_ERR_TICKET_STATE, "lwo_ring_capture_leave: live "
                                 "tickets of layers %s" % sorted(self._layer.values()))
        self.mode = "held"
        self.log.append(("leave", stream))
        self.state.log.append("leave")

    def capture_replay(self, stream):
        if self.mode != "held":
            raise lwo.StateError(C.LWO_ERR_CAPTURING, "lwo_ring_capture_replay: the ring "
                                 "belongs to no CUDA graph the caller captured (stand-in)")
        if self.refuse_replay is not None:  # the library's check of the gradient sums
            raise lwo.StateError(C.LWO_ERR_TICKET_STATE, self.refuse_replay)
        self.log.append(("replay", stream))
        self.state.log.append("replay")

    refuse_replay = None

    def capture_release(self, stream):
        if self.mode != "held":
            raise lwo.StateError(C.LWO_ERR_CAPTURING, "lwo_ring_capture_release: not held")
        if self.state.active and stream == self.state.stream:
            raise lwo.StateError(C.LWO_ERR_CAPTURING, "lwo_ring_capture_release: stream "
                                 "0x%x is capturing" % stream)
        self.mode = None
        self.log.append(("release_graph", stream))
        self.state.log.append("release")


class CaptureBackend(host_lwo.Backend):
    """host_lwo.Backend whose rings are CaptureRings and whose current stream
    is the state's."""

    capture_guard = True  # a step start asks lt._capturing, as on a GPU

    def __init__(self, state, warm=True, fake_ring=True):
        super().__init__()
        self.state = state
        self.warm = warm
        self.fake_ring = fake_ring
        self.ordered = []

    def current_stream(self, device_index):
        return self.state.stream

    def ring(self, pool, depth, timing, resident=()):
        if not self.fake_ring:
            return super().ring(pool, depth, timing, resident)
        r = CaptureRing(_core.Ring(pool, depth=depth, timing=timing, resident=resident), depth,
                        resident, self.state)
        self.rings.append(r)
        return r

    def stream_warm(self, raw):
        return self.warm

    def order_streams(self, last, others):
        self.ordered.append((last, list(others)))

    def layer_changed(self, pool, layer):
        super().layer_changed(pool, layer)
        self.state.log.append(("changed", layer))


def _stand_in_hook_registry(monkeypatch, name):
    """A stand-in of torch 2.14's torch.cuda.graphs.<name> (a torch before it)."""
    hooks = collections.OrderedDict()

    def register(fn):
        h = RemovableHandle(hooks)
        hooks[h.id] = fn
        return h
    monkeypatch.setattr(graphs, name, register, raising=False)
    return hooks


@pytest.fixture(params=["hooks", "wrappers"])
def path(request, monkeypatch):
    """How lwo.torch learns of captures in this test: (the graph class the
    test captures with, torch's start hook registry, its end hook registry).
    The choice is made anew at the test's first offload()."""
    if request.param == "hooks":
        if TORCH_HOOKS:  # torch's own: lwo.torch registers in them once per process
            return FakeGraph, graphs._global_capture_start_hooks, \
                graphs._global_capture_end_hooks
        monkeypatch.setattr(lt, "_capture_hooks", None)
        monkeypatch.setattr(lt, "_hook_handles", ())
        start = _stand_in_hook_registry(monkeypatch, "register_graph_capture_start_hook")
        end = _stand_in_hook_registry(monkeypatch, "register_graph_capture_end_hook")
        monkeypatch.setattr(graphs, "CUDAGraph", FakeGraph)
        return FakeGraph, start, end
    # torch 2.13 and before: no hooks; a class of this test's own is wrapped
    for name in ("register_graph_capture_start_hook", "register_graph_capture_end_hook"):
        monkeypatch.delattr(graphs, name, raising=False)
    cls = type("CUDAGraph", (OldGraph,), {})
    monkeypatch.setattr(graphs, "CUDAGraph", cls)
    monkeypatch.setattr(lt, "_capture_hooks", None)
    monkeypatch.setattr(lt, "_hook_handles", ())
    return cls, {}, {}


@pytest.fixture
def state(monkeypatch, path):
    st = types.SimpleNamespace(active=False, stream=CAPTURE_STREAM, log=[], fail_end=False,
                               capturing_calls=0, graph_class=path[0], start_hooks=path[1],
                               end_hooks=path[2], path=path)

    def capturing():
        st.capturing_calls += 1
        return st.active
    monkeypatch.setattr(lt, "_capturing", capturing)
    monkeypatch.setattr(lt, "_capture_stream", lambda: st.stream)
    yield st
    gc.collect()  # graphs of the test release their rings before its handles go


def offload(model, state, **kw):
    be = CaptureBackend(state, warm=kw.pop("warm", True), fake_ring=kw.pop("fake_ring", True))
    h = lt.offload(model, _backend=be, **kw)
    assert lt._capture_hooks == ("wrappers" if state.graph_class.__base__ is OldGraph
                                 else "hooks")
    return h, be


def new_graph(state):
    """A graph of the test's path (torch.cuda.CUDAGraph())."""
    return state.graph_class(state)


def mlp(frozen=True):
    m = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 24), nn.Tanh(),
                      nn.Linear(24, 8))
    if frozen:
        m.requires_grad_(False)
    return m


def warm_up(m, x, steps=2):
    with torch.no_grad():
        for _ in range(steps):
            y = m(x)
    return y


def warmed(state):
    """An MLP offloaded over the stand-in, an input, and the output of its
    eager warm-up (lwo has computed on the stream)."""
    m = mlp()
    h, be = offload(m, state)
    x = torch.randn(5, 12)
    return m, h, be, x, warm_up(m, x)


def captured(m, x, state):
    g = new_graph(state)
    with torch.no_grad(), capture(g):
        y = m(x)
    return g, y


def ring_calls(ring, since):
    return [e for e in ring.log[since:]]


# --------------------------------------------------------------------------
def test_the_ring_joins_before_the_first_stage_and_leaves_after_the_last_release(state):
    m = mlp()
    ref = copy.deepcopy(m)
    h, be = offload(m, state)
    ring = be.rings[-1]
    x = torch.randn(5, 12)
    y0 = warm_up(m, x)
    assert h._prefetched  # the eager steps staged the next step's first records
    n0 = len(ring.log)
    g, y = captured(m, x, state)
    calls = ring_calls(ring, n0)
    kinds = [c[0] for c in calls]
    j = kinds.index("join")
    # what the eager steps left staged goes back before the join (outside the capture)
    assert kinds[:j] and set(kinds[:j]) == {"release"}
    assert "stage" in kinds and kinds.index("stage") > j
    # the leave is the ring's last call, after every release of the captured pass
    assert kinds[-1] == "leave" and kinds.count("leave") == 1
    staged = [c[1] for c in calls[j:] if c[0] == "stage"]
    released = [c[1] for c in calls[j:] if c[0] == "release"]
    assert sorted(staged) == sorted(released) == [0, 1, 2]  # no next-step prefetch in a capture
    assert calls[j] == ("join", CAPTURE_STREAM) and calls[-1] == ("leave", CAPTURE_STREAM)
    assert state.log == ["torch begin", "join", "leave", "torch end"]
    assert torch.equal(y, y0)
    assert torch.allclose(y, ref(x), atol=1e-5)
    assert h.cuda_graph is g and h._joined is None
    assert not h._prefetched and h._held is None and h._live == 0 and ring.live() == 0
    assert "capture_end_pre" not in g.__dict__  # the graph's own again


def test_replays_then_the_ring_is_released_when_the_graph_is_dropped(state):
    m, h, be, x, y0 = warmed(state)
    ring = be.rings[-1]
    g, _ = captured(m, x, state)
    for _ in range(3):
        g.replay()
    assert g.replays == 3
    state.stream = 0x20  # replays on another stream: the release is ordered after them
    g.replay()
    state.stream = CAPTURE_STREAM
    n0 = len(ring.log)
    del g
    gc.collect()
    assert ring.log[n0:] == [("release_graph", 0x20)]
    assert h.cuda_graph is None
    with torch.no_grad():
        y = m(x)
    assert torch.equal(y, y0)
    assert not h._cap_check  # eager accesses are plain again


def test_records_a_pass_read_in_place_are_marked_changed_before_a_replay(state):
    """The ring captures warm: the records the warm-up's prefetch left in its
    slots (the first two) are hits in the capture, read where they are. A
    write through one of their parameters between replays is marked changed
    (lwo_pool_layer_changed) before the replay is announced, so the library
    copies it again first; a record the graph copies itself is not looked at,
    and a replay after no write marks nothing."""
    m, h, be, x, y0 = warmed(state)
    ring = be.rings[-1]
    g, _ = captured(m, x, state)
    assert [r.index for r in h._hold.warm] == [0, 1]
    for write, want in ((m[0], [("changed", 0), "replay"]), (m[2], [("changed", 1), "replay"]),
                        (m[4], ["replay"]), (None, ["replay"])):
        if write is not None:
            with torch.no_grad():
                write.weight.mul_(0.5)
        n0, r0 = len(state.log), len(ring.log)
        g.replay()
        assert state.log[n0:] == want
        assert ring.log[r0:] == [("replay", CAPTURE_STREAM)]
    del g


def test_the_release_follows_every_stream_the_graph_replayed_on(state):
    m, h, be, x, y0 = warmed(state)
    g, _ = captured(m, x, state)
    for s in (0x20, 0x30, 0x20, 0x40):
        state.stream = s
        g.replay()
    assert h.release_graph() is True
    assert be.rings[-1].log[-1] == ("release_graph", 0x40)
    assert be.ordered == [(0x40, [0x30, 0x20])]


def test_eager_use_while_a_graph_holds_the_ring_is_refused(state):
    m, h, be, x, y0 = warmed(state)
    ring = be.rings[-1]
    planner_before = h.stats()["planner"]
    g, _ = captured(m, x, state)
    n0 = len(ring.log)
    for _ in range(2):
        with pytest.raises(lwo.StateError) as e:
            with torch.no_grad():
                m(x)
        assert e.value.status == C.LWO_ERR_BUSY
        msg = str(e.value)
        assert "linear '0'" in msg and "0x10" in msg and "handle.release_graph()" in msg, msg
    assert ring.log[n0:] == []  # nothing staged
    assert h.stats()["planner"] == planner_before  # the refused calls left no trace
    g.reset()  # torch's reset fires the destroy callbacks: the ring goes back
    assert ring.log[-1] == ("release_graph", CAPTURE_STREAM)
    with torch.no_grad():
        assert torch.equal(m(x), y0)
    assert h.stats()["planner"]["mispredictions"] == planner_before["mispredictions"]


def test_a_released_graph_refuses_to_replay(state):
    m, h, be, x, y0 = warmed(state)
    g, _ = captured(m, x, state)
    g.replay()
    assert h.release_graph() is True and h.release_graph() is False
    with pytest.raises(lwo.StateError) as e:
        g.replay()
    assert e.value.status == C.LWO_ERR_CAPTURING
    assert "handle.release_graph()" in str(e.value) and "replay" in str(e.value)
    assert g.replays == 1
    g.reset()  # nothing more to release
    assert [c for c in be.rings[-1].log if c[0] == "release_graph"] == [
        ("release_graph", CAPTURE_STREAM)]
    # a new capture after the release
    g2, y2 = captured(m, x, state)
    assert h.cuda_graph is g2
    h.close()  # releases it: its replays are refused
    assert be.rings[-1].closed
    with pytest.raises(lwo.StateError) as e:
        g2.replay()
    assert "closed" in str(e.value)


def test_a_second_graph_is_refused_while_the_first_holds_the_ring(state):
    m, h, be, x, y0 = warmed(state)
    g, _ = captured(m, x, state)
    g2 = new_graph(state)
    with pytest.raises(lwo.StateError) as e:
        with torch.no_grad(), capture(g2):
            m(x)
    assert e.value.status == C.LWO_ERR_BUSY and "one graph at a time" in str(e.value)
    assert h.cuda_graph is g
    del g
    gc.collect()
    g3, _ = captured(m, x, state)
    assert h.cuda_graph is g3


def train_step(m, x):
    loss = m(x).square().sum()
    loss.backward()
    return loss


def grads_of(m):
    return [None if p.grad is None else p.grad.detach().clone() for p in m.parameters()]


def test_a_training_step_is_captured_and_each_replay_is_announced(state):
    m = mlp(frozen=False)
    ref = copy.deepcopy(m)
    h, be = offload(m, state)
    ring = be.rings[-1]
    x = torch.randn(5, 12)
    train_step(m, x)  # eager first, as on a GPU
    m.zero_grad(set_to_none=True)
    n0, g0 = len(ring.log), len(h.grads.log)
    g = new_graph(state)
    with capture(g):
        train_step(m, x)
    assert state.log == ["torch begin", "join", "leave", "torch end"]
    kinds = [c[0] for c in ring.log[n0:]]
    j = kinds.index("join")
    assert set(kinds[:j]) <= {"release"} and kinds[-1] == "leave" and kinds.count("leave") == 1
    # the backward's stages are in the capture, before the leave
    assert sorted(c[1] for c in ring.log[n0 + j:] if c[0] == "stage") == [0, 0, 1, 1, 2, 2]
    # the sums start at the join, outside the ring's part of the capture: no
    # fence in it (the stand-in ran the step: the fence is handle.synchronize())
    glog = h.grads.log[g0:]
    assert glog[0] == ("zero",) and ("wait",) not in glog, glog
    assert sorted(c[1] for c in glog if c[0] == "end") == [0, 1, 2]
    assert h.cuda_graph is g and all(p.grad is not None for p in m.parameters())
    h.synchronize()
    assert h.grads.log[-1] == ("wait",)
    train_step(ref, x)
    for got, want in zip(grads_of(m), grads_of(ref)):
        assert torch.allclose(got, want, atol=1e-4)
    # each replay: the sums start anew, then the replay is announced, on its stream
    for k, st in enumerate((CAPTURE_STREAM, 0x20)):
        state.stream = st
        m.zero_grad(set_to_none=True)  # the replay sets param.grad again
        n1, g1 = len(ring.log), len(h.grads.log)
        g.replay()
        assert ring.log[n1:] == [("replay", st)]
        assert h.grads.log[g1:] == [("zero",)]
        assert all(p.grad is not None for p in m.parameters()), k
    state.stream = CAPTURE_STREAM
    # param.grad is each parameter's view of the host sums after every replay:
    # one set to None, a frozen one left alone, all of them after
    # handle.zero_grad() (new views)
    params = list(m.parameters())
    assert all(p.grad is h._exposed[p] for p in params)
    params[0].grad = None
    params[1].grad = None
    params[1].requires_grad_(False)
    g.replay()
    assert params[0].grad is h._exposed[params[0]] and params[1].grad is None
    params[1].requires_grad_(True)
    g.replay()
    assert all(p.grad is h._exposed[p] for p in params)
    h.zero_grad()
    assert all(p.grad is None for p in params)
    g.replay()
    assert all(p.grad is not None and p.grad is h._exposed[p] for p in params)
    g.reset()
    assert ring.log[-1][0] == "release_graph"
    # eager training goes on, right
    m.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    train_step(m, x)
    train_step(ref, x)
    for got, want in zip(grads_of(m), grads_of(ref)):
        assert torch.allclose(got, want, atol=1e-4)


def test_a_step_captured_on_running_sums_adds_at_each_replay(state):
    m = mlp(frozen=False)
    h, be = offload(m, state)
    ring = be.rings[-1]
    x = torch.randn(5, 12)
    train_step(m, x)  # param.grad holds the sums: the capture adds to them
    g0 = len(h.grads.log)
    g = new_graph(state)
    with capture(g):
        train_step(m, x)
    assert ("zero",) not in h.grads.log[g0:]
    g1 = len(h.grads.log)
    g.replay()
    assert ("zero",) not in h.grads.log[g1:] and ring.log[-1] == ("replay", CAPTURE_STREAM)
    # the library refuses a replay whose sums are not as at the capture: the
    # message says how the replays of this graph go
    ring.refuse_replay = "lwo_ring_capture_replay: gradient layer 0 was zeroed (stand-in)"
    with pytest.raises(lwo.StateError) as e:
        g.replay()
    assert e.value.status == C.LWO_ERR_TICKET_STATE
    msg = str(e.value)
    assert "captured training step" in msg and "each replay adds too" in msg, msg
    ring.refuse_replay = None
    g.replay()
    g.reset()
    assert ring.log[-1][0] == "release_graph"


def test_a_training_capture_with_some_gradients_set_to_none_is_refused(state):
    m = mlp(frozen=False)
    h, be = offload(m, state)
    ring = be.rings[-1]
    x = torch.randn(5, 12)
    train_step(m, x)
    m[0].weight.grad = None  # and the others keep their sums
    n0 = len(ring.log)
    g = new_graph(state)
    with pytest.raises(lwo.ArgumentError) as e:
        with capture(g):
            train_step(m, x)
    assert e.value.status == C.LWO_ERR_UNSUPPORTED
    assert "optimizer.zero_grad()" in str(e.value), str(e.value)
    assert "join" not in [c[0] for c in ring.log[n0:]] and h.cuda_graph is None
    m.zero_grad(set_to_none=True)
    train_step(m, x)  # eagerly, as before
    assert m[0].weight.grad is not None


@pytest.mark.parametrize("in_backward", [False, True])
def test_lwo_optim_steps_after_each_replay_not_in_the_capture(state, in_backward):
    from lwo.torch import optim as lopt
    m = mlp(frozen=False)
    h, be = offload(m, state)
    x = torch.randn(5, 12)
    opt = lopt.SGD(m.parameters(), lr=0.01, in_backward=in_backward)
    train_step(m, x)
    opt.step()
    opt.zero_grad()
    b = opt._bindings[h]
    steps, log = b.lwo.n_steps, list(b.lwo.log)
    g = new_graph(state)
    with capture(g):
        train_step(m, x)
        with pytest.raises(lwo.StateError) as e:
            opt.step()
    assert e.value.status == C.LWO_ERR_CAPTURING
    assert "after each replay" in str(e.value), str(e.value)
    # in_backward: no step opened or started in the capture
    assert not b.open and not b.started and b.lwo.log == log and b.lwo.n_steps == steps
    for k in range(2):
        g.replay()
        opt.step()  # lwo's step on the replay's gradients (it waits for each layer)
        assert b.lwo.n_steps == steps + k + 1 and b.lwo.log == log
        opt.synchronize()
    g.reset()
    train_step(m, x)  # eager again
    opt.step()
    assert b.lwo.n_steps == steps + 3


def test_a_backward_in_a_capture_is_refused(state):
    m = mlp(frozen=False)
    h, be = offload(m, state)
    ring = be.rings[-1]
    x = torch.randn(5, 12)
    y = m(x)  # eager, with its autograd graph
    n0 = len(ring.log)
    g = new_graph(state)
    with pytest.raises(lwo.ArgumentError) as e:
        with capture(g):
            y.sum().backward()
    assert e.value.status == C.LWO_ERR_UNSUPPORTED
    assert "backward pass" in str(e.value) and "make_graphed_callables" in str(e.value)
    assert ring.log[n0:] == [] and h.grads.log[-1:] != [("begin", 2)]
    # the step goes on eagerly
    y = m(x)
    y.sum().backward()
    assert m[0].weight.grad is not None


def test_a_gradient_needed_inside_a_joined_capture_voids_its_graph(state):
    m = mlp()
    m[4].requires_grad_(True)  # a trainable head on a frozen base
    h, be = offload(m, state)
    ring = be.rings[-1]
    x = torch.randn(5, 12)
    warm_up(m, x)
    g = new_graph(state)
    with pytest.raises(lwo.ArgumentError) as e:
        with capture(g):
            with torch.no_grad():
                z = m[2](m[1](m[0](x)))  # joins
            m[4](m[3](z))  # the head needs its gradient
    assert e.value.status == C.LWO_ERR_UNSUPPORTED and "linear '4'" in str(e.value)
    kinds = [c[0] for c in ring.log]
    assert kinds.count("join") == 1 and kinds[-2:] == ["leave", "release_graph"]
    assert h.cuda_graph is None
    with pytest.raises(lwo.StateError) as e:
        g.replay()
    assert "refused a call in its capture" in str(e.value)
    with torch.no_grad():
        m(x)  # eager again


def test_a_capture_on_a_stream_lwo_never_computed_on_is_refused(state):
    m = mlp()
    h, be = offload(m, state, warm=False)
    ring = be.rings[-1]
    x = torch.randn(5, 12)
    y0 = warm_up(m, x)
    n0 = len(ring.log)
    g = new_graph(state)
    with pytest.raises(lwo.StateError) as e:
        with torch.no_grad(), capture(g):
            m(x)
    assert e.value.status == C.LWO_ERR_CAPTURING
    assert "torch.cuda.graph(g, stream=s)" in str(e.value) and "workspace" in str(e.value)
    assert ring.log[n0:] == []  # nothing released, staged or joined in the capture
    with torch.no_grad():
        assert torch.equal(m(x), y0)


def test_a_capture_torch_did_not_begin_is_refused(state):
    m, h, be, x, y0 = warmed(state)
    g = new_graph(state)
    with pytest.raises(lwo.ArgumentError) as e:
        with torch.no_grad(), capture(g):
            state.stream = 0x30  # a stream capturing, but not one torch began a capture on
            try:
                m(x)
            finally:
                state.stream = CAPTURE_STREAM
    assert "torch.cuda.CUDAGraph.capture_begin" in str(e.value) and "0x30" in str(e.value)
    assert h.cuda_graph is None


def test_the_librarys_refusal_of_the_join_leaves_the_handle_usable(state):
    """The real lwo_ring_capture_join (the host backend captures nothing):
    its error, named, and the handle as before."""
    m = mlp()
    h, be = offload(m, state, fake_ring=False)
    x = torch.randn(5, 12)
    y0 = warm_up(m, x)
    planner_before = h.stats()["planner"]
    g = new_graph(state)
    with pytest.raises(lwo.Error) as e:
        with torch.no_grad(), capture(g):
            m(x)
    msg = str(e.value)
    assert "lwo.torch: linear '0'" in msg and "lwo_ring_capture_join" in msg, msg
    assert h._joined is None and h.cuda_graph is None and h._live == 0
    assert h.stats()["planner"] == planner_before
    with torch.no_grad():
        assert torch.equal(m(x), y0)
    assert not h._cap_check


def test_the_plan_is_as_before_the_capture(state):
    m = mlp()
    h, be = offload(m, state)
    x = torch.randn(5, 12)
    warm_up(m, x, steps=3)
    before = (h.stats()["planner"], h.plan("forward"), h.plan("train"))
    g = new_graph(state)
    with torch.no_grad(), capture(g):
        m[4](m[3](m[2](m[1](m[0](x)))))
        m[4](m[3](m[2](torch.randn(5, 32))))  # another order in the same capture
    assert [c[0] for c in be.rings[-1].log].count("join") == 1
    assert (h.stats()["planner"], h.plan("forward"), h.plan("train")) == before
    del g
    gc.collect()
    warm_up(m, x, steps=2)
    st = h.stats()["planner"]
    assert st["mispredictions"] == before[0]["mispredictions"] and st["replans"] == 0


def test_eager_steps_look_for_a_capture_once_per_step(state):
    """One look (lt._capturing) at each step's start, none at the step's other
    accesses: a capture nothing noticed is refused there (see
    test_a_capture_lwo_did_not_join_is_refused), and a noticed one is handled
    there."""
    m = mlp()  # three streamed linears: a step is three accesses
    h, be = offload(m, state)
    x = torch.randn(5, 12)
    warm_up(m, x, steps=3)
    assert state.capturing_calls == 3
    g, _ = captured(m, x, state)
    n = state.capturing_calls
    del g
    gc.collect()
    warm_up(m, x, steps=1)  # the first step after the graph: its one look
    assert state.capturing_calls == n + 1 and not h._cap_check
    warm_up(m, x, steps=3)
    assert state.capturing_calls == n + 4
    # a capture elsewhere (no streamed module in it): still one look per step
    g2 = new_graph(state)
    with capture(g2):
        pass
    assert h._cap_check
    warm_up(m, x, steps=2)
    assert state.capturing_calls == n + 6 and h.cuda_graph is None and not h._cap_check
    # a backward pass looks once too (where it begins)
    mt = mlp(frozen=False)
    ht, _ = offload(mt, state)
    n = state.capturing_calls
    mt(x).sum().backward()
    assert state.capturing_calls == n + 2  # the forward step's start, the backward's


def test_resident_records_are_uploaded_at_the_join_and_a_write_refuses_the_replay(state):
    m = mlp()
    ref = copy.deepcopy(m)
    h, be = offload(m, state)
    h._apply([(0, 1, True), (1, 1, False), (2, 1, False)], 2)  # record 0 resident
    assert h.resident == (0,)
    x = torch.randn(5, 12)
    warm_up(m, x)
    with torch.no_grad():
        m[0].weight.mul_(0.5)  # written after its last stage
        ref[0].weight.mul_(0.5)
    state.log.clear()
    g, y = captured(m, x, state)
    assert state.log.index(("changed", 0)) < state.log.index("join")  # uploaded by the join
    g.replay()
    with torch.no_grad():
        assert torch.allclose(y, ref(x), atol=1e-5)  # the join uploaded the write
        m[2].weight.mul_(2.0)  # a streamed record: the next replay copies it
        ref[2].weight.mul_(2.0)
    g.replay()
    with torch.no_grad():
        m[0].bias.add_(1.0)  # the resident one: a replay cannot see it
        ref[0].bias.add_(1.0)
    with pytest.raises(lwo.StateError) as e:
        g.replay()
    assert e.value.status == C.LWO_ERR_BUSY
    assert "record 0" in str(e.value) and "resident" in str(e.value)
    assert g.replays == 2
    del g, e  # (the error's traceback holds the graph)
    gc.collect()
    with torch.no_grad():
        assert torch.allclose(m(x), ref(x), atol=1e-5)  # eager again, every write seen


class CapturePlanningBackend(CaptureBackend, host_lwo.PlanningBackend):
    """CaptureBackend with PlanningBackend's planner stand-in."""


def test_the_automatic_plan_measures_eager_steps_only(state):
    m = mlp()
    be = CapturePlanningBackend(state)
    h = lt.offload(m, _backend=be)
    x = torch.randn(5, 12)
    warm_up(m, x, steps=2)  # a warm-up step, then a measured one under way
    assert h._tuner.phase == "measure" and h._cal
    g, _ = captured(m, x, state)
    assert h._tuner.phase == "warmup" and h._cal is None  # measured again after it
    assert h.plan_info is None
    del g
    gc.collect()
    warm_up(m, x, steps=5)
    assert h.plan_info is not None and len(be.plan_calls) == 1
    assert h.record_names() == [["0", "2"], ["4"]] and be.rings[-1].depth == 3
    with torch.no_grad():
        y = m(x)
    g, y2 = captured(m, x, state)  # the plan's ring joins in turn
    assert torch.equal(y, y2) and h.cuda_graph is g
    assert [c[0] for c in be.rings[-1].log].count("join") == 1


def test_statistics_do_not_count_the_capture(state):
    m = mlp()
    h, be = offload(m, state, stats=True)
    x = torch.randn(5, 12)
    warm_up(m, x)
    before = [r["stages"] for r in h.layer_stats()]
    g, _ = captured(m, x, state)
    assert h._stats_on
    assert [r["stages"] for r in h.layer_stats()] == before


def test_the_ring_is_given_back_when_torch_cannot_end_the_capture(state):
    m, h, be, x, y0 = warmed(state)
    g = new_graph(state)
    state.fail_end = True
    with pytest.raises(RuntimeError, match="cudaStreamEndCapture"):
        with torch.no_grad(), capture(g):
            m(x)
    state.fail_end = False
    kinds = [c[0] for c in be.rings[-1].log]
    assert kinds[-2:] == ["leave", "release_graph"] and h.cuda_graph is None
    with torch.no_grad():
        assert torch.equal(m(x), y0)


def test_close_during_a_capture_is_refused(state):
    m, h, be, x, y0 = warmed(state)
    g = new_graph(state)
    with torch.no_grad(), capture(g):
        m(x)
        with pytest.raises(lwo.StateError) as e:
            h.close()
        assert "close() during a CUDA graph capture" in str(e.value)
        with pytest.raises(lwo.StateError):
            h.release_graph()
    h.close()
    assert [c[0] for c in be.rings[-1].log][-1] == "release_graph"


def test_the_streams_lwo_computed_on_are_those_of_its_step_starts(monkeypatch):
    """_Backend.record (every eager step's first access records its step
    event) notes the stream per engine; stream_warm answers from it."""
    class Engine:
        handle = None
    eng = Engine()
    stream = [0x55]
    monkeypatch.setattr(lt, "_raw_stream", lambda index: stream[0])
    monkeypatch.setattr(lt, "_record_event", lambda e, s: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: ("stream", stream[0]))
    a, b = lt._Backend(0, engine=eng), lt._Backend(0, engine=eng)
    assert not a.stream_warm(0x55)
    a.record(None)
    assert a.stream_warm(0x55) and b.stream_warm(0x55)  # the engine's, not the handle's
    assert not a.stream_warm(0x66)
    assert not lt._Backend(0, engine=Engine()).stream_warm(0x55)
    stream[0] = 0x66
    b.record(None)
    assert a.stream_warm(0x66)


def test_a_release_the_stream_cannot_take_yet_comes_at_the_next_call(state):
    m, h, be, x, y0 = warmed(state)
    ring = be.rings[-1]
    g, _ = captured(m, x, state)
    other = new_graph(state)
    with capture(other):  # another capture on the same stream (torch.cuda.graph's own)
        del g
        gc.collect()  # dropped while its stream captures: the library refuses the release
        assert h._hold is not None and h._hold.gone and h.cuda_graph is None
    assert "release_graph" not in [c[0] for c in ring.log]
    with torch.no_grad():
        y = m(x)  # the release comes first
    assert ring.log[ring.log.index(("release_graph", CAPTURE_STREAM)) + 1][0] == "stage"
    assert torch.equal(y, y0) and h._hold is None


def test_a_graph_object_captures_again_after_its_reset(state):
    m, h, be, x, y0 = warmed(state)
    g, _ = captured(m, x, state)
    g.replay()
    g.reset()  # gives the ring back; its replay start hook goes
    assert h.cuda_graph is None
    with torch.no_grad(), capture(g):
        y = m(x)
    assert h.cuda_graph is g and torch.equal(y, y0)
    g.replay()
    assert g.replays == 2
    assert h.release_graph()
    with pytest.raises(lwo.StateError, match="no longer holds"):
        g.replay()
    assert g.replays == 2


def test_a_capture_lwo_did_not_join_is_refused(state):
    """A step of streamed modules begun while the current stream captures a
    graph lwo.torch learned nothing of (cudaStreamBeginCapture, or a capture
    begun before offload()): refused at the step's start, before lwo
    enqueues anything, naming the module and what to do."""
    m, h, be, x, y0 = warmed(state)
    ring = be.rings[-1]
    n0 = len(ring.log)
    state.active = True  # nothing told lwo.torch of this capture
    try:
        with pytest.raises(lwo.StateError) as e:
            with torch.no_grad():
                m(x)
    finally:
        state.active = False
    assert e.value.status == C.LWO_ERR_CAPTURING
    msg = str(e.value)
    for part in ("lwo.torch: linear '0' (record 0)", "stream 0x10", "has not joined",
                 "torch.cuda.graph(g, stream=s)", "outside the capture",
                 "torch's capture hooks" if lt._capture_hooks == "hooks" else
                 "its wrappers of torch.cuda.CUDAGraph's methods"):
        assert part in msg, msg
    assert ring.log[n0:] == [] and state.log == []  # nothing staged, released or joined
    assert not h._cap_check and h.cuda_graph is None
    with torch.no_grad():
        assert torch.equal(m(x), y0)  # eager again
    # a backward pass begun in such a capture
    mt = mlp(frozen=False)
    ref = copy.deepcopy(mt)
    ht, bt = offload(mt, state)
    y = mt(x)
    state.active = True
    try:
        with pytest.raises(lwo.StateError, match="a backward pass through streamed modules"):
            y.sum().backward()
    finally:
        state.active = False
    assert mt[0].weight.grad is None
    ya, yb = mt(x), ref(x)
    ya.sum().backward()
    yb.sum().backward()
    for p, q in zip(mt.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5)
    # a capture begun before the handle existed
    h.close()
    ht.close()
    m2 = mlp()
    g = new_graph(state)
    with capture(g):
        h2, be2 = offload(m2, state)
        with pytest.raises(lwo.StateError, match="has not joined"):
            with torch.no_grad():
                m2(x)
    assert be2.rings[-1].log == [] and h2.cuda_graph is None
    with torch.no_grad():
        m2(x)


class RecordingGraph:
    """A graph class whose methods record how they were called."""

    def __init__(self):
        self.calls = []

    def capture_begin(self, pool=None, capture_error_mode="global"):
        """Begins (stand-in)."""
        self.calls.append(("capture_begin", pool, capture_error_mode))
        return "begun"

    def capture_end(self, *args, **kwargs):
        self.calls.append(("capture_end", args, kwargs))
        if kwargs.get("fail"):
            raise RuntimeError("capture_end failed (stand-in)")
        return "ended"

    def replay(self, *args, **kwargs):
        self.calls.append(("replay", args, kwargs))
        if kwargs.get("fail"):
            raise RuntimeError("replay failed (stand-in)")
        return "replayed"

    def reset(self, *args, **kwargs):
        self.calls.append(("reset", args, kwargs))
        return "reset"


def test_the_wrappers_leave_graphs_without_lwo_alone(monkeypatch):
    """The wrappers of a torch without capture hooks (_wrap_cuda_graph) call
    torch's methods with the same arguments, return what they return, let
    their errors through and leave nothing on a graph that captures nothing
    of lwo's: with no handle open, and with one open."""
    cls = type("CUDAGraph", (RecordingGraph,), {})
    monkeypatch.setattr(lt, "_LIVE_HANDLES", weakref.WeakSet())  # no handle open
    monkeypatch.setattr(lt, "_CAPTURES", {})
    monkeypatch.setattr(lt, "_capture_stream", lambda: CAPTURE_STREAM)
    monkeypatch.setattr(lt, "_capturing", lambda: False)
    assert lt._wrap_cuda_graph(cls)
    try:
        for name in ("capture_begin", "capture_end", "replay", "reset"):
            w, f = getattr(cls, name), getattr(RecordingGraph, name)
            assert w is not f and w.__wrapped__ is f and w.__name__ == name
            assert w.__doc__ == f.__doc__
        assert lt._wrap_cuda_graph(cls)  # once: no wrapper of a wrapper
        assert cls.replay.__wrapped__ is RecordingGraph.replay
        assert not lt._wrap_cuda_graph(type("NoGraph", (), {"replay": lambda self: None}))

        def run(g):
            assert g.capture_begin() == "begun"
            assert g.capture_begin(7, capture_error_mode="relaxed") == "begun"
            assert g.capture_begin(pool=(1, 2)) == "begun"
            assert g.capture_end() == "ended"
            with pytest.raises(RuntimeError, match="capture_end failed"):
                g.capture_end(fail=True)
            assert g.replay() == "replayed" and g.replay(3, k=4) == "replayed"
            with pytest.raises(RuntimeError, match="replay failed"):
                g.replay(fail=True)
            assert g.reset() == "reset" and g.reset(5) == "reset"
            assert g.calls == [
                ("capture_begin", None, "global"), ("capture_begin", 7, "relaxed"),
                ("capture_begin", (1, 2), "global"), ("capture_end", (), {}),
                ("capture_end", (), {"fail": True}), ("replay", (), {}),
                ("replay", (3,), {"k": 4}), ("replay", (), {"fail": True}),
                ("reset", (), {}), ("reset", (5,), {})]
            assert list(g.__dict__) == ["calls"]  # nothing of lwo's on the graph
            assert lt._CAPTURES == {} and weakref.getweakrefcount(g) == 0

        run(cls())
        # a handle open whose modules the graph does not capture: the same
        m = mlp()
        h = lt.offload(m, _backend=host_lwo.Backend())
        x = torch.randn(5, 12)
        y0 = warm_up(m, x)
        g = cls()
        run(g)
        assert h._cap_check and h.cuda_graph is None  # it noticed the captures
        with torch.no_grad():
            assert torch.equal(m(x), y0)
        assert not h._cap_check
        h.close()
    finally:
        lt._unwrap_cuda_graph(cls)
    for name in ("capture_begin", "capture_end", "replay", "reset"):
        assert getattr(cls, name) is getattr(RecordingGraph, name)
