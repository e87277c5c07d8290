"""lwo.torch's backend on the real library with no GPU, for the tests of
lwo.torch on the CPU: lwo.torch._Backend itself (the same C calls, through
the same code) over an engine of liblwo's test export
lwo_test_engine_create_host (bindings/c/lwo_test.h), whose "device" memory is
host memory, whose streams run their work when it is enqueued, and whose layer
compute runs on the CPU in f32 (every product and sum in f32, each output
rounded once to its dtype). Every rule of the C API (ring slots, tickets,
gradient staging and its fence, optimizer steps, checkpoint pools, quantized
layouts) is the library's own. The engine poisons: a released ring slot reads
as 0xff bytes (NaN) until acquired again or filled anew, and a gradient slot
is 0xff when begun, so a read after a release or a tensor left unwritten
shows.

What the tests look at beyond the library's own state is kept here, by
recording the calls lwo.torch makes: the pools, rings, gradient sets and
optimizers made, each call's order (Ring.log, Grads.log), the layers marked
changed, and counts of calls (Backend.calls).
"""

import collections
import ctypes
import time

import torch

import lwo
import lwo.torch as lt
from lwo import _capi as C
from lwo import _core

_POISON = 1  # LWO_TEST_HOST_POISON


def host_engine(poison=True):
    """An lwo.Engine on the host backend."""
    fn = C.lib.lwo_test_engine_create_host
    fn.argtypes = [ctypes.c_uint32, ctypes.POINTER(ctypes.c_void_p)]
    fn.restype = ctypes.c_int
    e = _core.Engine.__new__(_core.Engine)
    e._handle = _core._new_handle(fn, _POISON if poison else 0)
    return e


def set_comm_deadline(ms):
    """lwo_test_host_comm_timeout (bindings/c/lwo_test.h): the host
    communicators' deadline in ms; returns the previous one."""
    fn = C.lib.lwo_test_host_comm_timeout
    fn.argtypes = [ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32)]
    fn.restype = ctypes.c_int
    prev = ctypes.c_uint32()
    assert fn(ms, ctypes.byref(prev)) == 0
    return prev.value


def is_checkpoint_pool(pool):
    """True for a pool that maps a checkpoint (lwo_pool_create_from_checkpoint)."""
    return pool.info().kind == C.LWO_POOL_CHECKPOINT_MAPPED


def max_record(pool):
    return pool.info().max_record_bytes


class Ring(lt._Ring):
    """lt._Ring, with the calls made on it in order: ("stage", layer, hit),
    ("acquire", layer), ("release", layer)."""

    def __init__(self, obj, depth, resident):
        super().__init__(obj)
        self.depth = depth
        self.resident = set(resident)
        self.log = []
        self._layer = {}   # live ticket -> layer
        self.closed = False

    def stage(self, layer):
        hits = self.obj.stats().n_hits
        t = super().stage(layer)
        self._layer[t] = layer
        self.log.append(("stage", layer, self.obj.stats().n_hits > hits))
        return t

    def acquire(self, ticket, stream):
        base = super().acquire(ticket, stream)
        self.log.append(("acquire", self._layer[ticket]))
        return base

    def release(self, ticket, stream):
        super().release(ticket, stream)
        self.log.append(("release", self._layer.pop(ticket)))

    def live(self):
        """Tickets of ring slots staged or acquired and not released."""
        return sum(layer not in self.resident for layer in self._layer.values())

    def close(self):
        super().close()
        self.closed = True


class Grads(lt._Grads):
    """lt._Grads, with its calls in order (log: ("begin", layer), ("end",
    layer), ("wait",), ("zero",)), the layers begun and not ended (begun),
    the layers ended since the last fence (pending)."""

    def __init__(self, obj, mask):
        super().__init__(obj)
        self.mask = [bool(m) for m in mask]
        self.log = []
        self.begun = set()
        self.pending = []

    def begin(self, layer, stream):
        slot = super().begin(layer, stream)
        self.begun.add(layer)
        self.log.append(("begin", layer))
        return slot

    def end(self, layer, stream):
        super().end(layer, stream)
        self.begun.discard(layer)
        self.pending.append(layer)
        self.log.append(("end", layer))

    def wait(self):
        super().wait()
        self.pending = []
        self.log.append(("wait",))

    def zero(self):
        super().zero()
        self.log.append(("zero",))

    @property
    def n_transfers(self):
        return self.stats().n_transfers

    @property
    def n_accumulated(self):
        return self.stats().n_accumulated


