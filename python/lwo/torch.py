"""lwo.torch: stream a PyTorch model's nn.Linear and nn.Conv2d weights
through lwo.

    import lwo.torch
    handle = lwo.torch.offload(model)          # weights -> an lwo pinned pool
    loss = model(x).sum(); loss.backward()     # each layer streamed, computed by lwo
    optimizer.step(); optimizer.zero_grad()    # CPU optimizer over the pool, in place

:func:`offload` moves the weights (and biases) of the model's nn.Linear and
nn.Conv2d modules into one lwo pinned pool in host memory, one record per
module, or one per group (``group=``), and frees their device copies. The
parameters become CPU tensors over the pool's pinned bytes. Each forward of
a streamed module stages its record through an lwo ring (``depth`` device
slots, default 2) and computes it with lwo (cuBLASLt, cuDNN) on
torch.cuda.current_stream(); a custom torch.autograd.Function gives it a
backward: dx through the same ring, and for trainable weights dW and db
through lwo's gradient path, into host buffers in the weights' dtype that
become ``param.grad`` once the backward pass is over.

The contract (docs/PYTHON.md says more):

- Prefetch follows the order the streamed modules ran in during the last
  step whose order the plan did not predict (the first step, and any step
  that changed it): forward order, then whatever the backward pass did.
- ``param.grad`` of a trainable streamed weight is a CPU tensor over lwo's
  host gradient buffer, valid after the backward pass returns (its fence,
  lwo_grads_wait, runs in a callback at the end of the pass). A backward
  pass that finds every such ``grad`` None (``optimizer.zero_grad()``, the
  default set_to_none) starts new sums (lwo_grads_zero, no memory traffic);
  one that finds them set adds to them, as PyTorch does.
- Writing a streamed parameter in place (an optimizer step, copy_,
  load_state_dict) is noticed through the tensor's version counter and
  makes the ring copy the record again at its next stage. Writes that
  bypass it (``param.data``, raw pointers) need ``handle.mark_changed()``.
- Under torch.compile each streamed module is one call of a custom
  operator in Dynamo's graph (lwo::linear, lwo::conv2d and their
  backwards, lwo._torch_compile): no graph break; the operators run the
  same per-call code as an eager call. Outside compile the forward is the
  autograd Functions' path, as before.
- A forward pass that needs no gradient is captured by torch.cuda.graph
  (and make_graphed_callables): the ring joins torch's capture at its first
  streamed access and leaves before torch ends it; the graph then holds the
  ring until it is destroyed or reset, or ``handle.release_graph()``. Eager
  calls meanwhile, and training in a capture, are refused; so is a step in
  a capture lwo.torch was not told of. torch's capture hooks (torch 2.14
  on) tell it, or its wrappers of torch.cuda.CUDAGraph's methods (before).
- ``model.to()``, ``.cuda()``, ``.half()`` leave the streamed weights where
  they are (in the pool, in their dtype).
- ``offload(model)`` measures its first steps and applies the library's
  plan (records, ring depth, resident records within ``budget=``).
- ``offload(model, quant="fp8")`` (or "fp8-block", "int8", "int4") streams
  the frozen nn.Linear and nn.Conv2d weights quantized: the pool holds codes and scales,
  lwo dequantizes each slot on the GPU for the forward and for dx, and the
  weight parameter is a frozen CPU tensor of the dequantized values.
"""

import collections
import ctypes
import math
import os
import statistics
import sys
import time
import warnings
import weakref

import torch
import torch.nn as nn

from . import _capi as C
from . import _core
from . import _tune
from . import _torch_compile
from . import _errors
from ._errors import ArgumentError, Error, StateError, check
from ._plan import FORWARD as _FORWARD, TRAIN as _TRAIN, Planner

__all__ = ["offload", "Offload", "ParamShard", "is_offloaded", "handle_of", "optim"]

_lib = C.lib

# torch dtype <-> lwo dtype, for what lwo computes.
_LWO_DTYPE = {torch.float32: C.LWO_DTYPE_F32, torch.bfloat16: C.LWO_DTYPE_BF16,
              torch.float16: C.LWO_DTYPE_F16}
_TORCH_DTYPE = {v: k for k, v in _LWO_DTYPE.items()}


class ParamShard(collections.namedtuple("ParamShard", "shape first n_elements")):
    """Where a streamed parameter is in its tensor (Offload.param_shards):
    the tensor's full shape, and the elements [first, first + n_elements),
    in row-major order, that this rank's parameter holds."""
    __slots__ = ()

    @property
    def numel(self):
        """The tensor's element count (of every rank together)."""
        return math.prod(self.shape)


def _qualified(module_name, key):
    return "%s.%s" % (module_name, key) if module_name else key

try:
    _graph_task_id = torch._C._current_graph_task_id
except AttributeError:  # pragma: no cover - very old torch
    def _graph_task_id():
        return -1

try:
    _raw_stream = torch._C._cuda_getCurrentRawStream
except AttributeError:  # pragma: no cover - a torch without CUDA
    def _raw_stream(index):
        return torch.cuda.current_stream(index).cuda_stream

try:  # Event.record below its Python layer, given the stream
    _record_event = torch._C._CudaEventBase.record
except AttributeError:  # pragma: no cover
    def _record_event(e, stream):
        e.record(stream)

try:
    _compiler_disable = torch.compiler.disable
except AttributeError:  # pragma: no cover - torch < 2.1
    def _compiler_disable(fn=None, recursive=True):
        return fn

try:  # False when called; Dynamo folds it to True while it traces
    _is_compiling = torch.compiler.is_dynamo_compiling
except AttributeError:  # pragma: no cover - older torch: no operators traced
    def _is_compiling():
        return False

try:  # a streamed forward without torch.compiler.disable's wrapper outside compile
    _eval_frame_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback
except AttributeError:  # pragma: no cover - older torch: the wrapper always
    _eval_frame_callback = None


def _host_tensor(address, nbytes, dtype, shape, owner):
    """A CPU tensor over host memory that `owner` keeps alive (the tensor keeps
    owner alive in turn, through its buffer)."""
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    arr = (ctypes.c_char * int(nbytes)).from_address(int(address))
    arr._lwo_owner = owner
    return torch.frombuffer(arr, dtype=dtype, count=numel).view(shape)


def _dequantize_host(pool, layer, name, fmt, dtype, out):
    """lwo_dequantize_host of quantized tensor `name` of `layer` (its pool
    bytes) into `out`, a contiguous CPU tensor of torch dtype `dtype`."""
    src = pool.tensor_host(layer, name)
    rows, cols = out.shape
    d = _core._quant_desc(fmt, _LWO_DTYPE[dtype], rows, cols)
    check(_lib.lwo_dequantize_host(ctypes.byref(d), src.address, src.bytes, out.data_ptr(),
                                   out.numel() * out.element_size(), 0))


# --------------------------------------------------------------------------
# The backend: the C calls the adapter makes, with their ctypes arguments
# prepared once. Tests substitute a CPU stand-in with the same methods.
# --------------------------------------------------------------------------
class _HotCalls:
    """What the hot calls of an lwo object (obj) share: its handle, a layer
    view passed by reference, and stats and close of obj."""

    def __init__(self, obj):
        self.obj = obj
        self._h = obj.handle
        self._v = C.lwo_layer_view()
        self._vref = ctypes.byref(self._v)

    def stats(self):
        return self.obj.stats()

    def close(self):
        self.obj.close()


class _Ring(_HotCalls):
    """An lwo.Ring's hot calls (obj: the lwo.Ring)."""

    def __init__(self, obj):
        super().__init__(obj)
        self._t = C.lwo_ticket()
        self._tref = ctypes.byref(self._t)
        self._arg = C.lwo_ticket()
        self._stage = _lib.lwo_ring_stage
        self._acquire = _lib.lwo_ring_acquire
        self._release = _lib.lwo_ring_release

    def stage(self, layer):
        st = self._stage(self._h, layer, self._tref)
        if st:
            check(st)
        return self._t.id

    def acquire(self, ticket, stream):
        a = self._arg
        a.id = ticket
        st = self._acquire(self._h, a, stream, self._vref)
        if st:
            check(st)
        return self._v.base

    def release(self, ticket, stream):
        a = self._arg
        a.id = ticket
        st = self._release(self._h, a, stream)
        if st:
            check(st)

    def reset_stats(self):
        self.obj.reset_stats()

    def info(self):
        return self.obj.info()

    # Joining a CUDA graph capture that torch began (see "CUDA graphs" below).
    def capture_join(self, stream):
        check(_lib.lwo_ring_capture_join(self._h, stream))

    def capture_leave(self, stream):
        check(_lib.lwo_ring_capture_leave(self._h, stream))

    def capture_replay(self, stream):
        check(_lib.lwo_ring_capture_replay(self._h, stream))

    def capture_release(self, stream):
        check(_lib.lwo_ring_capture_release(self._h, stream))


class _Grads(_HotCalls):
    """An lwo.Grads's hot calls (obj: the lwo.Grads)."""

    def __init__(self, obj):
        super().__init__(obj)
        self._begin = _lib.lwo_grads_begin
        self._end = _lib.lwo_grads_end

    def begin(self, layer, stream):
        """(device address, wire dtype) of each tensor of the layer's slot."""
        v = self._v
        st = self._begin(self._h, layer, stream, self._vref)
        if st:
            check(st)
        return [(v.tensors[i] or 0, v.tensor_dtypes[i]) for i in range(v.n_tensors)]

    def end(self, layer, stream):
        st = self._end(self._h, layer, stream)
        if st:
            check(st)

    def wait(self):
        self.obj.wait()

    def zero(self):
        self.obj.zero()

    def tensor(self, layer, name):
        g = self.obj.tensor(layer, name)
        return g.address, g.dtype, g.n_elements


class _Optim:
    """An lwo.Optimizer's calls for lwo.torch.optim (obj: the lwo.Optimizer);
    read and write move a tensor's state through CPU tensors."""

    _which = {"master": C.LWO_OPTIM_MASTER, "m": C.LWO_OPTIM_M, "v": C.LWO_OPTIM_V}

    def __init__(self, obj):
        self.obj = obj

    def step_groups(self, n, groups, max_norm=0.0, extra_sumsq=0.0):
        self.obj.step_groups(n, groups, max_norm=max_norm, extra_sumsq=extra_sumsq)

    def step_open(self, n, groups):
        self.obj.step_open(n, groups)

    def step_add(self, layer):
        check(_lib.lwo_optim_step_add(self.obj.handle, layer))

    def step_close(self):
        self.obj.step_close()

    def set_group(self, layer, name, group):
        self.obj.set_group(layer, name, group)

    def wait(self):
        self.obj.wait()

    def read(self, layer, name, which, out):
        check(_lib.lwo_optim_read(self.obj.handle, int(layer), _core._enc(name),
                                  self._which[which], out.data_ptr(),
                                  out.numel() * out.element_size()))

    def write(self, layer, name, which, src):
        src = src.contiguous()
        check(_lib.lwo_optim_write(self.obj.handle, int(layer), _core._enc(name),
                                   self._which[which], src.data_ptr(),
                                   src.numel() * src.element_size()))

    def stats(self):
        return self.obj.stats()

    def close(self):
        self.obj.close()


def _note_derived_host_limit(engine):
    """Notes that `engine`'s host memory limit is the one lwo derived at its
    creation (offload(process_group=) shares it among a node's ranks; see
    _node_host_limit)."""
    engine._lwo_derived_host_limit = engine.host_usage()[0]


class _Backend:
    """lwo on one CUDA device."""

    device_type = "cuda"
    events = True
    # Records under small_record bytes are merged with their neighbours into
    # runs of up to small_run before the plan (a 1 MiB copy runs at 43 GB/s
    # on the H200's link, 4 MiB at 52; docs/ARCHITECTURE.md).
    small_record = 1 << 20
    small_run = 4 << 20

    _engines = {}

    def __init__(self, device_index, engine=None):
        eng = engine or _Backend._engines.get(device_index)
        if eng is None:
            eng = _core.Engine(device_index)  # DeviceError (LWO_ERR_NO_DEVICE) without a GPU
            _Backend._engines[device_index] = eng  # one engine per device per process
            _note_derived_host_limit(eng)
        self.engine = eng
        self.device_index = device_index
        self._eng = eng.handle
        self._lin_fwd = _lib.lwo_linear_forward
        self._lin_bwd = _lib.lwo_linear_backward
        self._conv_fwd = _lib.lwo_conv2d_forward
        self._conv_bwd = _lib.lwo_conv2d_backward
        self._changed = _lib.lwo_pool_layer_changed
        self._streams = {}  # raw stream -> its torch.cuda.Stream (record)

    def current_stream(self, device_index):
        return _raw_stream(device_index)

    def transfer_stream(self):
        return self.engine.transfer_stream

    # pools, rings, gradients
    def pool(self, layers):
        return _core.Pool.create_pinned(self.engine, layers)

    def sharded_pool(self, layers, comm):
        """This rank's shard of every record over lwo's communicator of the
        group (lwo_pool_create_sharded: a collective of the group's ranks)."""
        return _core.Pool.create_sharded(self.engine, layers, comm)

    def pool_from_checkpoint(self, checkpoint, names):
        """A read-only pool over the mapped checkpoint (an lwo.Checkpoint):
        layer i holds the tensors names[i] (full checkpoint names)."""
        return _core.Pool.from_checkpoint(self.engine, checkpoint, names=names)

    def layer_changed(self, pool, layer):
        st = self._changed(pool.handle, layer)
        if st:
            check(st)

    def ring(self, pool, depth, timing, resident=()):
        # Warm captures (LWO_RING_CAPTURE_WARM): a captured step finds its
        # first layers where the last one left them, as an eager step does;
        # each replay's start hook announces it (lwo_ring_capture_replay).
        return _Ring(_core.Ring(pool, depth=depth, timing=timing, resident=resident,
                                flags=C.LWO_RING_CAPTURE_WARM))

    # the automatic plan
    def event(self):
        """A timing event recorded now on torch's current stream."""
        return self.record(torch.cuda.Event(enable_timing=True))

    @staticmethod
    def make_events(n):
        """n timing events, not yet recorded (made ahead of a measured step,
        so that the step's host time has no event creation in it)."""
        return [torch.cuda.Event(enable_timing=True) for _ in range(n)]

    def record(self, e):
        """Records an event of make_events() now on torch's current stream.
        A measured step records four events per streamed access: the stream
        object is made once per raw stream (torch.cuda.current_stream(),
        which Event.record() calls by default, costs more host time than the
        record itself, and host time added to a measured step shows as
        device time between accesses once the host falls behind). Every
        step's first access records one, so the streams seen here are those
        lwo.torch computed on (stream_warm)."""
        raw = _raw_stream(self.device_index)
        s = self._streams.get(raw)
        if s is None:
            if len(self._streams) > 64:
                self._streams.clear()
            s = self._streams[raw] = torch.cuda.current_stream(self.device_index)
            _Backend._warm.setdefault(id(self.engine), set()).add(raw)
        _record_event(e, s)
        return e

    # id(engine) -> raw streams on which lwo.torch began a step
    _warm = {}

    def stream_warm(self, raw):
        """True if lwo.torch began a step on stream `raw` of this engine: the
        engine's compute workspace of that stream exists (lwo allocates it at
        a stream's first compute call, which a CUDA graph capture cannot
        hold)."""
        return raw in _Backend._warm.get(id(self.engine), ())

    def order_streams(self, last, others):
        """Makes stream `last` wait for the work enqueued so far on the
        streams `others` (raw streams of the device; 0 is the default
        stream)."""
        dev = torch.device("cuda", self.device_index)

        def stream(raw):
            return torch.cuda.ExternalStream(raw, device=dev) if raw else \
                torch.cuda.default_stream(dev)
        target = stream(last)
        for raw in others:
            e = torch.cuda.Event()
            e.record(stream(raw))
            target.wait_event(e)

    @staticmethod
    def elapsed_ms(a, b):
        return a.elapsed_time(b)

    @staticmethod
    def query(e):
        """True once the event's work is done (never blocks)."""
        return e.query()

    def workspace_bytes(self):
        return self.engine.memory()["workspaces"]

    def free_bytes(self):
        return torch.cuda.mem_get_info(self.device_index)[0]

    def plan(self, pool, fwd_ms, bwd_ms, trainable, train, budget_bytes, depths=None,
             group=True, grad_depth=2):
        return _tune.plan(pool.handle, fwd_ms, bwd_ms, trainable, train, budget_bytes,
                          depths=depths, group=group, grad_depth=grad_depth)

    def grads(self, pool, mask, depth, n_threads=0, replica_comm=None):
        """The gradient set (n_threads: its host threads, 0 one per core;
        replica_comm: the communicator its sums are all-reduced over across
        the replicas of a sharded pool, or None)."""
        kw = {"replica_comm": replica_comm} if replica_comm is not None else {}
        return _Grads(_core.Grads(pool, trainable=mask, depth=depth, n_threads=n_threads, **kw))

    def optimizer(self, grads, kind, state, flags, n_threads, seed):
        return _Optim(_core.Optimizer(
            grads.obj, kind=kind, state=state,
            stochastic=bool(flags & C.LWO_OPTIM_STOCHASTIC_ROUNDING),
            clipping=bool(flags & C.LWO_OPTIM_CLIPPING), delayed=bool(flags & C.LWO_OPTIM_DELAYED),
            n_threads=n_threads, seed=seed))

    # compute
    def linear_desc(self, in_features, out_features, dtype, bias, accumulate=False,
                    weight_format=0):
        d = _core.linear_desc(in_features, out_features, dtype=dtype, bias=bias,
                              flags=C.LWO_LINEAR_ACCUMULATE if accumulate else 0,
                              weight_format=weight_format)
        return (d, ctypes.byref(d))

    def raw_linear_forward(self):
        """(the ctypes function, the engine handle) that linear_forward calls,
        for a caller that makes the call itself (one Python call fewer per
        layer); None where linear_forward is not this class's own."""
        if getattr(self.linear_forward, "__func__", None) is not _Backend.linear_forward:
            return None
        return self._lin_fwd, self._eng

    def linear_forward(self, desc, tokens, x, w, b, y, stream):
        st = self._lin_fwd(self._eng, desc[1], tokens, x, w, b, y, stream)
        if st:
            check(st)

    def linear_backward(self, desc, tokens, x, dy, w, dx, dw, db, grad_dtype, stream):
        st = self._lin_bwd(self._eng, desc[1], tokens, x, dy, w, dx, dw, db, grad_dtype, stream)
        if st:
            check(st)

    def conv_desc(self, module, dtype, bias, padding, accumulate=False, weight_format=0):
        d = _core.conv2d_desc(module.in_channels, module.out_channels, tuple(module.kernel_size),
                              dtype=dtype, stride=tuple(module.stride), padding=padding,
                              dilation=tuple(module.dilation), groups=module.groups, bias=bias,
                              layout="nchw", flags=C.LWO_CONV_ACCUMULATE if accumulate else 0,
                              weight_format=weight_format or None)
        return (d, ctypes.byref(d))

    def conv_output_size(self, desc, h, w):
        return _core.conv2d_output_size(desc[0], h, w)

    def conv_forward(self, desc, n, h, w, x, wt, b, y, stream):
        st = self._conv_fwd(self._eng, desc[1], n, h, w, x, wt, b, y, stream)
        if st:
            check(st)

    def conv_backward(self, desc, n, h, w, x, dy, wt, dx, dw, db, grad_dtype, stream):
        st = self._conv_bwd(self._eng, desc[1], n, h, w, x, dy, wt, dx, dw, db, grad_dtype,
                            stream)
        if st:
            check(st)

    def _device_bytes(self, address, nbytes, stream):
        """(a uint8 CUDA tensor over `nbytes` device bytes at `address`, no
        copy; torch's stream for the raw `stream`, the device's default
        stream for 0)."""
        class _Raw:
            __cuda_array_interface__ = {"shape": (int(nbytes),), "typestr": "|u1",
                                        "data": (int(address), False), "version": 3,
                                        "strides": None}
        dev = torch.device("cuda", self.device_index)
        st = torch.cuda.ExternalStream(stream, device=dev) if stream else \
            torch.cuda.default_stream(dev)
        return torch.as_tensor(_Raw(), device=dev), st

    def zero_device(self, address, nbytes, stream):
        """Zeroes device bytes on `stream` (a gradient slot's tensor that no
        module wrote)."""
        if not nbytes:
            return
        t, st = self._device_bytes(address, nbytes, stream)
        with torch.cuda.stream(st):
            t.zero_()

    def read_device(self, address, dtype, shape, stream):
        """A new CPU tensor of `shape` and `dtype` copied from device memory at
        `address`, ordered on `stream` (returns once the copy is done)."""
        out = torch.empty(shape, dtype=dtype)
        nbytes = out.numel() * out.element_size()
        if not nbytes:
            return out
        t, st = self._device_bytes(address, nbytes, stream)
        with torch.cuda.stream(st):
            out.view(-1).view(torch.uint8).copy_(t)
        st.synchronize()
        return out

    def synchronize(self):
        self.engine.synchronize()