class Optim(lt._Optim):
    """lt._Optim, counting its steps (n_steps), with the calls of its open
    steps (log), the groups set per (layer, tensor name) (group) and whether
    it was closed."""

    def __init__(self, obj):
        super().__init__(obj)
        self.n_steps = 0
        self.log = []  # ("open", step), ("add", layer, layer updates so far), ("close",)
        self.group = {}
        self.closed = False

    def step_groups(self, n, groups, max_norm=0.0, extra_sumsq=0.0):
        super().step_groups(n, groups, max_norm=max_norm, extra_sumsq=extra_sumsq)
        self.n_steps += 1

    def step_open(self, n, groups):
        super().step_open(n, groups)
        self.n_steps += 1
        self.log.append(("open", n))

    def step_add(self, layer):
        super().step_add(layer)
        self.log.append(("add", layer, self.obj.stats().n_layer_updates))

    def step_close(self):
        super().step_close()
        self.log.append(("close",))

    def set_group(self, layer, name, group):
        super().set_group(layer, name, group)
        self.group[(layer, name)] = int(group)

    def close(self):
        super().close()
        self.closed = True


class Backend(lt._Backend):
    """lt._Backend on the host backend's engine (a new one per Backend),
    recording what it made and the calls the tests count."""

    device_type = "cpu"
    device_index = -1
    events = False

    def __init__(self, poison=True):
        super().__init__(-1, engine=host_engine(poison))
        lt._note_derived_host_limit(self.engine)  # made here, as lt._Backend makes its own
        self.pools, self.rings, self.grads_sets, self.optims = [], [], [], []
        self.changed = []
        self.calls = collections.Counter()

    @property
    def plan(self):
        """No planner here (lwo.torch then keeps its own records and depth):
        its choices would follow the host's clock; PlanningBackend stands
        one in."""
        raise AttributeError("plan")

    def current_stream(self, device_index):
        return 0  # the legacy stream: the host backend orders every stream anyway

    def _count_writes(self, pool):
        wq = pool.write_quantized

        def write_quantized(*a, **k):
            r = wq(*a, **k)
            self.calls["write_quantized"] += 1
            return r
        pool.write_quantized = write_quantized
        self.pools.append(pool)
        return pool

    def pool(self, layers):
        return self._count_writes(super().pool(layers))

    def pool_from_checkpoint(self, checkpoint, names):
        return self._count_writes(super().pool_from_checkpoint(checkpoint, names))

    def sharded_pool(self, layers, comm):
        return self._count_writes(super().sharded_pool(layers, comm))

    def layer_changed(self, pool, layer):
        super().layer_changed(pool, layer)
        self.changed.append(layer)

    def ring(self, pool, depth, timing, resident=()):
        r = Ring(_core.Ring(pool, depth=depth, timing=timing, resident=resident), depth,
                 resident)
        self.rings.append(r)
        return r

    def grads(self, pool, mask, depth, n_threads=0, replica_comm=None):
        kw = {"replica_comm": replica_comm} if replica_comm is not None else {}
        g = Grads(_core.Grads(pool, trainable=mask, depth=depth, n_threads=n_threads, **kw),
                  mask)
        g.n_threads, g.replica_comm = n_threads, replica_comm
        self.grads_sets.append(g)
        return g

    def optimizer(self, grads, kind, state, flags, n_threads, seed):
        o = Optim(super().optimizer(grads, kind, state, flags, n_threads, seed).obj)
        o.n_threads = n_threads
        self.optims.append(o)
        return o

    # timing for the automatic plan: host clock stamps stand for events
    def event(self):
        return time.perf_counter()

    @staticmethod
    def make_events(n):
        return [None] * n

    @staticmethod
    def record(e):
        return time.perf_counter()

    @staticmethod
    def elapsed_ms(a, b):
        return (b - a) * 1e3

    @staticmethod
    def query(e):
        return True

    def free_bytes(self):
        return self.engine.memory()["device_free"]

    # compute: lt._Backend's calls, counted
    def linear_forward(self, desc, tokens, x, w, b, y, stream):
        self.calls["linear_forward"] += 1
        if desc[0].weight_format:
            self.calls["dequantize"] += 1
        super().linear_forward(desc, tokens, x, w, b, y, stream)

    def linear_backward(self, desc, tokens, x, dy, w, dx, dw, db, grad_dtype, stream):
        self.calls["linear_backward"] += 1
        if desc[0].weight_format and dx:
            self.calls["dequantize"] += 1
        super().linear_backward(desc, tokens, x, dy, w, dx, dw, db, grad_dtype, stream)

    def conv_forward(self, desc, n, h, w, x, wt, b, y, stream):
        self.calls["conv_forward"] += 1
        if desc[0].weight_format:
            self.calls["dequantize"] += 1
        super().conv_forward(desc, n, h, w, x, wt, b, y, stream)

    def conv_backward(self, desc, n, h, w, x, dy, wt, dx, dw, db, grad_dtype, stream):
        self.calls["conv_backward"] += 1
        if desc[0].weight_format and dx:
            self.calls["dequantize"] += 1
        super().conv_backward(desc, n, h, w, x, dy, wt, dx, dw, db, grad_dtype, stream)

    def zero_device(self, address, nbytes, stream):
        if nbytes:
            ctypes.memset(int(address), 0, int(nbytes))

    def read_device(self, address, dtype, shape, stream):
        t = torch.empty(shape, dtype=dtype)
        if t.numel():
            ctypes.memmove(t.data_ptr(), int(address), t.numel() * t.element_size())
        return t

    def synchronize(self):
        self.engine.synchronize()


class PlanningBackend(Backend):
    """Backend with a planner stand-in, so that a test chooses the plan:
    consecutive records in groups of `group_size`, the first group resident
    when `resident_first`, depth the first of those asked for (else 3). It
    keeps each call's arguments in `plan_calls`. Records under small_record
    bytes are merged first (0: none, unlike the device's backend).
    predicted_ms: the prediction it returns (None: none, so the adapter does
    not watch the steps against it)."""

    def __init__(self, group_size=2, resident_first=True, small_record=0, small_run=0,
                 predicted_ms=None):
        super().__init__()
        self.predicted_ms = predicted_ms
        self.small_record, self.small_run = small_record, small_run
        self.group_size = group_size
        self.resident_first = resident_first
        self.plan_calls = []

    def plan(self, pool, fwd_ms, bwd_ms, trainable, train, budget_bytes, depths=None,
             group=True, grad_depth=2):
        n = len(fwd_ms)
        self.plan_calls.append({"n": n, "fwd_ms": list(fwd_ms), "bwd_ms": bwd_ms,
                                "trainable": list(trainable), "train": train,
                                "budget_bytes": budget_bytes, "depths": depths,
                                "group": group})
        # the library's floor: one slot of the largest record and the
        # gradient staging of the largest trainable one
        sizes = [pool.record_bytes(i) for i in range(n)]
        need = max(sizes + [0]) + grad_depth * max(
            [b for b, t in zip(sizes, trainable) if t] + [0])
        if budget_bytes < need:
            raise lwo.error_class(C.LWO_ERR_OVER_BUDGET)(
                C.LWO_ERR_OVER_BUDGET, "planner stand-in: a budget of %d bytes holds no plan: "
                "the smallest ring (depth 1) and gradient staging need %d bytes"
                % (budget_bytes, need))
        k = self.group_size if group else 1
        groups = [(i, min(k, n - i), self.resident_first and i == 0) for i in range(0, n, k)]
        return {"depth": depths[0] if depths else 3, "groups": groups, "train": train,
                "predicted_ms": self.predicted_ms, "predicted_stall_ms": 0.0, "device_bytes": 0,
                "budget_bytes": budget_bytes, "h2d_bytes": 0, "d2h_bytes": 0, "link": {},
                "ungrouped_ms": 1.0, "first_k_ms": 1.0}