# --------------------------------------------------------------------------
# Records and streamed modules
# --------------------------------------------------------------------------
class _Record:
    """One record of the pool: the weights of one module or of a group."""

    __slots__ = ("index", "name", "modules", "params", "names", "version", "trainable",
                 "bytes", "n_stages", "n_hits", "bytes_copied", "copy_ms", "stall_ms",
                 "n_accesses", "quantized", "saved_bytes", "resident", "nodes", "unsafe")

    def __init__(self, index, name):
        self.index = index
        self.name = name
        self.modules = []
        self.params = []     # every parameter in the record (for the version counters)
        self.names = []      # tensor names in the record, in order
        self.version = 0
        self.trainable = False
        self.quantized = False  # its modules' weights are quantized (a record apart)
        self.resident = False   # kept on the device by the ring (a plan's choice)
        # This backward pass: the autograd nodes with a weight gradient made
        # for it outside a backward pass and not yet run (see _end_span), and
        # whether a no-grad access since the last pass makes that count
        # unsure (a reentrant checkpoint recomputes it inside the pass).
        self.nodes = 0
        self.unsafe = False
        self.bytes = 0
        self.saved_bytes = 0    # what quantization saves against the dense record
        self.n_stages = self.n_hits = self.bytes_copied = self.n_accesses = 0
        self.copy_ms = self.stall_ms = 0.0

    def current_version(self):
        v = 0
        for p in self.params:
            v += p._version
        return v


class _Module:
    """What a streamed module needs at each call."""

    __slots__ = ("handle", "name", "kind", "record", "module", "weight", "bias", "w_idx",
                 "b_idx", "w_off", "b_off", "dtype", "lwo_dtype", "has_bias", "desc",
                 "desc_acc", "in_f", "out_f", "w_bytes", "b_bytes", "out_sizes", "padding",
                 "quant", "uid", "key", "w_shape", "b_shape", "__weakref__")

    def needs_dw(self):
        b = self.bias
        return self.weight.requires_grad or (b is not None and b.requires_grad)


_STREAMED_CLASSES = {}


def _streamed_class(cls):
    sub = _STREAMED_CLASSES.get(cls)
    if sub is None:
        fwd = _linear_module_forward if issubclass(cls, nn.Linear) else _conv_module_forward
        sub = type(cls.__name__, (cls,), {
            "forward": fwd, "_apply": _streamed_apply, "_lwo_base_class": cls,
            "_save_to_state_dict": _streamed_save,
            "__module__": cls.__module__,
            "__doc__": "%s streamed by lwo.torch (see lwo.torch.offload)" % cls.__name__,
        })
        _STREAMED_CLASSES[cls] = sub
    return sub


def _streamed_apply(self, fn, *args, **kwargs):
    """nn.Module._apply (to, cuda, half, ...) that leaves the pool's tensors."""
    s = self._lwo_state
    saved = {}
    for key in ("weight", "bias"):
        p = self._parameters.get(key)
        if p is not None and (p is s.weight or p is s.bias):
            saved[key] = p
            self._parameters[key] = None
    try:
        return type(self)._lwo_base_class._apply(self, fn, *args, **kwargs)
    finally:
        self._parameters.update(saved)


def _streamed_save(self, destination, prefix, keep_vars):
    """nn.Module._save_to_state_dict, the parameter of a weight streamed
    quantized and trained by lwo.torch.optim first set from its master."""
    s = self._lwo_state
    if s.quant:
        for b in s.handle._optims:
            b.sync_params()
    return type(self)._lwo_base_class._save_to_state_dict(self, destination, prefix, keep_vars)


def _check_params(self, s):
    if self._parameters.get("weight") is not s.weight or (
            s.bias is not None and self._parameters.get("bias") is not s.bias):
        raise RuntimeError(
            "lwo.torch: the weight or bias of streamed module %r was replaced after "
            "offload(); write into it in place (copy_, load_state_dict) or close the "
            "handle and offload again" % s.name)


# The per-layer paths (these Functions, Offload._linear_* and _conv_*) are
# written out for linear and convolution alike rather than shared through
# helpers: they run once per streamed module per pass, and each Python call
# a helper adds is host time per layer (the figure torch-offload-bench's
# overhead case holds against PyTorch's own layer).
class _LinearFn(torch.autograd.Function):
    """y = x W^T + b through lwo. When x needs no gradient, a parameter that
    does is an input (`anchor`), only so that autograd knows the output needs
    a backward: the weight gradients go to lwo, never to autograd (backward
    returns None for it)."""

    @staticmethod
    def forward(ctx, x, s, anchor=None):
        b = s.bias  # s.needs_dw() written out
        need_dw = s.weight.requires_grad or (b is not None and b.requires_grad)
        if need_dw and s.quant and not s.handle._quant_trains(s):
            _refuse_quantized_grad(s)
        y = s.handle._linear_forward(s, x, True)
        ctx.s = s
        ctx.need_dw = need_dw
        ctx.x_dtype = x.dtype
        if need_dw:
            if not s.record.trainable:
                s.handle._make_grads(extra=s.record)
            ctx.save_for_backward(x)
            if s.handle._count_nodes and _graph_task_id() == -1:
                s.record.nodes += 1
        return y

    @staticmethod
    def backward(ctx, dy):
        s = ctx.s
        x = ctx.saved_tensors[0] if ctx.need_dw else None
        dx = s.handle._linear_backward(s, x, dy, ctx.needs_input_grad[0], ctx.need_dw,
                                       ctx.x_dtype)
        return dx, None, None


class _ConvFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, s, anchor=None):
        if s.quant and s.needs_dw() and not s.handle._quant_trains(s):
            _refuse_quantized_grad(s)
        y = s.handle._conv_forward(s, x, True)
        ctx.s = s
        ctx.need_dw = s.needs_dw()
        ctx.x_dtype = x.dtype
        ctx.x_shape = x.shape
        if ctx.need_dw:
            if not s.record.trainable:
                s.handle._make_grads(extra=s.record)
            ctx.save_for_backward(x)
            if s.handle._count_nodes and _graph_task_id() == -1:
                s.record.nodes += 1
        return y

    @staticmethod
    def backward(ctx, dy):
        s = ctx.s
        x = ctx.saved_tensors[0] if ctx.need_dw else None
        dx = s.handle._conv_backward(s, x, ctx.x_shape, dy, ctx.needs_input_grad[0],
                                     ctx.need_dw, ctx.x_dtype)
        return dx, None, None


def _quant_shape(w):
    """The 2-D shape a weight is quantized as: [out, in] for a linear, [out,
    in / groups * kh * kw] for a convolution (its inner dimensions
    flattened in NCHW's order, as lwo_conv2d_desc.weight_format reads it)."""
    return (int(w.shape[0]), int(w.numel() // w.shape[0])) if w.shape[0] else tuple(w.shape)


# The quantized formats whose weights train (lwo_grads_create, linear and
# convolution backward): their gradient is dense, their masters f32 on the host.
_TRAINABLE_QUANT = (C.LWO_QUANT_FP8_E4M3_BLOCK128,)


def _refuse_quantized_grad(s):
    raise ArgumentError(C.LWO_ERR_QUANTIZED_WEIGHT,
                        "lwo.torch: %s %r streams its weight quantized (%s): quantized "
                        "weights are frozen unless offload() had quant_trainable=True (for "
                        "fp8-block), so its weight and bias cannot require a gradient (close "
                        "the handle and offload again without quant= for it, or with "
                        "quant=\"fp8-block\", quant_trainable=True)"
                        % (s.kind, s.name, _core.quant_spelling(s.quant)))


# Function.apply without its Python layer (argument binding for setup_context,
# which these Functions do not define, and functorch's unwrapping, needed only
# under functorch transforms, where the full apply is used): about half its
# host time.
_linear_apply = super(torch.autograd.Function, _LinearFn).apply
_conv_apply = super(torch.autograd.Function, _ConvFn).apply


def _module_forward(fn, apply, forward, traced):
    """The forward a streamed module is given: through the autograd Function
    `fn` (`apply`: its apply without the Python layer, when functorch is not
    active) where a gradient is needed, else straight through lwo; while
    Dynamo traces it, `traced` (lwo._torch_compile: the module's custom
    operator, recorded in the graph)."""

    def module_forward(self, input):
        s = self._lwo_state
        w = self._parameters.get("weight")
        if w is not s.weight:
            _check_params(self, s)
        if torch.is_grad_enabled():
            if input.requires_grad:
                if _functorch_active():
                    return fn.apply(input, s)
                return apply(input, s)
            if s.needs_dw():  # a parameter that needs its gradient makes the graph
                anchor = s.weight if s.weight.requires_grad else s.bias
                if _functorch_active():
                    return fn.apply(input, s, anchor)
                return apply(input, s, anchor)
        # no autograd node: this access has no backward (the prefetch plan
        # counts it into a forward-only step)
        return forward(s.handle, s, input, False)

    disabled = _compiler_disable(module_forward)
    if _eval_frame_callback is None:
        return disabled

    def streamed_forward(self, input):
        # Dynamo, tracing it, folds is_dynamo_compiling() to True: it
        # records the module's custom operator. Under torch.compile's frame evaluation
        # elsewhere (a frame Dynamo runs without tracing it), the disabled
        # wrapper, so that no frame below is traced. Outside compile,
        # module_forward written out (one Python call less).
        if _is_compiling():
            return traced(self, input, disabled)
        if _eval_frame_callback() is not None:
            return disabled(self, input)
        s = self._lwo_state
        w = self._parameters.get("weight")
        if w is not s.weight:
            _check_params(self, s)
        if torch.is_grad_enabled():
            if input.requires_grad:
                if _functorch_active():
                    return fn.apply(input, s)
                return apply(input, s)
            if s.needs_dw():
                anchor = s.weight if s.weight.requires_grad else s.bias
                if _functorch_active():
                    return fn.apply(input, s, anchor)
                return apply(input, s, anchor)
        return forward(s.handle, s, input, False)

    return streamed_forward

try:
    _functorch_active = torch._C._are_functorch_transforms_active
except AttributeError:  # pragma: no cover
    def _functorch_active():
        return True


# Live handles, for lwo.torch.optim to find which parameters are streamed.
_LIVE_HANDLES = weakref.WeakSet()

_MAX_REPLANS = 2  # plans made again when the steps stop matching the prediction
_SETTLE = 3       # steps after a plan that set the baseline its later steps are held to


class _Progress:
    """Progress of a long load on stderr: nothing for a load done within
    `after` seconds; then a bar redrawn in place on a terminal, else a line
    per quarter. enabled: None (by time), True (from the start), False."""

    def __init__(self, what, total, enabled=None, after=2.0, stream=None):
        self.what, self.total, self.done_bytes = what, max(1, int(total)), 0
        self.enabled = enabled
        self.after = 0.0 if enabled else after
        self.stream = stream or sys.stderr
        self.t0 = time.perf_counter()
        self.shown = False
        self.last = 0.0
        self.quarter = 0
        try:
            self.tty = self.stream.isatty()
        except (AttributeError, ValueError):
            self.tty = False

    def add(self, nbytes):
        self.done_bytes += int(nbytes)
        if self.enabled is False:
            return
        now = time.perf_counter()
        if now - self.t0 < self.after or now - self.last < 0.25:
            return
        self.last = now
        self._show(now)

    def _show(self, now, final=False):
        frac = min(1.0, self.done_bytes / self.total)
        gb = self.total / 1e9
        if self.tty:
            n = int(frac * 30)
            self.stream.write("\r%s [%s%s] %5.1f%% of %.2f GB, %.0f s" % (
                self.what, "#" * n, "." * (30 - n), 100 * frac, gb, now - self.t0))
            if final:
                self.stream.write("\n")
        else:
            q = int(frac * 4)
            if q <= self.quarter and not final:
                return
            self.quarter = q
            self.stream.write("%s: %3.0f%% of %.2f GB, %.1f s\n" % (self.what, 100 * frac, gb,
                                                                   now - self.t0))
        self.stream.flush()
        self.shown = True

    def done(self):
        if self.enabled is False:
            return
        now = time.perf_counter()
        if self.shown or (self.enabled and now - self.t0 >= self.after):
            self.done_bytes = self.total
            self._show(now, final=True)


class _Access:
    """One streamed access of the measured step: CUDA events at its start and
    end, and around each wait (for its weights, for a gradient slot)."""

    __slots__ = ("rec", "backward", "start", "waits", "end")

    def __init__(self, rec, backward, start):
        self.rec, self.backward, self.start, self.waits, self.end = rec, backward, start, [], None


class _Tuner:
    """The automatic plan's state: `warmup` steps, then one measured step,
    then the plan (see Offload._new_step)."""

    def __init__(self, budget, default_budget, depths, group, warmup=1):
        self.phase = "warmup"
        self.warmup = int(warmup)
        self.budget = budget                  # bytes given, or None
        self.default_budget = default_budget  # bytes when none is given
        self.depths = depths                  # ring depths to try (None: the library's)
        self.group = group                    # the planner may group records
        self.saw_train = False
        self.tries = 0
        self.n_measure = 2                    # steps measured; each record's least time is kept
        self.measured = []                    # [(accesses, kind)] of the steps measured
        self.replans = 0                      # plans made again after this handle's first


class _Span:
    """A record's gradient slot, begun and not yet ended."""

    __slots__ = ("rec", "stream", "slot", "written")

    def __init__(self, rec, stream, slot):
        self.rec, self.stream, self.slot, self.written = rec, stream, slot, set()


# --------------------------------------------------------------------------
# CUDA graphs: a capture that torch began (torch.cuda.graph,
# make_graphed_callables), joined by the rings of the handles it calls
# --------------------------------------------------------------------------
# At each capture's start lwo.torch notes the capture's stream and its
# torch.cuda.CUDAGraph, and has every open handle look at its next streamed
# access (Offload._capture_step, reached through _new_step at no cost to the
# accesses of an eager step). The first access in the capture joins the ring
# to it (lwo_ring_capture_join) and makes the graph's capture leave the ring
# (lwo_ring_capture_leave) before torch ends it (cudaStreamEndCapture needs
# the transfer stream joined back). The graph then holds the ring: a replay
# that cannot be right is refused before it launches, and the graph's
# destruction (collected, or reset()) gives the ring back
# (lwo_ring_capture_release).
#
# How lwo.torch learns of those moments depends on the torch (read in each
# release's torch/cuda/graphs.py):
# - torch 2.14.0 on (2.14.0, 2.14.1, 2.15.0): torch's hooks. The module's
#   register_graph_capture_start_hook (its hooks run in
#   CUDAGraph.capture_begin once the capture is live) and
#   register_graph_capture_end_hook; CUDAGraph.capture_end_pre (a Python
#   method that capture_end calls first: lwo.torch replaces it on the one
#   graph object whose capture a ring joined); CUDAGraph's
#   register_replay_start_hook and register_destroy_callback (fired by
#   reset() and by a weakref.finalize of the graph). _capture_hooks "hooks".
# - torch 2.10.0 to 2.13.0 (the GPU machine's 2.11.0 among them): none of
#   these. CUDAGraph's capture_begin, capture_end, replay and reset are
#   Python methods that call those of torch._C._CUDAGraph (torch.cuda.graph's
#   exit and make_graphed_callables call capture_end, which ends the capture
#   in C++). lwo.torch wraps those four, once per process, on
#   torch.cuda.graphs.CUDAGraph (_wrap_cuda_graph): the same functions as the
#   hooks are called at the same moments (capture_begin's wrapper after
#   torch's, capture_end's before torch's and, once it returned, after it,
#   replay's before it, reset's before it), and a graph that holds a ring has
#   a weakref.finalize of its own. With no handle open the wrappers call
#   torch's methods and do nothing else. _capture_hooks "wrappers".
# A capture lwo.torch did not learn of (a raw cudaStreamBeginCapture,
# torch._C._CUDAGraph's own capture_begin, one begun before the first
# offload()) is refused at the first step a streamed module begins in it
# (Offload._refuse_unjoined), before lwo enqueues anything.
_CAPTURES = {}         # raw stream -> weakref of the CUDAGraph whose capture began on it
_capture_hooks = None  # "hooks", "wrappers", or False (neither: this torch has no CUDAGraph)
_hook_handles = ()     # torch's RemovableHandles of the two global hooks ("hooks")
_WRAPPED = ("capture_begin", "capture_end", "replay", "reset")


def _capturing():
    """True while torch's current stream captures a CUDA graph."""
    return torch.cuda.is_current_stream_capturing()


def _capture_stream():
    """The raw stream a capture beginning now captures (torch's current one)."""
    return _raw_stream(torch.cuda.current_device())


def _install_capture_hooks():
    """How lwo.torch learns of captures, chosen once per process (at the
    first offload()): torch's capture hooks where this torch has them all,
    else wrappers of torch.cuda.CUDAGraph's Python methods."""
    global _capture_hooks, _hook_handles
    if _capture_hooks is not None:
        return
    graphs = getattr(torch.cuda, "graphs", None)
    start = getattr(graphs, "register_graph_capture_start_hook", None)
    end = getattr(graphs, "register_graph_capture_end_hook", None)
    cls = getattr(graphs, "CUDAGraph", None)
    if cls is None:  # pragma: no cover - a torch without torch.cuda.graphs
        _capture_hooks = False
    elif start is not None and end is not None and all(
            hasattr(cls, m) for m in ("capture_end_pre", "register_replay_start_hook",
                                      "register_destroy_callback")):
        _hook_handles = (start(_capture_started), end(_capture_ended))
        _capture_hooks = "hooks"
    else:
        _capture_hooks = "wrappers" if _wrap_cuda_graph(cls) else False


def _wrap_cuda_graph(cls):
    """Replaces cls's capture_begin, capture_end, replay and reset (torch's
    Python methods) by wrappers that call them with the same arguments and
    return what they return, and call lwo.torch's functions of the hooks
    around them where an lwo.torch handle takes part. False (nothing
    changed) if cls lacks one of them."""
    orig = {}
    for name in _WRAPPED:
        f = getattr(cls, name, None)
        if f is None:
            return False
        orig[name] = f
    if getattr(orig["capture_begin"], "_lwo_wraps", None) is not None:
        return True  # already wrapped (this class, or one it derives from)
    t_begin, t_end, t_replay, t_reset = (orig[n] for n in _WRAPPED)  # torch's

    def capture_begin(self, *args, **kwargs):
        r = t_begin(self, *args, **kwargs)
        if _LIVE_HANDLES:
            try:
                _capture_started(self)
            except Exception:  # pragma: no cover - as torch's hook runner: the capture is live
                pass
        return r

    def capture_end(self, *args, **kwargs):
        d = getattr(self, "__dict__", None)
        holds = d.pop("_lwo_holds", None) if d else None
        if holds:
            r = _end_capture(self, holds, lambda: t_end(self, *args, **kwargs))
        else:
            r = t_end(self, *args, **kwargs)
        if _CAPTURES:
            _capture_ended(self)
        return r

    def replay(self, *args, **kwargs):
        d = getattr(self, "__dict__", None)
        if d:
            hooks = d.get("_lwo_replay")
            if hooks:
                for hook in list(hooks):
                    hook(self)  # raises to refuse the replay (nothing launched)
        return t_replay(self, *args, **kwargs)

    def reset(self, *args, **kwargs):
        d = getattr(self, "__dict__", None)
        if d:
            fin = d.pop("_lwo_finalizer", None)
            if fin is not None:
                fin()  # the destroy callbacks, once (as torch's reset() fires them first)
        return t_reset(self, *args, **kwargs)

    for name, w in zip(_WRAPPED, (capture_begin, capture_end, replay, reset)):
        f = orig[name]
        w.__name__ = name
        w.__qualname__ = "%s.%s" % (cls.__qualname__, name)
        w.__doc__ = getattr(f, "__doc__", None)
        w.__wrapped__ = f
        w._lwo_wraps = f
        setattr(cls, name, w)
    return True


def _unwrap_cuda_graph(cls):
    """Puts cls's own methods back (tests)."""
    for name in _WRAPPED:
        f = cls.__dict__.get(name)
        if f is not None and getattr(f, "_lwo_wraps", None) is not None:
            setattr(cls, name, f._lwo_wraps)


def _fire_destroyed(callbacks):
    """The graph's destroy callbacks ("wrappers"), fired once: by its reset()
    or as it is collected (a weakref.finalize, which holds this list, never
    the graph). Their errors are swallowed, as torch's are."""
    for cb in list(callbacks):
        try:
            cb()
        except Exception:
            pass
    callbacks.clear()


def _graph_callbacks(graph, replay_started, destroyed):
    """Registers a graph's replay start hook and destroy callback: torch's
    ("hooks"), or the wrappers' ("wrappers": kept in the graph's __dict__,
    the callbacks under a weakref.finalize of the graph).
    Returns what removes the replay start hook (called once the graph was
    destroyed or reset: a graph object captured again after reset() replays
    without it)."""
    if _capture_hooks == "hooks":
        handle = graph.register_replay_start_hook(replay_started)
        graph.register_destroy_callback(destroyed)
        return handle.remove
    d = graph.__dict__
    hooks = d.setdefault("_lwo_replay", [])
    hooks.append(replay_started)
    fin = d.get("_lwo_finalizer")
    if fin is None or not fin.alive:
        callbacks = d["_lwo_destroy"] = []
        d["_lwo_finalizer"] = weakref.finalize(graph, _fire_destroyed, callbacks)
    d["_lwo_destroy"].append(destroyed)

    def unhook():
        if replay_started in hooks:
            hooks.remove(replay_started)
    return unhook


def _open_handles():
    return any(not h.closed and h.ring is not None for h in _LIVE_HANDLES)


def _capture_started(graph):
    """A capture began (torch's start hook, or capture_begin's wrapper), live
    on the current stream: nothing here enqueues device work."""
    if not _open_handles():
        return
    for h in list(_LIVE_HANDLES):
        if not h.closed and h.ring is not None:
            h._capture_begun()
    _CAPTURES[_capture_stream()] = weakref.ref(graph)


def _capture_ended(graph):
    """A capture ended (torch's end hook, or capture_end's wrapper once
    torch's returned; neither runs when the end failed: a stale entry is only
    ever looked up while its stream captures)."""
    for raw, ref in list(_CAPTURES.items()):
        g = ref()
        if g is None or g is graph:
            del _CAPTURES[raw]


def _end_before_torch(graph, hold):
    """Makes the capture of `graph` leave `hold`'s ring before torch ends it.
    "hooks": the graph's capture_end_pre (which capture_end and
    torch.cuda.graph's exit call) is replaced on this graph object until the
    capture ends. "wrappers": capture_end's wrapper finds the holds."""
    d = graph.__dict__
    holds = d.get("_lwo_holds")
    if holds is None:
        holds = d["_lwo_holds"] = []
        if _capture_hooks == "hooks":
            ref = weakref.ref(graph)
            prev = d.get("capture_end_pre")
            d["capture_end_pre"] = lambda: _capture_end_pre(ref, prev)
    holds.append(hold)


def _capture_end_pre(ref, prev):
    """The graph's capture_end_pre while rings joined its capture ("hooks"):
    the graph's own is put back, and _end_capture ends the capture with it."""
    graph = ref()
    d = graph.__dict__
    holds = d.pop("_lwo_holds", [])
    if prev is None:
        d.pop("capture_end_pre", None)
        end = lambda: type(graph).capture_end_pre(graph)  # noqa: E731
    else:
        d["capture_end_pre"] = prev
        end = prev
    return _end_capture(graph, holds, end)


def _end_capture(graph, holds, end):
    """Each ring leaves the capture (releasing what it still holds, in the
    capture), then end() (torch's) ends it; the graph holds the rings from
    then on. If torch cannot end it, the rings are given back."""
    first = None
    for hold in holds:
        try:
            hold.handle._leave_capture(hold)
        except BaseException as e:  # torch ends its capture all the same
            first = first or e
    try:
        r = end()
    except BaseException:
        for hold in holds:
            hold.handle._capture_failed(hold)
        raise
    for hold in holds:
        hold.handle._graph_bound(hold, graph)
    if first is not None:
        raise first
    return r


class _GraphHold:
    """One torch CUDA graph whose capture a handle's ring joined: from the join
    (state "joined") and the leave ("held": the graph holds the ring) to the
    release ("released"), or "dropped" where the capture ended without the
    ring. The graph's replay hook and destroy callback hold this, never the
    graph (torch's rule for them); `graph` is a weak reference."""

    __slots__ = ("handle", "graph", "stream", "state", "streams", "watch", "planner", "stats",
                 "error", "why", "gone", "unhook", "train", "fresh", "got", "warm", "exposed")

    def __init__(self, handle, graph, stream):
        self.handle = handle
        self.graph = weakref.ref(graph)
        self.stream = stream     # the capture's stream (raw)
        self.state = "joined"
        self.streams = []        # raw streams the graph was replayed on, the last one last
        self.watch = ()          # (record, its version at the capture) a replay reads as it was
        self.planner = None      # the prefetch planner's state before the capture
        self.stats = False       # the handle's stats= before the capture
        self.error = None        # what lwo.torch refused in the capture (it is then void)
        self.why = None          # what released the ring
        self.gone = False        # the graph was collected or reset
        self.unhook = None       # removes the graph's replay start hook (_graph_callbacks)
        self.train = False       # a training step: its gradients' host side at each replay
        self.fresh = False       # ... captured on new sums (each replay starts new ones)
        self.got = set()         # ... the modules whose gradients it sends
        self.warm = []           # streamed records the capture read where they were
        self.exposed = None      # ... the pairs each replay sets as param.grad (_expose_replayed)

    def replay_started(self, graph):
        """torch's replay start hook of the graph: refuses a replay that would
        read a ring the graph no longer holds, or records that changed since
        the capture where a replay cannot see the change; notes the replay's
        stream (the release is ordered after it)."""
        h = self.handle
        if self.state != "held":
            raise StateError(C.LWO_ERR_CAPTURING, (
                "lwo.torch: torch.cuda.CUDAGraph.replay: this graph captured streamed modules "
                "of an lwo.torch handle, and no longer holds that handle's ring (%s): capture "
                "the model again") % (self.why or "its capture failed"))
        for rec, v in self.watch:
            now = rec.current_version()
            if now != v:
                raise StateError(C.LWO_ERR_BUSY, (
                    "lwo.torch: torch.cuda.CUDAGraph.replay: record %d (%s) of the captured "
                    "model was written after the capture (its parameters' version went from "
                    "%d to %d), and a replay reads it as it was then: it is %s. Release the "
                    "graph (del graph, graph.reset() or handle.release_graph()) and capture "
                    "again; writes to streamed records are seen by the next replay") % (
                        rec.index, rec.name, v, now,
                        "resident on the device" if rec.resident else
                        "quantized in the pool from its parameter at its stage"
                        if rec.quantized else "a checkpoint's record"))
        for rec in self.warm:  # a write through a parameter: the replay copies it again
            v = rec.current_version()
            if v != rec.version:
                h._layer_changed(rec)
                rec.version = v
        st = h._cur_stream(h._dev_index)
        if self.train:
            h._replay_step(self, st)
        else:
            h._replay_pass(st)
        s = self.streams
        if not s or s[-1] != st:
            if st in s:
                s.remove(st)
            s.append(st)

    def destroyed(self):
        """torch's destroy callback of the graph (collected, or reset()): the
        ring goes back now, or at the handle's next call if it cannot yet.
        The replay start hook goes (reset() then a capture again: the graph
        object replays its new capture)."""
        self.gone = True
        unhook, self.unhook = self.unhook, None
        if unhook is not None:
            unhook()
        try:
            if not self.handle.closed:
                self.handle._release_hold(self, "the graph was destroyed or reset")
        except Exception:
            pass  # retried by the handle's next streamed access


# --------------------------------------------------------------------------
# The handle
# --------------------------------------------------------------------------
class Offload:
    """What :func:`offload` returns: the pool, ring and gradient set of one
    model, and its streamed modules. A context manager; close() puts the
    weights back into ordinary tensors."""

    _checkpoint = None     # offload(checkpoint=): where the weights come from

    # The streamed linear's forward calls lwo_linear_forward itself
    # (_lin_raw: the ctypes function and the engine) where the backend's
    # linear_forward is its own; a linear_forward set on the handle
    # (_lin_fwd) is called instead from then on.
    @property
    def _lin_fwd(self):
        return self._lin_py

    @_lin_fwd.setter
    def _lin_fwd(self, fn):
        self._lin_py = fn
        self._lin_raw = None
    checkpoint_info = None  # offload(checkpoint=): what came from the checkpoint (a dict)

    def __init__(self):
        raise TypeError("lwo.torch.Offload: use lwo.torch.offload(model, ...)")

    # ----------------------------------------------------------------
    # Setup
    # ----------------------------------------------------------------
    @classmethod
    def _create(cls, model, targets, groups, depth, grads_depth, device, stats, timing,
                backend, skipped, quant=None, quant_skipped=None, progress=None, source=None,
                dist=None, quant_trainable=False):
        self = object.__new__(cls)
        self.closed = False
        self._quant_trainable = bool(quant_trainable)
        if dist is not None:
            self._join_group(dist)
        self._checkpoint = source
        quant = quant or {}
        self.quantized = {name: _core.quant_spelling(f) for name, f in quant.items()}
        self.quant_skipped = dict(quant_skipped or {})
        self.model_ref = weakref.ref(model)
        self.backend = backend
        self.device = device
        self.depth = int(depth)
        self.grads_depth = int(grads_depth)
        self.skipped = skipped
        self._stats_on = bool(stats)
        self._timing = bool(timing)
        self._events = []
        self._dev_index = device.index if device.type == "cuda" else -1
        self._cur_stream = backend.current_stream
        self._lin_fwd = backend.linear_forward
        raw = getattr(backend, "raw_linear_forward", None)
        self._lin_raw = raw() if raw is not None else None

        # Records: one per group key, in the order their first module comes.
        records, by_key = [], {}
        states = []
        for name, m in targets:
            key = groups.get(name, name)
            fmt = quant.get(name, C.LWO_QUANT_NONE)
            if fmt and isinstance(key, tuple):
                # A group's quantized modules make a record of their own (its
                # records' sizes and copy rates are the plan's to weigh apart
                # from the dense ones); it moves in one copy all the same.
                key = key + (fmt,)
            rec = by_key.get(key)
            if rec is None:
                rname = str(key[1]) if isinstance(key, tuple) else key
                if fmt and isinstance(key, tuple):
                    rname = "%s [%s]" % (rname, _core.quant_spelling(fmt))
                rec = _Record(len(records), rname)
                rec.quantized = bool(fmt)
                by_key[key] = rec
                records.append(rec)
            s = _Module()
            s.handle, s.name, s.module, s.record = self, name, m, rec
            s.kind = "linear" if isinstance(m, nn.Linear) else "conv"
            s.quant = fmt
            rec.modules.append(s)
            states.append(s)
        self.records = records
        self.states = states

        if source is not None:  # offload(checkpoint=): mapped, or pinned
            self.pool = source.pool(self, backend, records)
        else:
            self.pool = self._new_pool(self._pool_layers(records))

        # Fill it, and make the parameters CPU tensors over it.
        freed_cuda = False
        total = sum(s.module.weight.numel() * s.module.weight.element_size() for s in states)
        bar = _Progress(source.progress_label if source is not None else
                        "lwo.torch.offload: %s weights into the pool" % (
                            "quantizing and copying" if quant else "copying"), total, progress)
        with torch.no_grad():
            for rec in records:
                infos = self.pool.tensors(rec.index)
                rec.bytes = self.pool.record_bytes(rec.index)
                for s in rec.modules:
                    m = s.module
                    w = m.weight
                    bar.add(w.numel() * w.element_size())
                    s.dtype = w.dtype
                    s.lwo_dtype = _LWO_DTYPE[w.dtype]
                    # the tensors' true shapes (a parameter split over ranks is
                    # this rank's elements, flat: see param_shards)
                    s.w_shape = tuple(w.shape)
                    s.b_shape = tuple(m.bias.shape) if m.bias is not None else None
                    self._bind(s, infos)
                    if s.quant:
                        s.weight = self._adopt_quantized(m, rec, s)
                        rec.saved_bytes += w.numel() * w.element_size() - s.w_bytes
                    else:
                        s.weight = self._adopt(m, "weight", rec, s.w_idx)
                    freed_cuda |= w.is_cuda
                    s.has_bias = m.bias is not None
                    if s.has_bias:
                        freed_cuda |= m.bias.is_cuda
                        s.bias = self._adopt(m, "bias", rec, s.b_idx)
                    else:
                        s.bias = None
                    rec.params += [p for p in (s.weight, s.bias) if p is not None]
                    if s.kind == "linear":
                        s.in_f, s.out_f = m.in_features, m.out_features
                        s.desc = backend.linear_desc(s.in_f, s.out_f, s.lwo_dtype, s.has_bias,
                                                     weight_format=s.quant)
                        s.desc_acc = backend.linear_desc(s.in_f, s.out_f, s.lwo_dtype,
                                                         s.has_bias, accumulate=True,
                                                         weight_format=s.quant)
                    else:
                        s.in_f, s.out_f = m.in_channels, m.out_channels
                        s.padding = _conv_padding(m)
                        s.desc = backend.conv_desc(m, s.lwo_dtype, s.has_bias, s.padding,
                                                   weight_format=s.quant)
                        s.desc_acc = backend.conv_desc(m, s.lwo_dtype, s.has_bias, s.padding,
                                                       accumulate=True, weight_format=s.quant)
                        s.out_sizes = {}
                rec.version = rec.current_version()
                rec.trainable = any(p.requires_grad for p in rec.params)
        bar.done()

        self._init_state([s.record.index for s in states])
        self.ring = backend.ring(self.pool, self.depth, self._timing)
        _install_capture_hooks()
        self._make_grads()

        # The modules become streamed ones (each with its id for the custom
        # operators that torch.compile records).
        _torch_compile.register()
        for s in states:
            m = s.module
            _torch_compile.add(s)
            m._lwo_state = s
            m.__class__ = _streamed_class(type(m))
        if freed_cuda and torch.cuda.is_available():
            torch.cuda.empty_cache()
        return self

    @staticmethod
    def _pool_layers(records):
        """The pool's layers of `records`: tensors m<i>.weight / m<i>.bias, i
        the module's place in its record (sets each module's w_idx, b_idx
        and each record's names)."""
        layers = []
        for rec in records:
            tensors = []
            rec.names = []
            for i, s in enumerate(rec.modules):
                w = s.module.weight
                # the dtype lwo computes in (once streamed: an fp8 weight of a
                # checkpoint is a parameter of its codes)
                dt = _LWO_DTYPE[getattr(s, "dtype", None) or w.dtype]
                tensors.append(_core.TensorSpec("m%d.weight" % i, dt, _quant_shape(w), None,
                                                s.quant)
                               if s.quant else ("m%d.weight" % i, dt, tuple(w.shape)))
                rec.names.append("m%d.weight" % i)
                s.w_idx = len(tensors) - 1
                b = s.module.bias
                if b is not None:
                    tensors.append(("m%d.bias" % i, _LWO_DTYPE[b.dtype], tuple(b.shape)))
                    rec.names.append("m%d.bias" % i)
                    s.b_idx = len(tensors) - 1
                else:
                    s.b_idx = -1
            layers.append(tensors)
        return layers

    @staticmethod
    def _bind(s, infos):
        """A module's offsets and sizes in its record (infos: the pool's
        tensors of the record)."""
        s.w_off = infos[s.w_idx].offset
        s.w_bytes = infos[s.w_idx].bytes
        if s.b_idx >= 0:
            s.b_off = infos[s.b_idx].offset
            s.b_bytes = infos[s.b_idx].bytes
        else:
            s.b_off = s.b_bytes = 0

    def _init_state(self, order):
        """The state of streaming, gradients and the plan, before the first
        step (order: the record of each module, in registration order)."""
        self.grads = None
        self._grad_views = {}
        self.resident = ()         # record indices kept on the device
        self._tuner = None         # the automatic plan, until applied
        self._cal = None           # the measured step's accesses
        self._steps_seen = 0       # the planner's step count at the last step start
        self._step_events = collections.deque(maxlen=64)  # [kind, start, end] per step
        self.plan_info = None      # the plan applied (a dict), see offload()
        self.plans = []            # every plan applied, in order (plan_info the last)
        self._watch = None         # the applied plan's prediction, watched each step
        self._plan_args = None     # (budget given, default budget, depths) of the plan
        self.planner = Planner(order)
        self._held = None          # (record, ticket, stream, base) acquired and kept
        self._prefetched = {}      # record index -> (ticket, version), staged ahead
        self._cal_pool = []        # timing events made ahead for the measured steps
        self._live = 0             # tickets staged or held
        self._span = None          # the gradient slot being written
        self._cb_tasks = set()     # graph tasks whose end callback is queued
        self._got_grad = set()     # modules whose dW was sent since the last zero
        self._exposed = {}         # param -> its host gradient tensor, set as param.grad
        self._exposed_gen = 0      # counts the times _exposed was emptied or remapped
        self._grad_dtypes = {}     # param -> its grad_dtype before its f32 host gradient
        self._carry = {}           # (record, tensor) -> a sum to add after the next fence
        self._pass_layers = set()  # records whose dW this backward pass sent
        self._optims = []          # lwo.torch.optim bindings over the gradient set
        self._open_optims = ()     # those whose step is open in this backward pass
        self._add_after = None     # a record to add to them after this node's dx
        self._count_nodes = False  # count each record's nodes (an in_backward step opens)
        # CUDA graphs (see "CUDA graphs" above Offload): a capture began, or a
        # graph holds the ring, so the next access goes to _capture_step
        # (_steps_seen is -1 meanwhile, _steps_real its value)
        self._cap_check = False
        self._steps_real = 0
        self._cap_planner = None   # the planner's state as the capture began
        self._joined = None        # the _GraphHold of the capture the ring is in
        self._hold = None          # the _GraphHold of the graph that holds the ring
        # a step start asks whether the current stream captures a graph that
        # nothing noticed (_refuse_unjoined): CUDA backends (a test backend
        # may say capture_guard)
        be = self.backend
        self._cap_guard = bool(getattr(be, "capture_guard", be.device_type == "cuda"))
        _LIVE_HANDLES.add(self)

    @classmethod
    def _create_empty(cls, model, device, backend, skipped):
        """A handle that streams nothing (every candidate left to PyTorch)."""
        self = object.__new__(cls)
        self.closed = False
        self.quantized, self.quant_skipped = {}, {}
        self._quant_trainable = False
        self.model_ref = weakref.ref(model)
        self.backend, self.device, self.skipped = backend, device, skipped
        self.depth, self.grads_depth = 0, 0
        self._stats_on = self._timing = False
        self._events = []
        self._dev_index = device.index if device.type == "cuda" else -1
        self.records, self.states = [], []
        self.pool = self.ring = None
        self._init_state([])
        return self

    def _setup_plan(self, budget, depth, may_group):
        """Checks the budget against the smallest ring and arms the
        automatic plan (see offload(plan=))."""
        be = self.backend
        free = be.free_bytes() if hasattr(be, "free_bytes") else None
        given = _tune.parse_budget(budget, free, "lwo.torch.offload: budget")
        max_rec = max(r.bytes for r in self.records)
        max_tr = max([r.bytes for r in self.records if r.trainable] + [0])
        staging = self.grads_depth * max_tr
        total = sum(r.bytes for r in self.records)
        if given is not None:
            model_bytes = self._device_bytes_of_model()
            ws = be.workspace_bytes()
            need = max_rec + staging + model_bytes + ws
            if given < need:
                self.close()
                raise _errors.ResourceError(C.LWO_ERR_OVER_BUDGET, (
                    "lwo.torch.offload: budget %s (%d bytes) cannot hold a plan: it needs at "
                    "least %s (%d bytes): a ring of one slot of the largest record (%s), %d "
                    "gradient staging slots (%s), what the model keeps on the device (%s) "
                    "and lwo's workspaces (%s)") % (
                        _tune.format_bytes(given), given, _tune.format_bytes(need), need,
                        _tune.format_bytes(max_rec), self.grads_depth,
                        _tune.format_bytes(staging), _tune.format_bytes(model_bytes),
                        _tune.format_bytes(ws)))
            if depth is None and given - model_bytes - ws < 2 * max_rec + staging:
                self._apply([(i, 1, False) for i in range(len(self.records))], 1)
        default = max(total // 3, self._smallest_ring())
        depths = [int(depth)] if depth else None
        self._plan_args = (given, default, depths)
        self._tuner = _Tuner(given, default, depths, may_group)

    def _smallest_ring(self):
        """Two slots of the largest record and the gradient staging slots of
        the largest trainable one."""
        max_rec = max([r.bytes for r in self.records] + [0])
        max_tr = max([r.bytes for r in self.records if r.trainable] + [0])
        return 2 * max_rec + self.grads_depth * max_tr

    def _dw_ready(self, s):
        """Before a forward with a backward (the custom operator's, under
        torch.compile; the autograd Functions do it inline): a module that
        needs dW is one whose weights may train (else the error), in the
        gradient set (made again if its record was not)."""
        if s.needs_dw():
            if s.quant and not self._quant_trains(s):
                _refuse_quantized_grad(s)
            if not s.record.trainable:
                self._make_grads(extra=s.record)

    def _quant_trains(self, s):
        """Module s streams quantized and may train (quant_trainable=, a
        format that trains)."""
        return self._quant_trainable and s.quant in _TRAINABLE_QUANT

    def _adopt_quantized(self, m, rec, s):
        """Quantizes m.weight into the pool (lwo_pool_write_quantized) and makes
        the parameter a CPU tensor of the dequantized weight (what lwo
        computes with: lwo_dequantize_host of the pool's bytes), frozen; a
        trainable one (quant_trainable=) keeps its own values instead, as
        the master its quantization is made from."""
        if self._checkpoint is not None:
            return self._checkpoint.adopt_quantized(self, m, rec, s)
        old = m._parameters["weight"]
        name = rec.names[s.w_idx]
        shape2 = _quant_shape(old)
        src = old.detach().to("cpu").contiguous().view(shape2)
        self.pool.write_quantized(rec.index, name, src)
        if old.requires_grad:
            p = nn.Parameter(src.clone().view(tuple(old.shape)), requires_grad=True)
            m._parameters["weight"] = p
            return p
        dense = torch.empty(shape2, dtype=old.dtype)
        _dequantize_host(self.pool, rec.index, name, s.quant, old.dtype, dense)
        p = nn.Parameter(dense.view(tuple(old.shape)), requires_grad=False)
        m._parameters["weight"] = p
        return p

    def _layer_changed(self, rec):
        """A record's parameters were written: copy it again at its next stage;
        a quantized weight is quantized again from its parameter first, and
        lwo.torch.optim's masters of a trainable one are set from it."""
        for b in self._optims:
            b.params_written(rec)
        if self._checkpoint is not None and self._checkpoint.layer_changed(self, rec):
            return
        if rec.quantized:
            for s in rec.modules:
                if s.quant:
                    self.pool.write_quantized(rec.index, rec.names[s.w_idx],
                                              s.weight.detach().contiguous().view(
                                                  _quant_shape(s.weight)))
        self.backend.layer_changed(self.pool, rec.index)

    def _adopt(self, m, key, rec, idx):
        if self._checkpoint is not None:
            return self._checkpoint.adopt(self, m, key, rec, idx)
        old = m._parameters[key]
        host, first = self._param_home(self.pool, rec.index, rec.names[idx], old.dtype,
                                       tuple(old.shape))
        src = old.detach()
        if host.shape != src.shape:  # split over ranks: this rank's elements
            src = src.reshape(-1)[first:first + host.numel()]
        host.copy_(src)
        p = nn.Parameter(host, requires_grad=old.requires_grad)
        m._parameters[key] = p
        return p

    def _new_pool(self, layers):
        """The pool of `layers`: pinned, or with a process group this rank's
        shard of every record (made collectively over lwo's communicator)."""
        if self.comm is not None:
            return self.backend.sharded_pool(layers, self.shard_comm)
        return self.backend.pool(layers)

    @staticmethod
    def _param_home(pool, layer, name, dtype, shape):
        """(tensor, first element) of a dense parameter's home in `pool`: a
        CPU tensor over this rank's elements of the tensor
        (lwo_pool_shard_tensor), no copy. In a pool that is not sharded, or
        sharded over one rank, the whole tensor in its `shape`; in a pool
        sharded over several, elements [first, first + n) in row-major order
        as a flat tensor of n (n may be 0): the parameter split over ranks."""
        sh = pool.shard_tensor(layer, name)
        esize = torch.empty((), dtype=dtype).element_size()
        if pool.info().n_ranks > 1:
            return _host_tensor(sh.address, sh.n_elements * esize, dtype, (sh.n_elements,),
                                pool), sh.first_element
        if sh.first_element != 0 or sh.n_elements != math.prod(shape):
            raise RuntimeError(
                "lwo.torch: layer %d tensor %r: a pool of one rank holds elements [%d, %d) of "
                "its %d" % (layer, name, sh.first_element, sh.first_element + sh.n_elements,
                            math.prod(shape)))
        return _host_tensor(sh.address, sh.n_elements * esize, dtype, shape, pool), 0

    def param_shards(self):
        """Each streamed parameter's place, by its name in the model's
        state_dict ("fc1.weight"): ``ParamShard(shape, first, n)``, the
        tensor's full shape and the elements [first, first + n) of it (in
        row-major order) that this rank's parameter holds. Without a group,
        or with a pool sharded over one rank, every parameter is its whole
        tensor (first 0, n its numel); over several ranks (offload(
        process_group=) with node_size > 1) each is a flat tensor of its
        rank's n elements, possibly 0."""
        out = collections.OrderedDict()
        for rec in self.records:
            for s in rec.modules:
                for p, idx, shape, key in ((s.weight, s.w_idx, s.w_shape, "weight"),
                                           (s.bias, s.b_idx, s.b_shape, "bias")):
                    if p is None:
                        continue
                    first, n = self._shard_of(rec.index, rec.names[idx])
                    out[_qualified(s.name, key)] = ParamShard(shape, first, n)
        return out

    def _split(self):
        """The streamed parameters are split over ranks (a pool sharded over
        several): each is its rank's elements, flat."""
        return self.comm is not None and self.pool is not None and \
            self.pool.info().n_ranks > 1

    def _shard_of(self, layer, name):
        """(first element, count) of this rank's part of a tensor: of its
        weights, its gradient and lwo.torch.optim's state alike (a quantized
        weight, never sharded: all of its dense elements)."""
        rec = self.records[layer]
        for s in rec.modules:
            if s.quant and rec.names[s.w_idx] == name:
                return 0, math.prod(s.w_shape)
        sh = self.pool.shard_tensor(layer, name)
        return sh.first_element, sh.n_elements

    def _make_grads(self, extra=None):
        """Creates the gradient set over the trainable records (and `extra`,
        a record whose parameters became trainable after offload(): the set
        is made again, the sums so far carried over)."""
        if extra is not None and self._checkpoint is not None:
            self._checkpoint.refuse_grad(self, extra)
        old_mask = [rec.trainable for rec in self.records]
        mask = list(old_mask)
        if extra is not None:
            mask[extra.index] = True
        if not any(mask):
            return
        old = self.grads
        if old is not None:
            if self._span is not None:
                self._end_span()
            for b in list(self._optims):
                b.detach()
            old.wait()
        grads = self._new_grads(self.pool, mask)
        old_views = self._grad_views
        self._grad_views = {}
        if old is not None:
            # The new set starts its layers afresh: its next gradient of a
            # layer lands in place of what the host buffer holds. So the sums
            # so far are copied in (param.grad reads them until then) and kept
            # aside, to be added after the next fence to each layer that got a
            # gradient in that pass (_backward_ended).
            for rec, was in zip(self.records, old_mask):
                if not was:
                    continue
                for name in rec.names:
                    src = old_views.get((rec.index, name))
                    if src is None:
                        src = self._grad_view(rec.index, name, old)
                        self._grad_views.pop((rec.index, name), None)
                    self._grad_view(rec.index, name, grads).copy_(src)
                    self._carry[(rec.index, name)] = src.clone()
            # what this pass sent so far is in those sums: only the layers
            # sent from here on land afresh
            self._pass_layers = set()
            keys = self._param_key
            self._exposed_gen += 1
            for p, t in list(self._exposed.items()):
                nt = self._grad_views[keys[p]].view(t.shape)
                self._exposed[p] = nt
                if p.grad is t:
                    p.grad = nt
        self.grads = grads
        for rec, m in zip(self.records, mask):
            rec.trainable = m
        for b in list(self._optims):
            b.attach()

    def _new_grads(self, pool, mask):
        """The gradient set of `pool`'s layers in `mask`: with a group over
        several nodes, summed over the nodes' replicas too (the replica
        communicator), its host threads this rank's share of the node's."""
        return self.backend.grads(pool, mask, self.grads_depth, n_threads=self._host_threads,
                                  replica_comm=self.replica_comm)

    def _grad_view(self, layer, name, grads=None):
        key = (layer, name)
        t = self._grad_views.get(key)
        if t is None:
            g = grads or self.grads
            addr, dt, n = g.tensor(layer, name)
            tdt = _TORCH_DTYPE.get(dt)
            if tdt is None:
                raise TypeError("lwo.torch: a gradient buffer of lwo dtype %s" % dt)
            t = _host_tensor(addr, n * torch.empty((), dtype=tdt).element_size(), tdt, (n,),
                             g)
            self._grad_views[key] = t
        return t

    @property
    def _param_key(self):
        keys = {}
        for rec in self.records:
            for s in rec.modules:
                keys[s.weight] = (rec.index, rec.names[s.w_idx])
                if s.bias is not None:
                    keys[s.bias] = (rec.index, rec.names[s.b_idx])
        return keys

    # ----------------------------------------------------------------
    # The ring
    # ----------------------------------------------------------------
    def _stream(self, x):
        return self.backend.current_stream(self._dev_index)

    def _enter(self, s, grad):
        """A forward access of module s: observed by the prefetch planner; the
        first of a step starts it (_new_step). Returns s's record."""
        rec = s.record
        rec.n_accesses += 1
        planner = self.planner
        between = planner.kind is None
        planner.observe(rec.index, grad, _graph_task_id() != -1)
        if not grad:
            rec.unsafe = True  # its node count is unsure in this step (see _end_span)
        elif self._joined is not None and not self._joined.train:
            self._refuse_in_capture(s, "a forward whose output needs a gradient, after the "
                                    "capture's first streamed module ran without one (a "
                                    "training step's sums start at its first)")
        if between or planner.steps != self._steps_seen:
            rec = self._new_step(s, grad)
        return rec

    def _observe(self, rec, grad, in_backward):
        rec.n_accesses += 1
        self.planner.observe(rec.index, grad, in_backward)

    def _stage(self, rec, stream):
        if not self._stats_on:
            if self._joined is not None and not rec.resident:
                return self._stage_in_capture(rec)
            t = self.ring.stage(rec.index)
        else:
            t = self._stage_measured(rec)
        if not rec.resident:
            self._live += 1
        return t

    def _stage_in_capture(self, rec):
        """A streamed record's stage in a capture: a hit reads what the slot
        held before the capture (the ring captures warm), so each replay's
        start hook checks the record's parameters for writes first (a write
        through a parameter reaches the pool's version only at a stage)."""
        hits = self.ring.stats().n_hits
        t = self.ring.stage(rec.index)
        if self.ring.stats().n_hits > hits and rec not in self._joined.warm:
            self._joined.warm.append(rec)
        self._live += 1
        return t

    def _release(self, rec, ticket, stream):
        if not rec.resident:
            self._live -= 1
        self.ring.release(ticket, stream)

    def _acquire(self, rec, stream):
        """The device address of `rec`'s record, acquired on `stream`."""
        held = self._held
        if held is not None:
            if held[0] is rec and held[2] == stream:
                return held[3]
            self._held = None
            self._release(held[0], held[1], held[2])
        v = rec.current_version()
        ent = self._prefetched.pop(rec.index, None)
        if ent is not None and ent[1] != v:
            self._release(rec, ent[0], stream)  # staged before a write: copy again
            ent = None
        if v != rec.version:
            self._layer_changed(rec)
            rec.version = v
        if ent is None:
            while not rec.resident and self._live >= self.depth and self._prefetched:
                r_old, (t_old, _v) = self._prefetched.popitem()  # the farthest ahead
                self._release(self.records[r_old], t_old, stream)
            t = self._stage(rec, stream)
        else:
            t = ent[0]
        if self._cal is not None:
            w0 = self._cal_event()
            base = self._acquire_measured(rec, t, stream) if self._stats_on else \
                self.ring.acquire(t, stream)
            self._cal_wait(w0)
        elif self._stats_on:
            base = self._acquire_measured(rec, t, stream)
        else:
            base = self.ring.acquire(t, stream)
        self._held = (rec, t, stream, base)
        if self._live < self.depth:
            self._prefetch(stream)  # queue the next copies before this compute
        return base

    def _after(self, rec, stream):
        """After a call of `rec`'s module: release it unless the plan says it
        comes again next, then stage what the plan says comes next."""
        held = self._held
        if held is not None:
            if self.planner.next_is(rec.index):
                # kept for the next access: nothing was released since the
                # acquire that prefetched at this run of accesses
                return
            self._held = None
            self._release(held[0], held[1], held[2])
        if self._live < self.depth:
            self._prefetch(stream)

    def _prefetch(self, stream):
        """Stages the records the plan names next into the free slots."""
        planner = self.planner
        held = self._held
        room = self.depth - self._live
        pre = self._prefetched
        for idx, next_step in planner.upcoming(self.depth + len(self.resident),
                                               exclude=held[0].index if held else None):
            if idx in pre:
                continue
            r = self.records[idx]
            if next_step and (r.trainable and planner.kind != _FORWARD or
                              self._joined is not None):
                # A training step's optimizer writes trainable records before
                # the next step: copying them now would be wasted (a write
                # is caught all the same: the version check stages again).
                # In a CUDA graph capture the next step is not in the graph.
                break
            v = r.current_version()
            if v != r.version:
                self._layer_changed(r)
                r.version = v
            try:
                t = self._stage(r, stream)
            except StateError:
                break
            pre[idx] = (t, v)
            if r.resident:
                # Its own slot: a hit, or (written since: lwo.torch.optim's
                # update of a trainable record) its copy, queued ahead of its
                # compute like a streamed record's. It takes no room.
                continue
            room -= 1
            if room <= 0:
                break

    def _unstage_trainable(self):
        """Releases what is staged of trainable records (lwo.torch.optim
        calls it before a step: a copy made before the update holds the old
        weights)."""
        held = self._held
        if held is not None and held[0].trainable:
            self._release_all()
        cur = None
        for idx in [i for i in self._prefetched if self.records[i].trainable]:
            t, _v = self._prefetched.pop(idx)
            if cur is None:
                cur = self.backend.current_stream(self._dev_index)
            self._release(self.records[idx], t, cur)

    def _release_all(self):
        held = self._held
        if held is not None:
            self._held = None
            self._release(held[0], held[1], held[2])

    # ----------------------------------------------------------------
    # The automatic plan: steps, measurement, the library's planner
    # ----------------------------------------------------------------
    def _new_step(self, s, grad):
        """The first access of a step (already observed by the prefetch
        planner): notes the step, and drives the automatic plan: after the
        warm-up steps one step is measured, and at the start of the step
        after it the plan is made and applied. Returns s's record (a new
        one if the records were rebuilt)."""
        if self._cap_check:
            got = self._capture_step(s, grad)
            if got is not None:
                return got
        elif self._cap_guard and _capturing():
            self._refuse_unjoined(s)
        planner = self.planner
        self._steps_seen = planner.steps
        tuner = self._tuner
        ev = self._step_events
        start = self.backend.event()
        if ev and ev[-1][2] is None:  # a forward-only step ends where this one begins
            ev[-1][0] = "forward"
            ev[-1][2] = start
        ev.append([None, start, None])
        if _graph_task_id() != -1:
            return s.record
        if tuner is None:
            if self._watch is None:
                return s.record
            tuner = self._drifted()
            if tuner is None:
                return s.record
        tuner.saw_train |= planner.last_kind == _TRAIN
        if tuner.phase == "warmup" and planner.steps >= tuner.warmup:
            tuner.phase = "measure"
            self._cal_begin()
        elif tuner.phase == "measure":
            # a step measured ends here; an evaluation step between training
            # steps is measured again (a few times at most)
            kind = planner.last_kind
            if kind == _TRAIN or not tuner.saw_train or tuner.tries >= 4:
                tuner.measured.append((self._cal, kind))
            else:
                tuner.tries += 1
            if len(tuner.measured) >= tuner.n_measure:
                self._cal = None
                self._cal_pool = []
                tuner.phase = "pending"
            else:
                self._cal_begin()
        if tuner.phase == "pending" and not any(
                p.grad is t for p, t in self._exposed.items()):
            # applied where no gradient sum runs on (a new gradient set
            # starts its layers afresh)
            accesses, kind = tuner.measured, tuner.measured[-1][1]
            tuner.phase = "done"
            self._tuner = None
            try:
                self._plan_and_apply(accesses, kind, tuner)
            except Exception as e:  # a plan is an optimisation: keep streaming as it was
                self.plan_info = dict(self.plan_info or {}, error="%s: %s" % (
                    type(e).__name__, e))
                warnings.warn("lwo.torch: the automatic plan failed, the handle keeps its "
                              "records and depth (%s)" % (e,), RuntimeWarning, stacklevel=4)
                if isinstance(e, (TypeError, AttributeError, NameError)):
                    raise
            planner = self.planner
            if planner.kind is None:  # rebuilt: this access begins the new planner's step
                planner.observe(s.record.index, grad, False)
                self._steps_seen = planner.steps
        return s.record

    def _drifted(self):
        """After a plan: the step that just ended against what the plan
        delivers. The first _SETTLE steps of the planned kind set the
        baseline (their median); if all of them are more than a quarter
        slower than the prediction, the plan underdelivers (its measured
        steps were disturbed) and is made again. After that, three steps in a
        row off the baseline by more than a quarter (the shapes or the order
        changed) make a new plan. A plan faster than its prediction is kept.
        Each new plan measures again, then chooses depth and resident records
        anew for the records as they are (at most _MAX_REPLANS times).
        Returns the new tuner, or None."""
        w = self._watch
        ev = self._step_events
        if len(ev) < 2:
            return None
        kind, e0, e1 = ev[-2]
        if kind != w["kind"] or e1 is None or not self.backend.query(e1):
            return None
        ms = self.backend.elapsed_ms(e0, e1)
        settle = w["settle"]
        if w["baseline_ms"] is None:
            settle.append(ms)
            if len(settle) < _SETTLE:
                return None
            w["baseline_ms"] = statistics.median(settle)
            replan = min(settle) > 1.25 * w["predicted_ms"]
        else:
            ratio = ms / w["baseline_ms"]
            w["bad"] = w["bad"] + 1 if not 0.75 <= ratio <= 1.25 else 0
            replan = w["bad"] >= 3
        if not replan or w["replans"] >= _MAX_REPLANS:
            return None
        given, default, depths = self._plan_args
        tuner = _Tuner(given, default, depths, False, warmup=self.planner.steps)
        tuner.replans = w["replans"] + 1
        self._watch = None
        self._tuner = tuner
        return tuner

    def _cal_event(self):
        pool = self._cal_pool
        return self.backend.record(pool.pop()) if pool else self.backend.event()

    def _cal_begin(self):
        """A measured step begins: its access list, and its events made now."""
        self._cal = []
        plan = self.planner.plans[self.planner.last_kind or _TRAIN]
        need = min(5 * len(plan) + 16, 1 << 16)
        if len(self._cal_pool) < need:
            self._cal_pool = self._cal_pool + self.backend.make_events(need - len(self._cal_pool))

    def _cal_start(self, rec, backward):
        a = _Access(rec.index, backward, self._cal_event())
        self._cal.append(a)

    def _cal_wait(self, w0):
        a = self._cal[-1] if self._cal else None
        if a is not None and a.end is None:
            a.waits.append((w0, self._cal_event()))

    def _cal_end(self):
        if self._cal:
            self._cal[-1].end = self._cal_event()

    def _measured_times(self, steps):
        """Per record, its forward and backward time: in each measured step
        (`steps`: [(accesses, kind)]) its accesses' compute without the
        waits for weights and gradient slots, plus the device time between
        the previous access's end and its start (the model's own work
        between streamed modules); the least over the steps of the last
        step's kind (a step disturbed once, by the host or a first call,
        does not decide)."""
        self.backend.synchronize()
        el = self.backend.elapsed_ms
        n = len(self.records)
        kind = steps[-1][1]
        best_f = best_b = None
        for accesses, k in steps:
            if k != kind:
                continue
            fwd, bwd = [0.0] * n, [0.0] * n
            prev = None
            for a in accesses:
                if a.end is None:
                    continue
                t = el(a.start, a.end) - sum(el(w0, w1) for w0, w1 in a.waits)
                if prev is not None:
                    t += max(0.0, el(prev, a.start))
                (bwd if a.backward else fwd)[a.rec] += max(0.0, t)
                prev = a.end
            best_f = fwd if best_f is None else [min(u, v) for u, v in zip(best_f, fwd)]
            best_b = bwd if best_b is None else [min(u, v) for u, v in zip(best_b, bwd)]
        return best_f, best_b

    def _device_bytes_of_model(self):
        """Bytes the model keeps on the handle's device (parameters and
        buffers that lwo does not stream)."""
        model = self.model_ref()
        if model is None or self.backend.device_type != "cuda":
            return 0
        seen, total = set(), 0
        for t in list(model.parameters()) + list(model.buffers()):
            if t.is_cuda and t.get_device() == self._dev_index and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total

    def _plan_and_apply(self, steps, kind, tuner):
        fwd, bwd = self._measured_times(steps)
        train = kind == _TRAIN
        # the planner's pass is the records in pool order: group only if the
        # forward met them in that order
        first = []
        seen = set()
        for a in steps[-1][0]:
            if not a.backward and a.rec not in seen:
                seen.add(a.rec)
                first.append(a.rec)
        in_order = first == sorted(first)
        group = tuner.group and in_order
        pre = None
        if group:
            # Small records first merged into runs of about _SMALL_RUN bytes
            # (copies that small lose link rate and each costs host calls;
            # the planner's search also grows with the records' count).
            pre = _tune.merge_small([r.bytes for r in self.records],
                                    [(r.trainable, r.quantized) for r in self.records],
                                    self.backend.small_record, self.backend.small_run)
            if all(n_ == 1 for _f, n_, _r in pre):
                pre = None
            else:
                fwd = [sum(fwd[f:f + n_]) for f, n_, _r in pre]
                bwd = [sum(bwd[f:f + n_]) for f, n_, _r in pre]
                self._apply(pre, self.depth)
        model_bytes = self._device_bytes_of_model()
        workspaces = self.backend.workspace_bytes()
        if tuner.budget is None:
            # a third of the streamed bytes, at least the smallest ring of the
            # records as they are now (merged: the largest may have grown)
            budget = max(tuner.default_budget, self._smallest_ring())
            budget_from = "default (a third of the streamed bytes, at least the smallest ring)"
        else:
            budget = tuner.budget - model_bytes - workspaces
            budget_from = "given, less the model's %s on the device and lwo's %s of " \
                "workspaces" % (_tune.format_bytes(model_bytes), _tune.format_bytes(workspaces))
        info = {"step_kind": kind, "measured_fwd_ms": fwd, "measured_bwd_ms": bwd if train
                else None, "budget_bytes": max(0, budget), "budget": budget_from,
                "merged_small": None if pre is None else len(pre),
                "given_budget_bytes": tuner.budget, "model_device_bytes": model_bytes,
                "grouped": group, "in_order": in_order, "applied_at_step": self.planner.steps}
        if budget <= 0:
            raise ArgumentError(C.LWO_ERR_OVER_BUDGET, "lwo.torch: budget %s: the model keeps "
                                "%s on the device and lwo's workspaces %s, nothing is left for "
                                "the ring" % (_tune.format_bytes(tuner.budget),
                                              _tune.format_bytes(model_bytes),
                                              _tune.format_bytes(workspaces)))
        t0 = time.perf_counter()
        got = self.backend.plan(self.pool, fwd, bwd, [r.trainable for r in self.records],
                                train, budget, depths=tuner.depths, group=group,
                                grad_depth=self.grads_depth)
        info["plan_seconds"] = time.perf_counter() - t0
        groups = _tune.split_runs(got["groups"], [(r.trainable, r.quantized)
                                                   for r in self.records])
        info.update(got)
        info["groups"] = groups
        info["replans"] = tuner.replans
        self.plan_info = info
        self.plans.append(info)
        if got.get("predicted_ms") and kind == _TRAIN:
            # (a forward-only step's time runs to the next step's start, host
            # work between steps included: only training steps are watched)
            self._watch = {"kind": kind, "predicted_ms": got["predicted_ms"], "bad": 0,
                           "replans": tuner.replans, "settle": [], "baseline_ms": None}
        t0 = time.perf_counter()
        self._apply(groups, got["depth"])
        info["apply_seconds"] = time.perf_counter() - t0
        info["records"] = self.record_names()
        info["resident_records"] = list(self.resident)

    def _apply(self, groups, depth):
        """Rebuilds the records as `groups` ([(first, n, resident)] over the
        current records, in order) and the ring at `depth`, between steps."""
        cur = self.backend.current_stream(self._dev_index)
        if self._span is not None:
            self._end_span()
        regroup = any(n > 1 for _f, n, _r in groups)
        if regroup:
            for b in list(self._optims):
                b.detach()  # the pool holds the masters' rounding from here
        self._release_all()
        for idx, (t, _v) in list(self._prefetched.items()):
            self._release(self.records[idx], t, cur)
        self._prefetched.clear()
        self._live = 0
        if self.grads is not None:
            self.grads.wait()
        self.synchronize()
        old_records = self.records
        mapping = [0] * len(old_records)
        for gi, (first, n, _r) in enumerate(groups):
            for i in range(first, first + n):
                mapping[i] = gi
        if regroup and self._split():
            raise RuntimeError("lwo.torch: records regrouped over a pool sharded over %d ranks: "
                               "its parameters are split over the ranks (a group has no plan)"
                               % self.pool.info().n_ranks)
        if regroup:
            new = []
            for gi, (first, n, resident) in enumerate(groups):
                olds = old_records[first:first + n]
                rec = _Record(gi, olds[0].name if n == 1 else "%s .. %s" % (
                    olds[0].name, olds[-1].name))
                rec.quantized = olds[0].quantized
                rec.modules = [s for o in olds for s in o.modules]
                new.append(rec)
            old_pool = self.pool
            old_where = {id(s): (s.record.index, s.record.names[s.w_idx]) for s in self.states}
            # a mapped checkpoint's records are grouped anew over the same file
            # bytes, which the parameters are: nothing to copy
            mapped = self._checkpoint is not None and self._checkpoint.mapped
            pool = self._checkpoint.regroup(self, new) if mapped else \
                self._new_pool(self._pool_layers(new))
            with torch.no_grad():
                for rec in new:
                    infos = pool.tensors(rec.index)
                    rec.bytes = pool.record_bytes(rec.index)
                    for s in rec.modules:
                        self._bind(s, infos)
                        if s.quant and not mapped:
                            src = old_pool.tensor_host(*old_where[id(s)])
                            dst = pool.tensor_host(rec.index, rec.names[s.w_idx])
                            _host_tensor(dst.address, dst.bytes, torch.uint8, (dst.bytes,),
                                         pool).copy_(_host_tensor(src.address, src.bytes,
                                                                  torch.uint8, (src.bytes,),
                                                                  old_pool))
                        if s.quant:  # (of its compute dtype: see _pool_layers)
                            rec.saved_bytes += s.weight.numel() * _core.dtype_size(
                                s.lwo_dtype) - s.w_bytes
                        for p, idx in ((s.weight, s.w_idx), (s.bias, s.b_idx)):
                            if p is None or (p is s.weight and s.quant) or mapped:
                                continue
                            # (never split over ranks: a group has no plan
                            # and so no regrouping)
                            host, _first = self._param_home(pool, rec.index, rec.names[idx],
                                                            p.dtype, tuple(p.shape))
                            host.copy_(p.detach())
                            p.data = host
                        rec.params += [p for p in (s.weight, s.bias) if p is not None]
                        s.record = rec
                    rec.trainable = any(p.requires_grad for p in rec.params)
                    rec.version = rec.current_version()
            self.records = new
            self.pool = pool
            old_grads = self.grads
            self.grads = None
            self._grad_views = {}
            if any(r.trainable for r in new):
                self.grads = self._new_grads(pool, [r.trainable for r in new])
            self._exposed.clear()  # every grad is None here (see _new_step)
            self._exposed_gen += 1
            self._got_grad.clear()
            if old_grads is not None:
                old_grads.close()
            for b in list(self._optims):
                b.attach()
        # a ring of a sharded pool keeps no record resident: each stage is a
        # collective all-gather
        resident = [gi for gi, (_f, _n, r) in enumerate(groups) if r and self.comm is None]
        for rec in self.records:
            rec.resident = rec.index in resident
        old_ring = self.ring
        self.ring = self.backend.ring(self.pool, int(depth), self._timing, resident=resident)
        old_ring.close()
        self.depth = int(depth)
        self.resident = tuple(resident)
        self.planner.remap(mapping)

    def step_times(self):
        """The last steps' device times (ms, from each step's first streamed
        access to the end of its backward pass, or for a forward-only step
        to the start of the next), with the plan's prediction beside them
        once a plan is applied. Synchronises the device."""
        ev = self._step_events
        if not ev:
            return []
        self.backend.synchronize()
        el = self.backend.elapsed_ms
        pred = (self.plan_info or {}).get("predicted_ms")
        out = []
        for kind, e0, e1 in ev:
            if e1 is None:
                continue
            out.append({"kind": kind, "measured_ms": el(e0, e1), "predicted_ms": pred})
        return out

    # ----------------------------------------------------------------
    # Per-layer statistics (stats=True)
    # ----------------------------------------------------------------
    def _stage_measured(self, rec):
        before = self.ring.stats()
        if self.backend.events:
            ts = torch.cuda.ExternalStream(self.backend.transfer_stream(), device=self.device)
            e0 = torch.cuda.Event(enable_timing=True)
            e0.record(ts)
        t = self.ring.stage(rec.index)
        after = self.ring.stats()
        hit = after.n_hits > before.n_hits
        rec.n_stages += 1
        rec.n_hits += int(hit)
        rec.bytes_copied += after.bytes_copied - before.bytes_copied
        if self.backend.events and not hit:
            e1 = torch.cuda.Event(enable_timing=True)
            e1.record(ts)
            self._events.append((rec, "copy", e0, e1))
        return t

    def _acquire_measured(self, rec, t, stream):
        if not self.backend.events:
            return self.ring.acquire(t, stream)
        cs = torch.cuda.ExternalStream(stream, device=self.device) if stream else \
            torch.cuda.default_stream(self.device)
        e0 = torch.cuda.Event(enable_timing=True)
        e0.record(cs)
        base = self.ring.acquire(t, stream)
        e1 = torch.cuda.Event(enable_timing=True)
        e1.record(cs)
        self._events.append((rec, "stall", e0, e1))
        return base

    def _fold_events(self):
        if not self._events:
            return
        if self.backend.events:
            torch.cuda.synchronize(self.device)
        for rec, kind, e0, e1 in self._events:
            ms = e0.elapsed_time(e1)
            if kind == "copy":
                rec.copy_ms += ms
            else:
                rec.stall_ms += ms
        self._events = []

    # ----------------------------------------------------------------
    # Gradients
    # ----------------------------------------------------------------
    def _backward_started(self):
        task = _graph_task_id()
        if task in self._cb_tasks:
            return
        captured = False
        if self._cap_check:
            captured = self._capture_backward()
        elif self._cap_guard and _capturing():
            self._refuse_unjoined(None)
        first = not self._cb_tasks
        self._cb_tasks.add(task)
        if task != -1:
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self._backward_ended(task))
        if first and captured:
            # In the capture: the sums started at the join; lwo.torch.optim
            # steps after each replay (its in_backward step is not captured).
            self._pass_layers = set()
            self._open_optims = ()
            return
        if first:
            self._pass_layers = set()
            if self.grads is not None:
                self._start_sums()
            opened = []
            for b in list(self._optims):
                b.backward_started()  # lwo.torch.optim's in_backward: the step opens here
                if b.open:
                    opened.append(b)
            self._open_optims = tuple(opened)
            if opened:
                self._count_nodes = True

    def _start_sums(self):
        """At the start of a backward pass: a param.grad set to None since
        the last pass starts a new sum; one replaced by another tensor is
        copied in (PyTorch would add to it). True if every sum starts anew
        (a zero)."""
        exposed = self._exposed
        if not exposed:
            if self._got_grad:
                self.grads.zero()
                self._got_grad.clear()
                self._carry.clear()
            return True
        nones = [p for p, t in exposed.items() if p.grad is None]
        if len(nones) == len(exposed):
            self.grads.zero()
            exposed.clear()
            self._got_grad.clear()
            self._carry.clear()
            return True
        waited = False
        zeroed = set()
        for p, t in list(exposed.items()):
            g = p.grad
            if g is t:
                continue
            if not waited:
                self.grads.wait()
                waited = True
            if g is None:
                t.zero_()  # lwo adds to it from here
                zeroed.add(p)
                del exposed[p]
                self._carry.pop(self._param_key.get(p), None)
            else:
                t.copy_(g.detach().reshape(t.shape))
                p.grad = None  # set back to the host buffer at the end of the pass
        if zeroed:
            # a module whose gradients were all set to None gets them back
            # only from a backward pass it takes part in, as in PyTorch
            for s in list(self._got_grad):
                ps = [q for q in (s.weight, s.bias) if q is not None and q.requires_grad]
                if ps and all(q in zeroed for q in ps):
                    self._got_grad.discard(s)
        return False

    def _sums_uniform(self):
        """Whether every exposed param.grad is None, or none is (what a
        captured training step's replays can repeat)."""
        nones = sum(1 for p in self._exposed if p.grad is None)
        return nones in (0, len(self._exposed))

    def _replay_step(self, hold, stream):
        """Before each replay of a captured training step (the graph's replay
        start hook): the sums start anew where the capture's did
        (lwo_grads_zero, whatever param.grad holds: the replay overwrites
        them, as torch's graphed backward does), then the replay's host side
        (lwo_ring_capture_replay: the optimizer's waits, the gradient ends'
        serials, refusing a replay that would land its gradients wrongly).
        Its gradients are read after the fence (handle.synchronize(), or
        lwo.torch.optim's step, which waits for each layer)."""
        if self.grads is not None and hold.fresh:
            self.grads.zero()
            self._got_grad.clear()
            self._carry.clear()
        try:
            self.ring.capture_replay(stream)
            self._got_grad |= hold.got
            self._expose_replayed(hold)  # param.grad set to None since: the replay's sums
        except Error as e:
            raise type(e)(e.status, (
                "lwo.torch: torch.cuda.CUDAGraph.replay of a captured training step: %s%s") % (
                    e.message, "" if hold.fresh else " (the step was captured adding to the "
                    "sums of earlier passes, so each replay adds too: do not zero the "
                    "gradients between its replays, or capture after optimizer.zero_grad())"
                )) from None

    def _replay_pass(self, stream):
        """Before each replay of a captured pass without gradients: its host
        side (lwo_ring_capture_replay: the slots the warm capture found
        holding its first layers get them again where the last replay left
        others, or where the pool's bytes changed since)."""
        try:
            self.ring.capture_replay(stream)
        except Error as e:
            raise type(e)(e.status, "lwo.torch: torch.cuda.CUDAGraph.replay of a captured "
                          "pass: %s" % e.message) from None

    def _backward_ended(self, task):
        self._cb_tasks.discard(task)
        if self._cb_tasks:
            return  # an inner (reentrant) pass: the outer one ends the step
        if self._span is not None:
            self._end_span()
        self._open_optims = ()
        if self._count_nodes:
            for rec in self.records:
                rec.nodes = 0
                rec.unsafe = False
        self._release_all()
        self.planner.end()
        if self._joined is not None:
            # A captured backward: nothing is waited for or timed in the
            # capture; param.grad is the host sums' view from here, which each
            # replay fills (read them after the fence), and lwo.torch.optim
            # steps after each replay.
            self._joined.got |= self._got_grad
            self._expose_grads()
            return
        ev = self._step_events
        if ev and ev[-1][2] is None:
            ev[-1][0] = "train"
            ev[-1][2] = self.backend.event()
        try:
            for b in list(self._optims):
                b.backward_ended()  # lwo.torch.optim's in_backward: the step starts here
        finally:
            self._fence()

    def _fence(self):
        """The end of a backward pass: waits for the gradients and sets
        param.grad."""
        if self.grads is not None and self._got_grad:
            self.grads.wait()  # the fence: the host buffers hold the sums from here on
            if self._carry:  # sums from before the gradient set was made again
                for (layer, name), c in self._carry.items():
                    if layer in self._pass_layers:
                        t = self._grad_view(layer, name)
                        t.copy_((t.float() + c.float()).to(t.dtype))
                self._carry.clear()
            self._expose_grads()

    def _expose_replayed(self, hold):
        """_expose_grads before a replay of a captured step, which runs on
        every replay with the same modules: once through _expose_grads, then
        through the (param, its host sums) pairs that left, while _exposed
        and the modules are as they were then (a few hundred parameters make
        the difference a share of a small model's replay)."""
        if self.grads is None or not self._got_grad:
            return
        key = (self._exposed_gen, len(self._got_grad))
        cached = hold.exposed
        if cached is not None and cached[0] == key:
            for p, t in cached[1]:
                if p.requires_grad:
                    if t is None:  # a parameter that needs its gradient now
                        break
                    if p.grad is not t:
                        p.grad = t
            else:
                return
        self._expose_grads()
        exposed = self._exposed
        hold.exposed = (key, [(p, exposed.get(p)) for s in self._got_grad
                              for p in (s.weight, s.bias) if p is not None])

    def _expose_grads(self):
        """param.grad of each module that got a gradient: its view of the
        host sums."""
        if self.grads is not None and self._got_grad:
            for s in list(self._got_grad):
                for p, idx in ((s.weight, s.w_idx), (s.bias, s.b_idx)):
                    if p is None or not p.requires_grad:
                        continue
                    t = self._exposed.get(p)
                    if t is None:
                        t = self._grad_view(s.record.index, s.record.names[idx]).view(p.shape)
                        self._exposed[p] = t
                    if p.grad is not t:
                        if t.dtype != p.dtype and p not in self._grad_dtypes:
                            # a sharded pool's f32 sums of a bf16 / f16 weight:
                            # param.grad is f32 (torch's grad_dtype) until close()
                            p.grad = None
                            self._grad_dtypes[p] = p.grad_dtype
                            p.grad_dtype = t.dtype
                        p.grad = t

    def _grad_slot(self, rec, stream):
        sp = self._span
        if sp is not None:
            if sp.rec is rec and sp.stream == stream:
                return sp
            self._end_span()
        if self._cal is not None:
            w0 = self._cal_event()
            sp = _Span(rec, stream, self.grads.begin(rec.index, stream))
            self._cal_wait(w0)
        else:
            sp = _Span(rec, stream, self.grads.begin(rec.index, stream))
        self._span = sp
        return sp

    def _end_span(self, defer=False):
        """Sends the span's gradient slot to the host (lwo_grads_end); where
        the record has no node left in the pass, its update may start
        (lwo.torch.optim's open step). defer: in the record's own backward,
        whose dx still reads the record: added by _flush_add after it."""
        sp = self._span
        self._span = None
        rec = sp.rec
        if len(sp.written) != len(rec.names):
            for i, (addr, dt) in enumerate(sp.slot):
                if i not in sp.written:
                    n = math.prod(self._tensor_shape(rec, i))
                    self.backend.zero_device(addr, n * _core.dtype_size(dt), sp.stream)
        self.grads.end(rec.index, sp.stream)
        if self._open_optims and rec.nodes == 0 and not rec.unsafe and len(self._cb_tasks) == 1:
            # Every node the forward made for the record has run its
            # backward, so no gradient of it comes later in this pass: its
            # update may start once this one lands. (A reentrant checkpoint's
            # nested pass, or a record the forward also reached without grad,
            # leaves it to the close.)
            if defer:
                self._add_after = rec.index
            else:
                for b in self._open_optims:
                    b.layer_done(rec.index)

    def _flush_add(self):
        """The deferred add of _end_span, once the node's dx is enqueued (a
        stage after the update starts would copy the new weights)."""
        layer, self._add_after = self._add_after, None
        for b in self._open_optims:
            b.layer_done(layer)

    def _tensor_shape(self, rec, i):
        for s in rec.modules:
            if s.w_idx == i:
                return s.w_shape
            if s.b_idx == i:
                return s.b_shape
        raise IndexError(i)

    def _weight_grad(self, s, rec, stream, x, n, compute):
        """dW (and db) of module s into its record's gradient slot, before dx
        and without waiting for the weights: ``compute(desc, x, dweight,
        dbias, grad_dtype)`` enqueues them (the accumulating desc when the
        slot already holds this module's sum); with n == 0 (an empty batch)
        they are zeroed instead. The slot goes to the host once the plan says
        the record does not come next (while dx computes)."""
        if x.dtype != s.dtype:
            x = x.to(s.dtype)
        x = x.contiguous()
        sp = self._grad_slot(rec, stream)
        acc = s.w_idx in sp.written
        w_addr, wire = sp.slot[s.w_idx]
        db = sp.slot[s.b_idx][0] if s.has_bias else None
        if n:
            compute(s.desc_acc if acc else s.desc, x.data_ptr(), w_addr, db, wire)
        elif not acc:
            # the slot's tensors are in the wire dtype (f32 for a sharded pool)
            self.backend.zero_device(w_addr, math.prod(s.w_shape) * _core.dtype_size(wire),
                                     stream)
            if s.has_bias:
                self.backend.zero_device(db, math.prod(s.b_shape) * _core.dtype_size(
                    sp.slot[s.b_idx][1]), stream)
        sp.written.add(s.w_idx)
        if s.has_bias:
            sp.written.add(s.b_idx)
        rec.nodes -= 1
        self._got_grad.add(s)
        self._pass_layers.add(rec.index)
        if not self.planner.next_is(rec.index):
            self._end_span(defer=True)

    # ----------------------------------------------------------------
    # Linear
    # ----------------------------------------------------------------
    def _input(self, s, x):
        """x as lwo takes it (the layer's dtype, this device, contiguous), or
        the error that says why not."""
        if self.closed:
            raise StateError(C.LWO_ERR_INVALID_HANDLE, "lwo.torch: the offload handle of %r "
                             "is closed" % s.name)
        if x.dtype is not s.dtype:
            if not _autocast_any(x):
                raise RuntimeError(
                    "lwo.torch: %s %r has %s weights but got %s input (lwo computes "
                    "input and weights in one dtype; cast the input, or run under "
                    "torch.autocast)" % (s.kind, s.name, s.dtype, x.dtype))
            x = x.to(s.dtype)
        if x.get_device() != self._dev_index:
            raise RuntimeError(
                "lwo.torch: %s %r is streamed to %s but got an input on %s"
                % (s.kind, s.name, self.device, x.device))
        return x.contiguous()

    def _linear_forward(self, s, x, grad):
        if x.dtype is not s.dtype or x.get_device() != self._dev_index or self.closed:
            x = self._input(s, x)
        elif not x.is_contiguous():
            x = x.contiguous()
        shape = x.shape
        in_f = s.in_f
        # x has the layer's dtype and device by now: y is made like it
        if len(shape) == 2 and shape[1] == in_f:
            tokens = shape[0]
            y = x.new_empty((tokens, s.out_f))
        else:
            if not shape or shape[-1] != in_f:
                raise RuntimeError("lwo.torch: linear %r takes %d input features, got shape "
                                   "%s" % (s.name, in_f, tuple(shape)))
            y = x.new_empty(shape[:-1] + (s.out_f,))
            tokens = x.numel() // in_f
        if tokens == 0:
            return y
        # _enter written out
        rec = s.record
        rec.n_accesses += 1
        planner = self.planner
        between = planner.kind is None
        planner.observe(rec.index, grad, _graph_task_id() != -1)
        if not grad:
            rec.unsafe = True  # its node count is unsure in this step (see _end_span)
        elif self._joined is not None and not self._joined.train:
            self._refuse_in_capture(s, "a forward whose output needs a gradient, after the "
                                    "capture's first streamed module ran without one (a "
                                    "training step's sums start at its first)")
        if between or planner.steps != self._steps_seen:
            rec = self._new_step(s, grad)
        stream = self._cur_stream(self._dev_index)
        cal = self._cal
        if cal is not None:
            self._cal_start(rec, False)
        base = self._acquire(rec, stream)
        try:
            raw = self._lin_raw
            if raw is not None:
                st = raw[0](raw[1], s.desc[1], tokens, x.data_ptr(), base + s.w_off,
                            base + s.b_off if s.has_bias else None, y.data_ptr(), stream)
                if st:
                    check(st)
            else:
                self._lin_fwd(s.desc, tokens, x.data_ptr(), base + s.w_off,
                              base + s.b_off if s.has_bias else None, y.data_ptr(), stream)
        finally:
            # _after's common case inline: the record is held for its next access
            held = self._held
            if held is None or not self.planner.next_is(rec.index):
                self._after(rec, stream)
        if cal is not None:
            self._cal_end()
        return y

    def _linear_backward(self, s, x, dy, need_dx, need_dw, x_dtype):
        if not need_dx and not need_dw:
            return None
        dy = dy.contiguous()
        if dy.dtype != s.dtype:
            dy = dy.to(s.dtype)
        tokens = dy.numel() // s.out_f
        stream = self.backend.current_stream(self._dev_index)
        self._backward_started()
        rec = s.record
        self._observe(rec, True, True)
        cal = self._cal
        if cal is not None:
            self._cal_start(rec, True)
        try:
            be = self.backend
            if need_dw:
                self._weight_grad(s, rec, stream, x, tokens, lambda desc, xp, dw, db, wire:
                                  be.linear_backward(desc, tokens, xp, dy.data_ptr(), None, None,
                                                     dw, db, wire, stream))
            if not need_dx:
                return None
            dx = torch.empty(dy.shape[:-1] + (s.in_f,), dtype=s.dtype, device=dy.device)
            if tokens == 0:
                return dx.to(x_dtype)
            base = self._acquire(rec, stream)
            try:
                be.linear_backward(s.desc, tokens, None, dy.data_ptr(), base + s.w_off,
                                   dx.data_ptr(), None, None, s.lwo_dtype, stream)
            finally:
                self._after(rec, stream)
            return dx if x_dtype == s.dtype else dx.to(x_dtype)
        finally:
            if cal is not None:
                self._cal_end()
            if self._add_after is not None:
                self._flush_add()

    # ----------------------------------------------------------------
    # Conv2d
    # ----------------------------------------------------------------
    def _conv_out(self, s, h, w):
        key = (h, w)
        got = s.out_sizes.get(key)
        if got is None:
            got = self.backend.conv_output_size(s.desc, h, w)
            s.out_sizes[key] = got
        return got

    def _conv_forward(self, s, x, grad):
        if self.closed:
            raise StateError(C.LWO_ERR_INVALID_HANDLE, "lwo.torch: the offload handle of %r "
                             "is closed" % s.name)
        unbatched = x.dim() == 3
        if unbatched:
            x = x.unsqueeze(0)
        if x.dim() != 4 or x.shape[1] != s.in_f:
            raise RuntimeError("lwo.torch: conv2d %r takes [N, %d, H, W] input, got shape %s"
                               % (s.name, s.in_f, tuple(x.shape)))
        x = self._input(s, x)
        n, _c, h, w = x.shape
        oh, ow = self._conv_out(s, h, w)
        y = torch.empty((n, s.out_f, oh, ow), dtype=s.dtype, device=x.device)
        if n == 0:
            return y.squeeze(0) if unbatched else y
        rec = self._enter(s, grad)
        stream = self.backend.current_stream(self._dev_index)
        cal = self._cal
        if cal is not None:
            self._cal_start(rec, False)
        base = self._acquire(rec, stream)
        try:
            self.backend.conv_forward(s.desc, n, h, w, x.data_ptr(), base + s.w_off,
                                      base + s.b_off if s.has_bias else None, y.data_ptr(),
                                      stream)
        finally:
            self._after(rec, stream)
        if cal is not None:
            self._cal_end()
        return y.squeeze(0) if unbatched else y

    def _conv_backward(self, s, x, x_shape, dy, need_dx, need_dw, x_dtype):
        if not need_dx and not need_dw:
            return None
        unbatched = len(x_shape) == 3
        if unbatched:
            dy = dy.unsqueeze(0)
        dy = dy.contiguous()
        if dy.dtype != s.dtype:
            dy = dy.to(s.dtype)
        n = dy.shape[0]
        shape4 = (1,) + tuple(x_shape) if unbatched else tuple(x_shape)
        h, w = shape4[2], shape4[3]
        stream = self.backend.current_stream(self._dev_index)
        self._backward_started()
        rec = s.record
        self._observe(rec, True, True)
        cal = self._cal
        if cal is not None:
            self._cal_start(rec, True)
        try:
            be = self.backend
            if need_dw:
                self._weight_grad(s, rec, stream, x.unsqueeze(0) if unbatched else x, n,
                                  lambda desc, xp, dw, db, wire:
                                  be.conv_backward(desc, n, h, w, xp, dy.data_ptr(), None, None,
                                                   dw, db, wire, stream))
            if not need_dx:
                return None
            dx = torch.empty(shape4, dtype=s.dtype, device=dy.device)
            if n:
                base = self._acquire(rec, stream)
                try:
                    be.conv_backward(s.desc, n, h, w, None, dy.data_ptr(), base + s.w_off,
                                     dx.data_ptr(), None, None, s.lwo_dtype, stream)
                finally:
                    self._after(rec, stream)
            if unbatched:
                dx = dx.squeeze(0)
            return dx if x_dtype == s.dtype else dx.to(x_dtype)
        finally:
            if cal is not None:
                self._cal_end()
            if self._add_after is not None:
                self._flush_add()

    # ----------------------------------------------------------------
    # CUDA graphs (the module's "CUDA graphs" section says how they come)
    # ----------------------------------------------------------------
    def _capture_begun(self):
        """torch's hook: a capture began somewhere. The next streamed access
        goes through _capture_step, with the planner's state as it is now
        kept: what that access observes is put aside if it joins."""
        if self._joined is not None:
            return  # its accesses are checked as they come (_capture_step)
        if not self._cap_check:
            self._cap_check = True
            self._steps_real = self._steps_seen
        self._steps_seen = -1
        self._cap_planner = self.planner.save()

    def _capture_step(self, s, grad):
        """A step's first access while _cap_check is set (a capture began, the
        ring is in one, or a graph holds it). Joins the capture at its first
        streamed access, refuses what a joined capture cannot hold, and an
        eager call while a graph holds the ring. Returns s's record when the
        access is handled here, None when it begins an eager step as usual."""
        planner = self.planner
        stream = self._cur_stream(self._dev_index)
        j = self._joined
        if j is not None:
            if stream != j.stream or not _capturing():
                self._refuse_in_capture(s, "a call on stream 0x%x outside the capture" % (
                    stream or 0))
            if grad and not j.train:
                self._refuse_in_capture(s, "a forward whose output needs a gradient, after "
                                        "the capture's first streamed module ran without one "
                                        "(a training step's sums start at its first)")
            self._steps_seen = planner.steps  # another pass in the same capture
            return s.record
        if not _capturing():
            hold = self._live_hold()
            if hold is not None:
                planner.restore(self._cap_planner)  # the refused access leaves no trace
                raise StateError(C.LWO_ERR_BUSY, (
                    "lwo.torch: %s %r (record %d): a CUDA graph captured on stream 0x%x holds "
                    "this handle's lwo ring (lwo_ring_capture_release not called yet), so the "
                    "module cannot run eagerly: replay the graph, or release it first (del "
                    "graph, graph.reset() or handle.release_graph())") % (
                        s.kind, s.name, s.record.index, hold.stream or 0))
            # No capture here: back to eager accesses at no cost.
            self._cap_check = False
            self._cap_planner = None
            real = self._steps_real
            self._steps_seen = real
            if planner.steps != real or len(planner.trace) == 1:
                return None  # this access began a step
            return s.record
        return self._join(s, grad, stream)

    def _join(self, s, grad, stream):
        """The first streamed access in a capture on `stream`: the ring joins
        it (lwo_ring_capture_join), after what it held from before was released
        outside the capture and the resident records written since were marked
        changed (the join uploads them). The pass is a forward-only step of the
        planner's, whose state is put back at the leave."""
        what = "lwo.torch: %s %r (record %d) in a CUDA graph capture on stream 0x%x" % (
            s.kind, s.name, s.record.index, stream or 0)
        saved = self._cap_planner
        hold = self._live_hold()
        why = None
        if hold is not None:
            why = (C.LWO_ERR_BUSY, "an earlier CUDA graph (captured on stream 0x%x) still holds "
                   "this handle's ring: one graph at a time holds a ring; release it first (del "
                   "graph, graph.reset() or handle.release_graph())%s" % (
                       hold.stream or 0, ": it was dropped, and its release waits for its stream "
                       "to capture no more" if hold.gone else ""))
        elif grad and self.grads is not None and not self._sums_uniform():
            why = (C.LWO_ERR_UNSUPPORTED, "a training step whose streamed parameters' grad "
                   "is None for some and a sum for others: each replay starts new sums, or "
                   "adds to them, as the capture did, for every parameter alike; set every "
                   "streamed parameter's grad to None (optimizer.zero_grad()) before the "
                   "capture, or none")
        elif self._timing:
            why = (C.LWO_ERR_UNSUPPORTED, "the handle was made with offload(timing=True), whose "
                   "ring timing is read on the host: a timed ring cannot be captured")
        else:
            ref = _CAPTURES.get(stream)
            graph = ref() if ref is not None else None
            if graph is None:
                why = (C.LWO_ERR_UNSUPPORTED, "the capture was not begun by "
                       "torch.cuda.CUDAGraph.capture_begin (torch.cuda.graph, "
                       "make_graphed_callables): lwo.torch must leave a capture before it "
                       "ends and sees only those")
            elif not self.backend.stream_warm(stream):
                why = (C.LWO_ERR_CAPTURING, "lwo has not computed on this stream yet: its "
                       "first call on a stream allocates the stream's workspace, and its "
                       "first call of a shape times its algorithms, neither of which a "
                       "capture can hold. Run the model eagerly on the capture stream first, "
                       "with the shapes of the capture: s = torch.cuda.Stream(); with "
                       "torch.cuda.stream(s): model(x); then torch.cuda.graph(g, stream=s)")
        if why is not None:
            planner = self.planner
            if saved is not None:
                planner.restore(saved)
            raise _errors.error_class(why[0])(why[0], "%s: %s" % (what, why[1]))
        planner = self.planner
        planner.restore(saved)
        steps = planner.steps  # the eager steps so far
        planner.end()  # an eager forward-only step ends here, in what is put back
        planner.observe(s.record.index, False, False)
        # What the ring holds from eager steps goes back outside the capture: a
        # staged record (never acquired) on the transfer stream, after its copy;
        # a held one on the stream that read it, or where that is the capture's,
        # on the transfer stream too (torch.cuda.graph synchronized the device
        # before it began the capture: nothing reads it any more).
        ts = None
        held = self._held
        if held is not None:
            self._held = None
            rs = held[2]
            if rs == stream:
                rs = ts = self.backend.transfer_stream()
            self._release(held[0], held[1], rs)
        if self._prefetched:
            if ts is None:
                ts = self.backend.transfer_stream()
            for idx, (t, _v) in list(self._prefetched.items()):
                self._release(self.records[idx], t, ts)
            self._prefetched.clear()
        self._live = 0
        for rec in self.records:
            if rec.resident:
                v = rec.current_version()
                if v != rec.version:
                    self._layer_changed(rec)  # uploaded by the join
                    rec.version = v
        # No timing in a capture: a measured step starts again after it, and a
        # forward-only step before it is not timed (it would end after it).
        tuner = self._tuner
        if self._cal is not None:
            self._cal = None
            if tuner is not None and tuner.phase == "measure":
                tuner.phase = "warmup"
                tuner.warmup = steps + 1
        ev = self._step_events
        if ev and ev[-1][2] is None:
            ev.pop()
        hold = _GraphHold(self, graph, stream)
        hold.planner = saved
        hold.stats = self._stats_on
        if grad:
            # A training step: its sums start here, outside the ring's part of
            # the capture (lwo's waits of the gradient fence are not captured),
            # as they would at its backward pass; each replay does the same.
            hold.train = True
            if self.grads is not None:
                hold.fresh = self._start_sums()
        self._stats_on = False
        try:
            self.ring.capture_join(stream)
        except Error as e:
            self._stats_on = hold.stats
            planner.restore(saved)
            raise type(e)(e.status, "%s: %s" % (what, e.message)) from None
        _end_before_torch(graph, hold)
        self._joined = hold
        self._steps_seen = planner.steps
        return s.record

    def _refuse_unjoined(self, s):
        """A step begins (s: its first streamed module; None: a backward pass)
        while torch's current stream captures a graph lwo.torch knows nothing
        of: refused before lwo enqueues anything, whose eager copies, waits
        and first calls a capture cannot hold (the capture stays valid, for
        its owner to end)."""
        stream = self._cur_stream(self._dev_index)
        if s is None:
            what = "lwo.torch: a backward pass through streamed modules began"
        else:
            what = "lwo.torch: %s %r (record %d) was called" % (s.kind, s.name, s.record.index)
        how = {"hooks": "torch's capture hooks",
               "wrappers": "its wrappers of torch.cuda.CUDAGraph's methods (this torch has "
                           "no capture hooks)"}.get(_capture_hooks,
                                                   "nothing (this torch has no CUDAGraph)")
        raise StateError(C.LWO_ERR_CAPTURING, (
            "%s while torch's current stream 0x%x captures a CUDA graph that "
            "lwo.torch has not joined: lwo.torch joins the captures begun by "
            "torch.cuda.CUDAGraph.capture_begin after its first offload() "
            "(torch.cuda.graph, make_graphed_callables), which it learns of through %s, "
            "and this one began otherwise (cudaStreamBeginCapture, torch._C._CUDAGraph's "
            "own capture_begin, or a capture begun before offload()), where lwo's eager "
            "copies and waits would fail. Capture with torch.cuda.graph(g, stream=s) after "
            "offload() and an eager warm-up on s, under torch.no_grad(); or call the model "
            "outside the capture") % (what, stream or 0, how))

    def _refuse_in_capture(self, s, what):
        """Refuses an access the joined capture cannot hold; the graph is void
        from here (released as its capture ends, its replays refused)."""
        j = self._joined
        msg = ("lwo.torch: %s %r (record %d) in a CUDA graph capture on stream 0x%x: %s: "
               "lwo.torch captures forward passes, and training steps, on the capture's "
               "stream; this capture's graph will not replay") % (
                   s.kind, s.name, s.record.index, (j.stream if j else 0) or 0, what)
        if j is not None and j.error is None:
            j.error = msg
        raise ArgumentError(C.LWO_ERR_UNSUPPORTED, msg)

    def _capture_backward(self):
        """A backward pass begins while _cap_check is set. In the capture the
        ring joined with a training step's forward: captured (True), its
        gradients' host side done at each replay (_replay_step). Refused in
        another capture (one the ring is not in, or after a forward that
        needed no gradient) and while a graph holds the ring."""
        j = self._joined
        if j is not None and j.train and _capturing():
            return True
        if j is not None or _capturing():
            msg = ("lwo.torch: a backward pass through streamed modules in a CUDA graph "
                   "capture %s: lwo.torch captures a whole training step in one graph "
                   "(torch.cuda.graph around forward and backward, the forward needing a "
                   "gradient; make_graphed_callables captures the backward as a second "
                   "graph while the first holds the ring, and is refused), or forward passes "
                   "under torch.no_grad()") % (
                       "whose forward needed no gradient" if j is not None else
                       "that lwo.torch's ring is not in")
            if j is not None and j.error is None:
                j.error = msg
            raise ArgumentError(C.LWO_ERR_UNSUPPORTED, msg)
        hold = self._live_hold()
        if hold is not None:
            raise StateError(C.LWO_ERR_BUSY, (
                "lwo.torch: a backward pass through streamed modules: a CUDA graph captured on "
                "stream 0x%x holds this handle's lwo ring: release it first (del graph, "
                "graph.reset() or handle.release_graph())") % (hold.stream or 0))

    def _leave_capture(self, hold):
        """Before torch ends the capture: releases what the pass still holds
        (in the capture, on its stream), puts the planner and the statistics
        back as they were before it, and leaves (lwo_ring_capture_leave). The
        graph holds the ring from here."""
        stream = hold.stream
        self._joined = None
        first = None
        try:
            held = self._held
            if held is not None:
                self._held = None
                try:
                    self._release(held[0], held[1], held[2])
                except Error as e:
                    first = e
            for idx, (t, _v) in list(self._prefetched.items()):
                try:
                    self._release(self.records[idx], t, stream)
                except Error as e:
                    first = first or e
        finally:
            self._prefetched.clear()
            self._live = 0
            self.planner.restore(hold.planner)
            self._cap_planner = hold.planner
            self._stats_on = hold.stats
            self._steps_seen = -1
        try:
            self.ring.capture_leave(stream)
        except Error as e:
            # The capture ended or failed without the ring (the library then
            # dropped the ring's part of it), or a ticket is live (it stays in
            # the capture: _capture_failed drops it once torch's end failed).
            if e.status == C.LWO_ERR_CAPTURING:
                hold.state = "dropped"
            raise type(e)(e.status, "lwo.torch: leaving the CUDA graph capture on stream "
                          "0x%x before torch ends it: %s" % (stream or 0, e.message)) from None
        hold.state = "held"
        self._hold = hold
        if first is not None:
            raise first

    def _capture_failed(self, hold):
        """torch could not end the capture: the ring is given back."""
        try:
            if hold.state == "joined":  # still in it: the leave now drops its part
                self.ring.capture_leave(hold.stream)
            elif hold.state == "held":
                self._release_hold(hold, "its capture failed")
        except Error:
            pass
        if hold.state != "held":
            hold.state = "dropped"
        if self._hold is hold and hold.state != "held":
            self._hold = None

    def _graph_bound(self, hold, graph):
        """torch ended the capture: the graph holds the ring. Its replay hook
        and destroy callback are registered; a capture in which lwo.torch
        refused a call gives the ring back at once (its replays are
        refused)."""
        if hold.state != "held":
            return
        hold.watch = tuple((rec, rec.current_version()) for rec in self.records
                           if rec.resident or rec.quantized or self._checkpoint is not None)
        hold.unhook = _graph_callbacks(graph, hold.replay_started, hold.destroyed)
        if hold.error is not None:
            self._release_hold(hold, "lwo.torch refused a call in its capture: %s" % hold.error)

    def _live_hold(self):
        """The graph hold of this handle (or None), once a hold whose graph was
        destroyed or reset is released."""
        hold = self._hold
        if hold is not None and hold.gone:
            try:
                self._release_hold(hold, "the graph was destroyed or reset")
            except Error:
                pass
            hold = self._hold
        return hold

    def _release_hold(self, hold, why):
        """lwo_ring_capture_release of the graph's hold, ordered after its
        replays: on the stream of the last one (the others joined into it
        first), or on the capture's stream if it never replayed. From here
        the graph refuses to replay."""
        if hold.state != "held":
            return
        streams = hold.streams
        last = streams[-1] if streams else hold.stream
        if len(streams) > 1:
            self.backend.order_streams(last, streams[:-1])
        self.ring.capture_release(last)
        hold.state = "released"
        hold.why = why
        if self._hold is hold:
            self._hold = None

    # ----------------------------------------------------------------
    # Public
    # ----------------------------------------------------------------
    @property
    def modules(self):
        """The streamed modules, by name."""
        return {s.name: s.module for s in self.states}

    @property
    def cuda_graph(self):
        """The torch.cuda.CUDAGraph that holds the ring (captured with
        torch.cuda.graph, or by make_graphed_callables), or None."""
        hold = self._hold
        return None if hold is None else hold.graph()

    def release_graph(self):
        """Gives the ring back from the CUDA graph that holds it
        (lwo_ring_capture_release, ordered after the graph's replays), so
        that the model runs eagerly again; that graph refuses to replay from
        then on (lwo.StateError from its replay). Dropping the graph (del, or
        graph.reset()) does the same. Returns False if no graph held it."""
        if self._joined is not None:
            raise StateError(C.LWO_ERR_CAPTURING, "lwo.torch: release_graph() during a CUDA "
                             "graph capture the ring is in (stream 0x%x): the ring leaves as "
                             "the capture ends, and its graph holds it from then on"
                             % (self._joined.stream or 0))
        hold = self._hold
        if hold is None:
            return False
        self._release_hold(hold, "handle.release_graph()")
        return True

    def record_names(self):
        """For each record (in pool order), the names of its modules."""
        return [[s.name for s in rec.modules] for rec in self.records]

    def plan(self, kind="train"):
        """The current prefetch plan of a kind of step ("train" or "forward"):
        the record index of each streamed module call, in order."""
        return list(self.planner.plans[kind])

    def mark_changed(self, modules=None):
        """Declares that streamed weights were written behind the tensors'
        version counters (through .data, or raw pointers): the next stage of
        their records copies them again. modules: None (every record), a
        module, a module name, or a list of them. Call it only while no
        forward or backward is running."""
        recs = self._records_of(modules)
        for rec in recs:
            self._layer_changed(rec)
            rec.version = rec.current_version()
            ent = self._prefetched.pop(rec.index, None)
            if ent is not None:
                self._release(rec, ent[0], self.backend.current_stream(self._dev_index))
            if self._held is not None and self._held[0] is rec:
                self._release_all()

    def _records_of(self, modules):
        if modules is None:
            return list(self.records)
        if isinstance(modules, (str, nn.Module)):
            modules = [modules]
        by_name = {s.name: s for s in self.states}
        out = []
        for m in modules:
            if isinstance(m, str):
                s = by_name.get(m)
            else:
                s = getattr(m, "_lwo_state", None)
            if s is None or s.handle is not self:
                raise KeyError("lwo.torch: %r is not a module streamed by this handle" % (m,))
            if s.record not in out:
                out.append(s.record)
        return out

    def zero_grad(self):
        """Sets the streamed parameters' grad to None and starts new sums
        now (what optimizer.zero_grad() does, and the next backward pass
        would notice)."""
        if self.grads is None:
            return
        for p in list(self._exposed):
            p.grad = None
        self._exposed.clear()
        self._exposed_gen += 1
        self.grads.zero()
        self._got_grad.clear()

    def synchronize(self):
        """Waits for every copy and computation of the handle's engine, and
        for the gradients (the fence: after a replay of a captured training
        step, param.grad holds its sums from here)."""
        self.backend.synchronize()
        if self.grads is not None and self._joined is None:
            self.grads.wait()

    def stats(self, reset=False):
        """The ring's and the gradient set's statistics (lwo_ring_stats,
        lwo_grads_stats), the planner's counts, and with stats=True the
        per-record figures (see layer_stats)."""
        out = {"ring": self.ring.stats()._asdict() if self.ring is not None else {},
               "planner": self.planner.stats(),
               "records": len(self.records), "pool_bytes": sum(r.bytes for r in self.records),
               "depth": self.depth, "resident": len(self.resident),
               "quant": {"modules": dict(self.quantized),
                         "saved_bytes": sum(r.saved_bytes for r in self.records)}}
        if self.grads is not None:
            out["grads"] = self.grads.stats()._asdict()
        if self._stats_on:
            out["layers"] = self.layer_stats()
        if reset:
            self.reset_stats()
        return out

    def layer_stats(self):
        """Per record, with stats=True (else only the access counts): its
        modules, accesses, stages, hits, bytes copied, the copy time on the
        transfer stream (from the stage's place in that stream to the copy's
        end, so it includes waiting for the slot to be free: an upper bound
        of the copy), the bandwidth that gives (a lower bound), and the stall:
        how long the compute stream stood waiting for the record in
        lwo_ring_acquire. Synchronizes the device."""
        self._fold_events()
        out = []
        for rec in self.records:
            out.append({
                "record": rec.index, "name": rec.name,
                "modules": [s.name for s in rec.modules], "bytes": rec.bytes,
                "quantized": rec.quantized, "saved_bytes": rec.saved_bytes,
                "accesses": rec.n_accesses, "stages": rec.n_stages, "hits": rec.n_hits,
                "bytes_copied": rec.bytes_copied, "copy_ms": rec.copy_ms,
                "stall_ms": rec.stall_ms,
                "bandwidth_gbps": (rec.bytes_copied / rec.copy_ms / 1e6) if rec.copy_ms else 0.0,
            })
        return out

    def reset_stats(self):
        self._fold_events()
        if self.ring is not None:
            self.ring.reset_stats()
        for rec in self.records:
            rec.n_stages = rec.n_hits = rec.bytes_copied = rec.n_accesses = 0
            rec.copy_ms = rec.stall_ms = 0.0

    # Set by offload(process_group=): this rank, the ranks, lwo's
    # communicator of them (an lwo.NcclComm) and how it was made; the ranks
    # per node (sharing one copy of the weights), this rank's node, the
    # communicators of its node (the pool's shards) and of its replicas
    # (the same shard on every node; None with one node), and the host
    # threads of this rank (0: one per core).
    rank, world_size, comm, comm_path, process_group = 0, 1, None, None, None
    node_size, node, shard_comm, replica_comm, _host_threads = 1, 0, None, None, 0

    def _join_group(self, dist):
        """The group's ranks and lwo's communicators of them (a _Dist from
        _dist_join), before the pool is made over them."""
        for k in ("rank", "world_size", "comm", "comm_path", "process_group", "node_size",
                  "node", "shard_comm", "replica_comm"):
            setattr(self, k, getattr(dist, k))
        self._host_threads = dist.host_threads

    def _gather_full(self):
        """{state_dict name: a new CPU tensor of the whole tensor} of every
        streamed parameter: each record staged through the ring (a stage of
        a sharded pool all-gathers the record from the ranks' shards, after
        lwo's update of it and any write noticed here) and its tensors
        copied out. A collective of the pool's ranks: every rank calls it
        alike, between steps."""
        if self._joined is not None or self._hold is not None:
            raise StateError(C.LWO_ERR_CAPTURING, "lwo.torch: the whole tensors of a sharded "
                             "pool while a CUDA graph holds the handle's ring: "
                             "handle.release_graph() first")
        cur = self.backend.current_stream(self._dev_index)
        if self._span is not None:
            self._end_span()
        self._release_all()
        for idx, (t, _v) in list(self._prefetched.items()):
            self._release(self.records[idx], t, cur)
        self._prefetched.clear()
        out = {}
        for rec in self.records:
            v = rec.current_version()
            if v != rec.version:
                self._layer_changed(rec)
                rec.version = v
            t = self.ring.stage(rec.index)
            try:
                base = self.ring.acquire(t, cur)
                for s in rec.modules:
                    for key, off, shape in (("weight", s.w_off, s.w_shape),
                                            ("bias", s.b_off, s.b_shape)):
                        if shape is not None:
                            out[_qualified(s.name, key)] = self.backend.read_device(
                                base + off, s.dtype, shape, cur)
            finally:
                self.ring.release(t, cur)
        return out

    def full_state_dict(self):
        """The model's state_dict() with every streamed parameter whole, in
        its own shape: where the parameters are split over ranks (a pool
        sharded over several), each is put together from the ranks' shards
        through lwo's all-gather (a record's stage), new CPU tensors; a
        collective, which every rank of the pool calls alike, between steps.
        Otherwise the same as model.state_dict()."""
        model = self.model_ref()
        if model is None:
            raise StateError(C.LWO_ERR_INVALID_HANDLE, "lwo.torch: full_state_dict() of a "
                             "handle whose model is gone")
        sd = model.state_dict()
        if self.closed or not self._split():
            return sd
        for k, t in self._gather_full().items():
            if k in sd:
                sd[k] = t
        return sd

    def load_full_state_dict(self, state_dict, strict=True):
        """model.load_state_dict(state_dict, strict) of whole tensors (as
        full_state_dict() gives them, on any rank): each streamed parameter
        split over ranks takes its rank's elements of its tensor (a tensor of
        another shape is a ValueError naming it). Not a collective; the
        writes are noticed as any in-place write is (the records copied
        again, lwo.torch.optim's masters set from them)."""
        model = self.model_ref()
        if model is None or self.closed:
            raise StateError(C.LWO_ERR_INVALID_HANDLE, "lwo.torch: load_full_state_dict() of a "
                             "closed handle, or one whose model is gone")
        sd = collections.OrderedDict(state_dict)
        if self._split():
            for k, sh in self.param_shards().items():
                t = sd.get(k)
                if t is None:
                    continue
                if tuple(t.shape) != tuple(sh.shape):
                    raise ValueError("lwo.torch: load_full_state_dict: %r has shape %s, not the "
                                     "model's %s" % (k, tuple(t.shape), tuple(sh.shape)))
                sd[k] = t.reshape(-1)[sh.first:sh.first + sh.n_elements]
        return model.load_state_dict(sd, strict=strict)

    def close(self, device=None):
        """Puts every streamed weight back into an ordinary tensor (the same
        Parameter objects, so optimizers keep them): on `device` (default:
        the device lwo streamed to; "cpu" keeps them in host memory), then
        destroys the ring, the gradient set and the pool. Gradients in
        param.grad are copied likewise."""
        if self.closed:
            return
        if self._joined is not None:
            raise StateError(C.LWO_ERR_CAPTURING, "lwo.torch: close() during a CUDA graph "
                             "capture the handle's ring is in (stream 0x%x): end the capture "
                             "first" % (self._joined.stream or 0))
        if self._hold is not None:
            self._release_hold(self._hold, "its handle was closed")
        target = torch.device(device) if device is not None else self.device
        for b in list(self._optims):
            b.detach(final=True, keep=False)  # the state ends with the handle
        if self.grads is not None:
            self.grads.wait()
        self._release_all()
        for idx, (t, _v) in list(self._prefetched.items()):
            self.ring.release(t, self.backend.current_stream(self._dev_index))
        self._prefetched.clear()
        self._live = 0
        self.synchronize()
        # Parameters split over ranks come back whole (a collective); their
        # gradient shards have no whole tensor to go to: dropped.
        full = self._gather_full() if self._split() else None
        dropped = []
        with torch.no_grad():
            for s in self.states:
                m = s.module
                m.__class__ = type(m)._lwo_base_class
                del m._lwo_state
                _torch_compile.remove(s)
                for p, key in ((s.weight, "weight"), (s.bias, "bias")):
                    if p is None:
                        continue
                    g = p.grad
                    p.grad = None
                    if full is not None:
                        src = full[_qualified(s.name, key)]
                        if g is not None:
                            dropped.append(_qualified(s.name, key))
                            g = None
                    else:
                        src = p.data if self._checkpoint is None else \
                            self._checkpoint.dense(s, p)
                    p.data = src.to(target, copy=True)
                    if p in self._grad_dtypes:
                        p.grad_dtype = self._grad_dtypes.pop(p)
                    if g is not None:
                        p.grad = g.to(target, dtype=getattr(p, "grad_dtype", None) or g.dtype,
                                      copy=True)
        if dropped:
            warnings.warn("lwo.torch: close(): the gradients of %d parameters split over %d "
                          "ranks were dropped (%s): a rank holds a shard of each, not the "
                          "tensor; close after optimizer.step()" % (
                              len(dropped), self.pool.info().n_ranks,
                              ", ".join(dropped[:4]) + (", ..." if len(dropped) > 4 else "")),
                          RuntimeWarning, stacklevel=2)
        self._exposed.clear()
        self._exposed_gen += 1
        self._grad_views.clear()
        self.closed = True
        if self.ring is not None:
            self.ring.close()
        self.grads = None
        # The gradient set and the pool go with the last tensor over them.
        self.pool = None
        if self._checkpoint is not None:
            self._checkpoint.release()
        if self.comm is not None:  # after the ring, the gradient set and the pool over them
            _close_comms(self.replica_comm, self.shard_comm, self.comm)
            self.comm = self.shard_comm = self.replica_comm = None
        model = self.model_ref()
        if model is not None and getattr(model, "_lwo_handle", None) is self:
            del model._lwo_handle

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        return "<lwo.torch.Offload %d modules in %d records, %.1f MiB, depth %d%s>" % (
            len(self.states), len(self.records), sum(r.bytes for r in self.records) / 2**20,
            self.depth, ", closed" if self.closed else "")


def _autocast_any(x):
    try:
        return torch.is_autocast_enabled(x.device.type)
    except TypeError:  # torch < 2.4
        return torch.is_autocast_enabled() if x.is_cuda else torch.is_autocast_cpu_enabled()


def _conv_padding(m):
    p = m.padding
    if isinstance(p, str):
        if p == "valid":
            return (0, 0)
        # 'same': stride 1; lwo pads symmetrically, so the total must be even
        out = []
        for k, d in zip(m.kernel_size, m.dilation):
            total = d * (k - 1)
            if total % 2:
                return None
            out.append(total // 2)
        return tuple(out)
    return tuple(int(v) for v in p)


def _unsupported(name, m, meta_ok=False):
    """Why lwo cannot compute module m (None if it can; meta_ok: a weight on
    the meta device is read from a checkpoint)."""
    w = getattr(m, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dtype not in _LWO_DTYPE:
        return "weight dtype %s (lwo computes f32, bf16 and f16)" % (
            getattr(w, "dtype", None),)
    if w.device.type == "meta" and not meta_ok:
        return "weight on the meta device (no data to move; offload(checkpoint=) reads it)"
    if m.bias is not None and m.bias.dtype != w.dtype:
        return "bias dtype %s differs from the weight's %s" % (m.bias.dtype, w.dtype)
    if w.numel() == 0:
        return "empty weight"
    if isinstance(m, nn.Conv2d):
        if m.padding_mode != "zeros":
            return "padding_mode %r (lwo pads with zeros)" % m.padding_mode
        if _conv_padding(m) is None:
            return "padding='same' with an odd total padding (lwo pads symmetrically)"
    if getattr(m, "_lwo_state", None) is not None:
        return "already streamed by another handle"
    return None


def _groups_of(targets, group):
    """Group key of each target module name."""
    if group is None:
        return {}
    out = {}
    if callable(group):
        for name, m in targets:
            key = group(name, m)
            if key is not None:
                out[name] = ("group", key)
        return out
    prefixes = [group] if isinstance(group, str) else list(group)
    for name, m in targets:
        for p in prefixes:
            base = p[:-1] if p.endswith(".") else p
            if name == base or name.startswith(base + "."):
                out[name] = ("group", base)
                break
    return out


def _quant_choice(targets, quant, trainable=False):
    """({name: lwo_quant_format_t} of the linears and convolutions streamed
    quantized: the frozen ones, and with `trainable` (quant_trainable=) the
    trainable ones of a format that trains; {name: why not} of the others
    quant= would have taken)."""
    if quant is None:
        return {}, {}
    fixed = None if callable(quant) else _core.quant_format(quant)  # ValueError: unknown
    chosen, why_not = {}, {}
    for name, m in targets:
        fmt = _core.quant_format(quant(name, m)) if fixed is None else fixed
        if fmt == C.LWO_QUANT_NONE:
            continue
        if m.weight.requires_grad or (m.bias is not None and m.bias.requires_grad):
            if not trainable:
                why_not[name] = ("trainable (quantized weights are frozen unless "
                                 "quant_trainable=True)")
                continue
            if fmt not in _TRAINABLE_QUANT:
                why_not[name] = ("trainable, and %s does not train (only fp8-block does)"
                                 % _core.quant_spelling(fmt))
                continue
        try:  # the shape and the format: lwo_quant_layout's rules
            _core.quant_layout(fmt, _quant_shape(m.weight), _LWO_DTYPE[m.weight.dtype])
        except ArgumentError as e:
            why_not[name] = e.message
            continue
        chosen[name] = fmt
    return chosen, why_not


def offload(model, *, filter=None, group=None, depth=None, grads_depth=2, device=None,
            stats=False, timing=False, quant=None, quant_trainable=False, budget=None, plan=True,
            progress=None, checkpoint=None, checkpoint_key=None, checkpoint_init=None, checkpoint_copy=False,
            process_group=None, dist_comm=None, node_size=None, _backend=None):
    """Streams the weights of `model`'s nn.Linear and nn.Conv2d modules
    through lwo. Returns an :class:`Offload` handle (also reachable as
    ``lwo.torch.handle_of(model)``).

    filter:  ``filter(name, module) -> bool``: which of those modules to
             stream (default: all that lwo can compute; the others, with
             their reasons, are in ``handle.skipped``).
    group:   one record per module (None), or records that hold several:
             a callable ``group(name, module) -> key`` (modules with the same
             key share one record; None: a record of its own) or a list of
             module-name prefixes ("model.layers.3" takes every streamed
             module under it). A record moves in one copy.
    depth:   device slots of the ring (each the size of the largest record).
             None (the default): the plan chooses it (2 until then; 2
             without a plan).
    budget:  device bytes lwo and the model may use: bytes (int), a string
             ("16GiB", "512MB", "25%" of the device's free memory) or a
             share of the free memory (0 < float <= 1). It covers the
             ring's slots, the resident records, the gradient staging and
             lwo's workspaces, and what the model keeps on the device
             (parameters and buffers lwo does not stream); not activations.
             None: lwo's own bytes at most a third of the streamed
             weights' (or the smallest ring, if more). A budget below the
             smallest ring is an lwo.ResourceError (LWO_ERR_OVER_BUDGET)
             naming the bytes needed.
    plan:    True (the default): after one warm-up step, lwo measures two
             steps (each record's forward and backward time on the device,
             with CUDA events; the least of the two) and at the start of
             the next with no gradient sum running merges small records,
             then asks the library's planner (lwo_plan_create, the link
             calibrated then) for the records (consecutive modules grouped
             into one record, unless group= is given), the ring depth
             (unless depth= is given) and the records kept resident within
             the budget, and applies it: the pool is built again (the same
             Parameter objects, over the new pool's bytes) and the ring made
             again. Training steps far from the prediction (three in a row,
             off by more than a quarter) make it plan depth and residents
             again, at most twice. ``handle.plan_info`` holds the plan and
             the times it came from, ``handle.step_times()`` each step's
             measured time beside the prediction. False: records and depth
             as given, nothing measured.
    grads_depth: device staging slots for weight gradients.
    progress: the load's progress on stderr (copying the weights into the
             pool, quantizing them with quant=): None (the default) shows it
             once the load has taken 2 s (a bar on a terminal, else a line per
             quarter), True from the start, False never.
    device:  the CUDA device to stream to (default: where the model's other
             parameters are, else the current device). The rest of the model
             is moved there.
    stats:   per-record stall and copy times (CUDA events on every stage and
             acquire; adds host overhead): ``handle.layer_stats()``.
    timing:  lwo's own ring timing (LWO_RING_TIMING): ``handle.stats()``
             has copy_ms, wait_ms and bandwidth_gbps for the whole ring.
    quant:   stream the weights of frozen nn.Linear and nn.Conv2d modules
             quantized (a convolution's as [out, in / groups * kh * kw]): a
             format ("fp8", "fp8-block", "int8", "int4", or see
             lwo.quant_format), or ``quant(name, module) -> format or None``.
             A linear whose weight and bias both have requires_grad False
             when offload() runs is quantized on load into the pool
             (lwo_pool_write_quantized) and computed from its quantized slot
             (lwo_linear_desc.weight_format: dequantized on the GPU into a
             workspace, then the same GEMM; dx in backward, never dW). Its
             weight parameter becomes a frozen CPU tensor of the dequantized
             values (what lwo computes with); writing it in place quantizes
             it again. Trainable modules and shapes the format does not take
             (int4: in_features, or in / groups * kh * kw, a multiple of 128)
             stay dense:
             ``handle.quant_skipped`` says which and why, ``handle.quantized``
             lists the others. In a group, the quantized modules make a
             record of their own.
    quant_trainable: True: trainable modules are quantized too, where quant=
             gives them fp8-block (LWO_QUANT_FP8_E4M3_BLOCK128, the format
             that trains; any other leaves them dense, said in
             ``handle.quant_skipped``): their weights travel to the GPU as
             e4m3 codes with one f32 scale per 128 x 128 block, forward and
             dx compute from the dequantized weight, and dW comes back in
             the weight's dtype into param.grad. The parameter keeps the
             weight's own values (the master the pool's quantization is made
             from): an optimizer that updates it in place (any
             torch.optim.Optimizer) has the layer quantized again before its
             next stage; lwo.torch.optim keeps f32 masters on the host, made
             from the parameter, and its updates write the new codes and
             scales (fused into the update) - the parameter then follows
             the masters at ``opt.sync_params()``, ``opt.state_dict()``, the
             model's ``state_dict()`` and ``handle.close()``. Not with
             checkpoint= (NotImplementedError).
    checkpoint: a safetensors checkpoint to read the model's weights from (a
             .safetensors file, a sharded *.safetensors.index.json, or a
             folder holding one), typically for a model built on the meta
             device. The streamed weights and biases are mapped in place: the
             pool is lwo's read-only pool over the mapped files
             (lwo_pool_create_from_checkpoint, registered for DMA), and each
             parameter a frozen CPU tensor over the file's bytes (no copy);
             an F8_E4M3 weight with its "<name>_scale_inv" block scales
             streams as it is (fp8-block). Everything else the model holds is
             loaded from the file onto the device, tensor by tensor. Names are
             the model's state_dict names (peft's "base_model.model." and
             ".base_layer" taken out where the file has the plain name).
             ``handle.checkpoint_info`` reports what came from where;
             docs/PYTHON.md has the rules and the errors.
    checkpoint_key: the file's name of each model name: a str (a prefix
             put before the model's names) or a callable ``name -> file name``
             (None: not from the file).
    checkpoint_init: ``init(name, module)``, called for each module holding
             tensors on the meta device that the file does not have (new
             adapters, non-persistent buffers), once they are allocated on the
             device, to set them. Without it such a parameter is an error; a
             non-persistent buffer (a rotary inv_freq) is made by the model's
             transformers _init_weights where it has one.
    checkpoint_copy: True: the streamed weights are read into lwo's pinned
             pool tensor by tensor (cast to the model's dtype where it
             differs) instead of mapped, and keep their requires_grad (to
             train them); quant= implies it.

    process_group: a torch.distributed process group (or
             torch.distributed.group.WORLD) whose ranks stream the model
             together. lwo makes its own communicator from it (a collective:
             every rank of the group calls offload alike): split from the
             group's NCCL communicator where PyTorch gives its address
             (ProcessGroupNCCL._comm_ptr, lwo_nccl_comm_split), else from an
             NCCL unique id made on the group's first rank and broadcast over
             the group (broadcast_object_list; any backend, gloo included).
             ``handle.rank``, ``handle.world_size``, ``handle.comm_path``
             ("split" or "unique-id"). The weights then stream through
             lwo's sharded pool over that communicator
             (lwo_pool_create_sharded, made collectively: each rank holds
             1/N of every record and a stage all-gathers it), and the
             weight gradients go through its sharded sink: f32 on the wire,
             reduce-scattered over the ranks into the shard owner's f32 host
             buffer (lwo_grads_shard), which param.grad views and
             lwo.torch.optim updates the rank's shard from. With one rank
             the results are those without a group, bit for bit, where the
             gradients are f32 (a bf16 or f16 model's gradients travel in
             f32 here, in their own dtype without a group). Not with
             checkpoint= or quant= (NotImplementedError); no plan (plan=
             is ignored: the library's planner does not plan sharded pools),
             no record kept resident.
             Over several ranks of a node the pool is sharded over them and
             each streamed parameter (weight, bias) is split: a flat 1-D
             Parameter over this rank's elements [first, first + n) of the
             tensor (row-major, n possibly 0; a view of the pool, no copy),
             param.grad the matching view of the f32 gradient shard, so any
             optimizer updates the rank's elements (``handle.param_shards()``
             names each one's full shape and range). model.state_dict() then
             holds each rank's shards; ``handle.full_state_dict()`` the whole
             tensors, and close() puts them back whole (both collectives,
             through lwo's all-gather; close() drops the gradient shards);
             ``handle.load_full_state_dict()`` loads whole tensors.
             Proven on the host backend with 2 ranks, 2 nodes of 2 and of 1 (ranks
             as threads of one process: python/tests/test_torch_dist.py); on
             GPUs with one rank (scripts/torch-dist-check; it checks 2 ranks
             where a machine has two GPUs).
    dist_comm: None (the default: "split" where the group's NCCL
             communicator is reachable, else "unique-id"), "split" or
             "unique-id" (the path to take, or an error).
    node_size: ranks per node, which share one copy of the weights (None:
             the LOCAL_WORLD_SIZE that torchrun sets where it divides the
             group's size, else the whole group is one node); it must divide
             the group's size, and ranks r and r' share a node when r //
             node_size == r' // node_size. lwo's communicator of the group
             is split (lwo_nccl_comm_split) into the node's (the pool is
             sharded over it) and the replicas' (the ranks holding the same
             shard on each node; the gradient set all-reduces its sums over
             it, so each rank's gradient shard is the sum over every rank of
             the group). Host resources are the node's, shared by its ranks:
             the gradient set's and lwo.torch.optim's host threads (n_threads
             0) are the cores / node_size, and an engine lwo.torch made with
             the derived host memory limit gets the derived limit /
             node_size (a limit the caller set is left alone).
             ``handle.node_size``, ``handle.node``.

    Create optimizers after offload(): the streamed parameters are new
    Parameter objects (CPU tensors over the pool)."""
    if stats and timing:
        raise ValueError("lwo.torch.offload: stats=True (per record) and timing=True (lwo's "
                         "ring timing, whose reads block) cannot be combined")
    if depth is not None and int(depth) < 1:
        raise ValueError("lwo.torch.offload: depth must be >= 1, got %r" % (depth,))
    if budget is not None and not plan:
        raise ValueError("lwo.torch.offload: budget= is applied by the plan; it needs plan=True")
    if not isinstance(model, nn.Module):
        raise TypeError("lwo.torch.offload: %r is not a torch.nn.Module" % (model,))
    if checkpoint is None and (checkpoint_key is not None or checkpoint_init is not None
                               or checkpoint_copy):
        raise ValueError("lwo.torch.offload: checkpoint_key, checkpoint_init and "
                         "checkpoint_copy go with checkpoint=")
    if dist_comm not in (None, "split", "unique-id"):
        raise ValueError("lwo.torch.offload: dist_comm must be None, 'split' or 'unique-id', "
                         "got %r" % (dist_comm,))
    if dist_comm is not None and process_group is None:
        raise ValueError("lwo.torch.offload: dist_comm goes with process_group=")
    if node_size is not None and process_group is None:
        raise ValueError("lwo.torch.offload: node_size goes with process_group=")
    if quant_trainable and quant is None:
        raise ValueError("lwo.torch.offload: quant_trainable=True needs quant= (the format: "
                         "\"fp8-block\" is the one that trains)")
    if quant_trainable and checkpoint is not None:
        raise NotImplementedError(
            "lwo.torch.offload: quant_trainable=True with checkpoint=: a checkpoint's weights "
            "stream frozen when quantized; load the checkpoint into the model first, then "
            "offload(model, quant=\"fp8-block\", quant_trainable=True)")
    dist_ranks = None
    if process_group is not None:
        dist_ranks = _group_ranks(process_group)
        dist_ranks = dist_ranks + (_node_size(node_size, dist_ranks[1]),)
        if checkpoint is not None or quant is not None:
            raise NotImplementedError(
                "lwo.torch.offload: process_group= with %s: with a group the weights stream "
                "through a sharded pool (lwo_pool_create_sharded), which holds neither a "
                "checkpoint's mapped files nor quantized weights" % (
                    "checkpoint=" if checkpoint is not None else "quant="))
    t_start = time.perf_counter()

    # Which device.
    if _backend is None:
        if device is None:
            device = _model_device(model)
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError("lwo.torch.offload: lwo streams to a CUDA device, not %s" % device)
        if not torch.cuda.is_available():
            # lwo's own message says which of no driver / no GPU / old GPU it is.
            _Backend(device.index or 0)
            raise RuntimeError("lwo.torch.offload: torch sees no CUDA device")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        backend = _Backend(device.index)
    else:
        backend = _backend
        device = torch.device(backend.device_type, getattr(backend, "device_index", None)) \
            if backend.device_type == "cuda" else torch.device(backend.device_type)

    # Which modules.
    targets, skipped = [], {}
    shared = _shared_params(model)
    for name, m in model.named_modules():
        if not isinstance(m, (nn.Linear, nn.Conv2d)):
            continue
        if filter is not None and not filter(name, m):
            continue
        why = _unsupported(name, m, meta_ok=checkpoint is not None)
        if why is None:
            for key in ("weight", "bias"):
                p = getattr(m, key, None)
                if p is not None and len(shared.get(id(p), ())) > 1:
                    why = "%s shared with %s" % (key, ", ".join(
                        n for n in shared[id(p)] if n != name))
                    break
        if why is not None:
            skipped[name] = why
            continue
        targets.append((name, m))
    source = None
    if checkpoint is not None:
        # Everything the file and the model must agree on is checked before
        # anything changes; then what lwo does not stream is loaded.
        from . import _torch_checkpoint
        source = _torch_checkpoint.prepare(model, checkpoint, targets, device,
                                           key=checkpoint_key, init=checkpoint_init,
                                           copy=bool(checkpoint_copy) or quant is not None)
        source.load_resident(device)
    if not targets:
        if not skipped:
            raise ValueError("lwo.torch.offload: no nn.Linear or nn.Conv2d module to stream")
        # Every candidate is one lwo leaves to PyTorch: they stay resident, as
        # documented; the handle streams nothing.
        warnings.warn("lwo.torch.offload: nothing to stream, every nn.Linear / nn.Conv2d "
                      "stays in PyTorch (%s)" % "; ".join("%s: %s" % kv for kv in
                                                          skipped.items()),
                      RuntimeWarning, stacklevel=2)
        handle = Offload._create_empty(model, device, backend, skipped)
        if backend.device_type == "cuda":
            model.to(device)
        model._lwo_handle = handle
        if source is not None:
            source.info["seconds"] = time.perf_counter() - t_start
            handle.checkpoint_info = source.info
        if process_group is not None:
            handle._join_group(_dist_join(process_group, dist_ranks, dist_comm, backend))
        return handle
    groups = _groups_of(targets, group)
    quantized, quant_skipped = _quant_choice(targets, quant, bool(quant_trainable))
    if source is not None:  # fp8 weights of the file stream as they are
        for name in source.fp8:
            quantized[name] = C.LWO_QUANT_FP8_E4M3_BLOCK128
            quant_skipped.pop(name, None)
    dist = None
    if process_group is not None:
        # lwo's communicator first: the pool is sharded over it
        dist = _dist_join(process_group, dist_ranks, dist_comm, backend)
    try:
        handle = Offload._create(model, targets, groups, 2 if depth is None else depth,
                                 grads_depth, device, stats, timing, backend, skipped, quantized,
                                 quant_skipped, progress, source, dist, quant_trainable)
    except BaseException:
        if dist is not None:
            dist.close()
        raise
    # The rest of the model goes to the device (the streamed weights stay).
    if backend.device_type == "cuda":
        model.to(device)
    model._lwo_handle = handle
    if source is not None:
        source.info["seconds"] = time.perf_counter() - t_start
        handle.checkpoint_info = source.info
    # No plan with a group: the library's planner does not plan a sharded pool
    # (lwo_plan_create: LWO_ERR_UNSUPPORTED), and with several ranks each
    # would choose from its own measured times, while the records, made
    # collectively, must agree.
    if plan and hasattr(backend, "plan") and dist is None:
        handle._setup_plan(budget, depth, group is None)
    return handle


def _group_ranks(process_group):
    """(rank, world size) of this process in a torch.distributed group."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("lwo.torch.offload: process_group= needs torch.distributed "
                           "initialized (torch.distributed.init_process_group)")
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError("lwo.torch.offload: this process is not a rank of process_group")
    return rank, dist.get_world_size(process_group)


def _node_size(node_size, world):
    """The ranks per node of a group of `world` ranks: node_size as given
    (it must divide world), or None: the LOCAL_WORLD_SIZE that torchrun sets
    where it divides world, else world (one node)."""
    if node_size is None:
        try:
            n = int(os.environ.get("LOCAL_WORLD_SIZE", ""))
        except ValueError:
            n = 0
        return n if n > 0 and world % n == 0 else world
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1 \
            or world % node_size:
        raise ValueError("lwo.torch.offload: node_size %r: it must be a positive integer that "
                         "divides the group's %d ranks" % (node_size, world))
    return node_size


def _host_cores():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _close_comms(*comms):
    """Destroys communicators in the order given (replica, shard, then the
    group's), each once (the shard communicator may be the group's)."""
    seen = set()
    for c in comms:
        if c is not None and id(c) not in seen:
            seen.add(id(c))
            c.close()


class _Dist:
    """What offload(process_group=) made of the group: this rank and the
    ranks, lwo's communicator of the group and the path it came by, the
    ranks per node and this rank's node, the communicators of the node (the
    pool is sharded over it) and of the rank's replicas on the other nodes
    (None with one node), and this rank's host threads (0: one per core)."""

    def __init__(self, rank, world_size, comm, comm_path, process_group, node_size,
                 shard_comm, replica_comm):
        self.rank, self.world_size, self.comm = rank, world_size, comm
        self.comm_path, self.process_group = comm_path, process_group
        self.node_size, self.node = node_size, rank // node_size
        self.shard_comm, self.replica_comm = shard_comm, replica_comm
        # the node's cores shared by its ranks (one rank: lwo's default)
        self.host_threads = 0 if node_size == 1 else max(1, _host_cores() // node_size)

    def close(self):
        _close_comms(self.replica_comm, self.shard_comm, self.comm)


def _node_host_limit(engine, node_size):
    """Where lwo.torch made `engine` with the derived host memory limit and
    the node holds node_size ranks, this rank's limit is the node's share:
    the derived limit / node_size (set once per engine; a limit set by the
    caller is left as it is)."""
    if node_size <= 1 or getattr(engine, "_lwo_node_size", None) is not None:
        return
    derived = getattr(engine, "_lwo_derived_host_limit", None)
    if not derived:
        return
    limit, _charged = engine.host_usage()
    if limit != derived:
        return  # set by the caller since
    engine.set_host_limit(derived // node_size)
    engine._lwo_node_size = node_size


def _nccl_comm_address(process_group):
    """The address of the group's NCCL communicator on its CUDA device
    (ProcessGroupNCCL._comm_ptr; verified on PyTorch 2.15), or 0 where the
    group has no NCCL backend, this PyTorch has no _comm_ptr, or the
    communicator is not made yet (PyTorch makes it at the group's first
    collective, or at once with init_process_group(device_id=))."""
    try:
        b = process_group._get_backend(torch.device("cuda"))
    except (AttributeError, RuntimeError, ValueError, TypeError):
        return 0
    fn = getattr(b, "_comm_ptr", None)
    if fn is None:
        return 0
    try:
        return int(fn() or 0)
    except (RuntimeError, TypeError, ValueError):
        return 0


def _dist_join(process_group, ranks, path, backend):
    """A _Dist of this process in `process_group` (ranks: its rank, the
    group's size and the ranks per node), on the backend's engine: lwo's
    communicator of the group, split (lwo_nccl_comm_split, collectives of
    the group) into the node's (color: the node) and the replicas' (color:
    the rank within its node) where the group spans several nodes."""
    engine = getattr(backend, "engine", None)
    if engine is None:
        raise RuntimeError("lwo.torch.offload: process_group= needs an lwo engine")
    rank, world, node_size = ranks
    comm, got = _dist_comm(process_group, engine, rank, world, path)
    shard = replica = None
    try:
        if node_size == world:
            shard = comm
        else:
            shard = engine.nccl_comm_split(comm, rank // node_size, rank)
            replica = engine.nccl_comm_split(comm, rank % node_size, rank)
        _node_host_limit(engine, node_size)
    except BaseException:
        _close_comms(replica, shard, comm)
        raise
    return _Dist(rank, world, comm, got, process_group, node_size, shard, replica)


def _dist_comm(process_group, engine, rank, world, path):
    """lwo's communicator of the group's ranks on `engine`: (NcclComm, path)."""
    import torch.distributed as dist
    if path in (None, "split"):
        address = _nccl_comm_address(process_group)
        if address:
            return engine.nccl_comm_split(address, 0, rank), "split"
        if path == "split":
            raise RuntimeError(
                "lwo.torch.offload: dist_comm='split': process_group has no NCCL communicator "
                "lwo can reach (a ProcessGroupNCCL whose communicator is made, on a PyTorch "
                "with ProcessGroupNCCL._comm_ptr); dist_comm='unique-id' works on any group")
    box = [bytes(_core.nccl_get_unique_id()) if rank == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(process_group, 0),
                               group=process_group)
    return engine.nccl_comm_create(box[0], world, rank), "unique-id"


def _model_device(model):
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_cuda:
            return t.device
    return torch.device("cuda")


def _shared_params(model):
    """id(param) -> the names of the modules holding it (one name per module)."""
    holders = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for p in m._parameters.values():
            if p is not None:
                holders.setdefault(id(p), {}).setdefault(id(m), mname)
    return {pid: list(mods.values()) for pid, mods in holders.items()}


def is_offloaded(module):
    """True if `module` is (or holds) a module streamed by lwo.torch."""
    return any(getattr(m, "_lwo_state", None) is not None for m in module.modules())


def handle_of(model):
    """The Offload handle that offload(model) returned (None if none)."""
    h = getattr(model, "_lwo_handle", None)
    return None if h is None or h.closed else h


# The streamed modules' forwards (after Offload, whose methods they call).
_linear_module_forward = _module_forward(_LinearFn, _linear_apply, Offload._linear_forward,
                                         _torch_compile.linear_forward)
_conv_module_forward = _module_forward(_ConvFn, _conv_apply, Offload._conv_forward,
                                       _torch_compile.conv_forward)


# lwo.torch.optim: AdamW and SGD over lwo's host optimizer.
from . import _torch_optim as optim  # noqa: E402
sys.modules[__name__ + ".optim"] = optim
