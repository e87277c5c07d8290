"""A CPU stand-in for the part of liblwo that lwo.torch calls, for tests
without a GPU: the same calls (lwo.torch._Backend's methods), the same
rules of the C API where a misuse would go unseen otherwise, and torch on
the CPU for the arithmetic.

- "Device" memory is host memory; pointers are addresses, as on the GPU.
- Pools: records laid out as lwo lays them (each tensor at a multiple of
  256 bytes), zero-filled.
- Rings: `depth` slots; a stage takes the layer's slot if it is still
  there, unchanged (a hit), else the free slot released longest ago (empty
  ones first) and copies the record into it then; LWO_ERR_LAYER_BUSY,
  LWO_ERR_RING_FULL, LWO_ERR_STALE_TICKET and LWO_ERR_TICKET_STATE as the
  library raises them. Releasing a slot fills it with NaN-like bytes (0xff)
  when the test asks for poison=True, so reading a released slot shows.
- Gradients: slots filled with 0xff at begin (a tensor not written shows),
  LWO_ERR_LAYER_BUSY / RING_FULL / TICKET_STATE as the library does; end
  queues the copy, and only wait() (the fence) lands it in the host buffer:
  assigned while the layer is fresh since the last zero, else added in f32
  and rounded once; wait() also zeroes the zeroed layers that got nothing.
- Compute: products in f32, rounded once to the layer's dtype, as lwo does.
- Quantized tensors (a TensorSpec with quant=): sized by liblwo's
  lwo_quant_layout, written by lwo_quantize (write_quantized), and a linear
  with weight_format dequantizes its weight with lwo_dequantize_host (these
  are host calls of the real library: they need no device) and refuses
  dweight and dbias with LWO_ERR_QUANTIZED_WEIGHT, as the library does.
- Checkpoint pools (pool_from_checkpoint, an lwo.Checkpoint and names= per
  layer): the mapping checked by the real lwo_checkpoint_map_tensors (a
  host call), the records laid out as lwo_pool_create_from_checkpoint lays
  them out (a layer whose tensors lie together in one file keeps the file's
  layout, else packed at 256 bytes; an F8_E4M3 weight with its
  "<name>_scale_inv" f32 scales in the layer is one fp8-block128 tensor of
  logical dtype bf16, its codes and scales two copy runs), read-only (writes
  and lwo_pool_tensor_host of an fp8 tensor are LWO_ERR_UNSUPPORTED). Rings
  copy from a read-only mapping of the files this fake makes itself, run by
  run, as the library copies from its own.
"""

import collections
import ctypes
import math
import mmap
import time

import numpy as np

import torch
import torch.nn.functional as F

import lwo
from lwo import _capi as C

_ALIGN = 256
_DT = {C.LWO_DTYPE_F32: torch.float32, C.LWO_DTYPE_BF16: torch.bfloat16,
       C.LWO_DTYPE_F16: torch.float16}

RingStats = lwo.RingStats
GradsStats = lwo.GradsStats
TensorInfo = lwo.TensorInfo


def _err(status, message):
    return lwo.error_class(status)(status, message)


def _at(address, dtype, shape):
    """A CPU tensor over host memory at `address`."""
    n = 1
    for d in shape:
        n *= int(d)
    if n == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    size = torch.empty((), dtype=dtype).element_size()
    buf = (ctypes.c_char * (n * size)).from_address(int(address))
    return torch.frombuffer(buf, dtype=dtype, count=n).view(tuple(shape))


def _bytes_at(address, nbytes):
    return _at(address, torch.uint8, (int(nbytes),))


class Memory:
    """Owns the host allocations that stand for device and host memory."""

    def __init__(self):
        self.blocks = []

    def alloc(self, nbytes, fill=0):
        t = torch.full((max(int(nbytes), 1) + _ALIGN,), fill, dtype=torch.uint8)
        self.blocks.append(t)
        addr = t.data_ptr()
        return addr + (-addr % _ALIGN)


class Pool:
    def __init__(self, backend, layers):
        self.backend = backend
        self.handle = id(self)
        self.layers = []
        self.version = []
        for tensors in layers:
            infos, off = [], 0
            for t in tensors:
                name, dt, shape = t[0], t[1], t[2]
                fmt = lwo.quant_format(t.quant if isinstance(t, lwo.TensorSpec) else None)
                n = 1
                for d in shape:
                    n *= d
                nbytes = lwo.quant_layout(fmt, shape, dt).total_bytes if fmt else \
                    n * lwo.dtype_size(dt)
                infos.append(TensorInfo(name, dt, tuple(shape), off, nbytes, fmt))
                off += nbytes + (-nbytes % _ALIGN)
            record = max(off, 0)
            host = backend.mem.alloc(record)
            self.layers.append((infos, record, host))
            self.version.append(0)
        self.runs = [[(0, host, record)] if record else [] for _i, record, host in self.layers]
        self.max_record = max([r for _i, r, _h in self.layers] + [0])

    kind = C.LWO_POOL_PINNED

    def info(self):
        return lwo.PoolInfo(len(self.layers), self.kind, sum(r for _i, r, _h in self.layers),
                            self.max_record, 0, 1)

    def run_bytes(self, layer):
        return sum(n for _o, _s, n in self.runs[layer])

    def copy_record(self, layer, dst):
        """What a ring's stage moves: the layer's copy runs, into `dst`."""
        for off, src, n in self.runs[layer]:
            _bytes_at(dst + off, n).copy_(_bytes_at(src, n))

    def tensors(self, layer):
        return self.layers[layer][0]

    def record_bytes(self, layer):
        return self.layers[layer][1]

    def tensor_host(self, layer, name):
        infos, _r, host = self.layers[layer]
        for i in infos:
            if i.name == name:
                return lwo.HostMemory(host + i.offset, i.bytes)
        raise _err(C.LWO_ERR_NOT_FOUND, "fake lwo_pool_tensor_host: no tensor %r" % name)

    def write_quantized(self, layer, name, data, src_dtype=None, n_threads=0):
        info = [i for i in self.layers[layer][0] if i.name == name][0]
        if not info.quant_format:
            raise _err(C.LWO_ERR_INVALID_ARGUMENT, "fake lwo_pool_write_quantized: %r is not "
                       "quantized" % name)
        q = lwo.quantize(data, info.quant_format, dtype=src_dtype, shape=info.shape)
        dst = self.tensor_host(layer, name)
        _bytes_at(dst.address, dst.bytes).copy_(torch.from_numpy(q.data.copy()))
        self.version[layer] += 1
        self.backend.calls["write_quantized"] += 1


def _align(n):
    return n + (-n % _ALIGN)


class CheckpointPool(Pool):
    """lwo_pool_create_from_checkpoint with names= (see the module's notes)."""

    kind = C.LWO_POOL_CHECKPOINT_MAPPED

    def __init__(self, backend, checkpoint, names):
        self.backend = backend
        self.handle = id(self)
        self.checkpoint = checkpoint
        checkpoint.map_tensors(names=names)  # LWO_ERR_NOT_FOUND as the library raises it
        by_name = {t.name: t for t in checkpoint.tensors()}
        files = checkpoint.files()
        self.maps = []
        self.bases = []
        for f in files:  # read-only, shared: as lwo maps them
            if not f.bytes:
                self.maps.append(None)
                self.bases.append(0)
                continue
            with open(f.path, "rb") as fh:
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            self.maps.append(mm)
            self.bases.append(np.frombuffer(mm, dtype=np.uint8).ctypes.data)
        self.layers, self.runs, self.version, self.hosts = [], [], [], []
        for li, group in enumerate(names):
            entries = [by_name[n] for n in group]
            for e in entries:
                if e.dtype is None or not lwo.dtype_size(e.dtype):
                    raise _err(C.LWO_ERR_BAD_DTYPE, "fake lwo_pool_create_from_checkpoint: "
                               "tensor %r is %s" % (e.name, e.dtype_name))
            present = {e.name for e in entries}
            scale_of = {}
            for e in entries:
                sc = e.name + "_scale_inv"
                if e.dtype == C.LWO_DTYPE_F8_E4M3 and sc in present:
                    st = by_name[sc]
                    want = ((e.shape[0] + 127) // 128, (e.shape[1] + 127) // 128) \
                        if len(e.shape) == 2 else None
                    if st.dtype != C.LWO_DTYPE_F32:
                        raise _err(C.LWO_ERR_BAD_DTYPE, "fake: scales %r are %s" % (
                            sc, st.dtype_name))
                    if want is None or tuple(st.shape) != want:
                        raise _err(C.LWO_ERR_SHAPE_MISMATCH, "fake: scales %r %s" % (
                            sc, st.shape))
                    scale_of[e.name] = st
            scales = {st.name for st in scale_of.values()}
            one_file = len({e.file for e in entries}) == 1
            total = sum(e.bytes for e in entries)
            lo = min(e.file_offset for e in entries)
            hi = max(e.file_offset + e.bytes for e in entries)
            file_layout = one_file and bool(entries) and hi - lo <= total + total // 4 + 4096 \
                and not scale_of
            infos, runs, off, host = [], [], 0, 0
            for e in entries:
                if e.name in scales:
                    continue
                addr = self.bases[e.file] + e.file_offset
                if e.name in scale_of:
                    lay = lwo.quant_layout(C.LWO_QUANT_FP8_E4M3_BLOCK128, e.shape, "bf16")
                    st = scale_of[e.name]
                    infos.append(TensorInfo(e.name, C.LWO_DTYPE_BF16, tuple(e.shape), off,
                                            lay.total_bytes, C.LWO_QUANT_FP8_E4M3_BLOCK128))
                    runs.append((off, addr, lay.data_bytes))
                    runs.append((off + lay.scale_offset, self.bases[st.file] + st.file_offset,
                                 lay.scale_bytes))
                    off = _align(off + lay.total_bytes)
                elif file_layout:
                    infos.append(TensorInfo(e.name, e.dtype, tuple(e.shape), e.file_offset - lo,
                                            e.bytes, 0))
                else:
                    infos.append(TensorInfo(e.name, e.dtype, tuple(e.shape), off, e.bytes, 0))
                    if e.bytes:
                        runs.append((off, addr, e.bytes))
                    off = _align(off + e.bytes)
            if file_layout:
                record = _align(hi - lo)
                host = self.bases[entries[0].file] + lo
                if hi > lo:
                    runs.append((0, host, hi - lo))
            else:
                record = off
            self.layers.append((infos, record, host))
            self.runs.append(runs)
            self.version.append(0)
        self.max_record = max([r for _i, r, _h in self.layers] + [0])
        if not self.max_record:
            raise _err(C.LWO_ERR_INVALID_ARGUMENT, "fake: every layer is empty")

    def tensor_host(self, layer, name):
        infos, _r, host = self.layers[layer]
        for i in infos:
            if i.name != name:
                continue
            if i.quant_format:
                raise _err(C.LWO_ERR_UNSUPPORTED, "fake lwo_pool_tensor_host: %r is an fp8 "
                           "weight and its scales, which lie apart" % name)
            t = [t for t in self.checkpoint.tensors() if t.name == name][0]
            return lwo.HostMemory(self.bases[t.file] + t.file_offset, i.bytes)
        raise _err(C.LWO_ERR_NOT_FOUND, "fake lwo_pool_tensor_host: no tensor %r" % name)

    def write_quantized(self, *a, **k):
        raise _err(C.LWO_ERR_UNSUPPORTED, "fake: the pool maps a checkpoint read-only")

    closed = False

    def close(self):
        live = [r for r in self.backend.rings if r.pool is self and not r.closed]
        if live:
            raise _err(C.LWO_ERR_BUSY, "fake lwo_pool_destroy: %d rings of the pool" % len(live))
        self.closed = True

    write = write_range = write_quantized


class Ring:
    def __init__(self, backend, pool, depth, timing, resident=()):
        self.backend, self.pool, self.depth = backend, pool, depth
        # resident layers: a device copy each, uploaded at creation and again
        # at a stage after a change; their tickets take no slot
        self.resident = {}
        for layer in resident:
            _i, record, host = pool.layers[layer]
            base = backend.mem.alloc(record)
            pool.copy_record(layer, base)
            self.resident[layer] = {"layer": layer, "version": pool.version[layer],
                                    "state": "resident", "ticket": 0, "order": -1,
                                    "base": base, "resident": True, "held": 0}
        self.slots = []   # [layer, version, state, ticket, released_order, base]
        for _ in range(depth):
            self.slots.append({"layer": None, "version": None, "state": "empty",
                               "ticket": 0, "order": -1,
                               "base": backend.mem.alloc(pool.max_record)})
        self.next_ticket = 1
        self.release_count = 0
        self.tickets = {}  # ticket -> slot
        self.n_stages = self.n_hits = self.n_copies = self.bytes_copied = 0
        self.log = []      # ("stage", layer, hit) / ("acquire", layer) / ("release", layer)
        self.closed = False

    def stage(self, layer):
        if layer >= len(self.pool.layers):
            raise _err(C.LWO_ERR_OUT_OF_RANGE, "fake lwo_ring_stage: layer %d" % layer)
        res = self.resident.get(layer)
        if res is not None:
            ver = self.pool.version[layer]
            if res["version"] != ver:
                if res["held"]:
                    raise _err(C.LWO_ERR_LAYER_BUSY, "fake lwo_ring_stage: resident layer %d "
                               "changed while held" % layer)
                _i, record, host = self.pool.layers[layer]
                self.pool.copy_record(layer, res["base"])
                res["version"] = ver
                self.n_copies += 1
                self.bytes_copied += self.pool.run_bytes(layer)
            t = self.next_ticket
            self.next_ticket += 1
            sl = {"layer": layer, "state": "staged", "ticket": t, "base": res["base"],
                  "res": res}
            res["held"] += 1
            self.tickets[t] = sl
            self.n_stages += 1
            self.n_hits += 1
            self.log.append(("stage", layer, True))
            return t
        for sl in self.slots:
            if sl["layer"] == layer and sl["state"] in ("staged", "acquired"):
                raise _err(C.LWO_ERR_LAYER_BUSY, "fake lwo_ring_stage: layer %d is busy"
                           % layer)
        free = [sl for sl in self.slots if sl["state"] in ("empty", "released")]
        if not free:
            raise _err(C.LWO_ERR_RING_FULL, "fake lwo_ring_stage: ring full (layer %d)" % layer)
        ver = self.pool.version[layer]
        hit = [sl for sl in free if sl["layer"] == layer and sl["version"] == ver]
        if hit:
            sl = hit[0]
        else:
            empty = [sl for sl in free if sl["state"] == "empty"]
            sl = empty[0] if empty else min(free, key=lambda s: s["order"])
            infos, record, host = self.pool.layers[layer]
            self.pool.copy_record(layer, sl["base"])
            self.n_copies += 1
            self.bytes_copied += self.pool.run_bytes(layer)
        t = self.next_ticket
        self.next_ticket += 1
        sl.update(layer=layer, version=ver, state="staged", ticket=t)
        self.tickets[t] = sl
        self.n_stages += 1
        self.n_hits += bool(hit)
        self.log.append(("stage", layer, bool(hit)))
        return t

    def _slot(self, ticket, call):
        sl = self.tickets.get(ticket)
        if sl is None:
            raise _err(C.LWO_ERR_FOREIGN_TICKET, "fake %s: ticket %d" % (call, ticket))
        if sl["ticket"] != ticket or sl["state"] not in ("staged", "acquired"):
            raise _err(C.LWO_ERR_STALE_TICKET, "fake %s: stale ticket %d" % (call, ticket))
        return sl

    def acquire(self, ticket, stream):
        sl = self._slot(ticket, "lwo_ring_acquire")
        if sl["state"] == "acquired":
            raise _err(C.LWO_ERR_TICKET_STATE, "fake lwo_ring_acquire: acquired twice")
        sl["state"] = "acquired"
        self.log.append(("acquire", sl["layer"]))
        return sl["base"]

    def release(self, ticket, stream):
        sl = self._slot(ticket, "lwo_ring_release")
        if "res" in sl:
            sl["res"]["held"] -= 1
        sl["state"] = "released"
        sl["order"] = self.release_count
        self.release_count += 1
        self.log.append(("release", sl["layer"]))

    def live(self):
        return sum(sl["state"] in ("staged", "acquired") for sl in self.slots)

    def stats(self):
        return RingStats(self.n_stages, self.n_hits, self.n_copies, self.bytes_copied,
                         0.0, 0.0, 0.0)

    def reset_stats(self):
        self.n_stages = self.n_hits = self.n_copies = self.bytes_copied = 0

    def info(self):
        return lwo.RingInfo(self.depth, self.depth - self.live(), self.pool.max_record)

    def close(self):
        if self.live():
            raise _err(C.LWO_ERR_BUSY, "fake lwo_ring_destroy: %d tickets live" % self.live())
        self.closed = True


class Grads:
    def __init__(self, backend, pool, mask, depth):
        self.backend, self.pool, self.depth = backend, pool, depth
        self.mask = [bool(m) for m in mask]
        self.host = {}     # (layer, name) -> (address, dtype, n)
        for layer, (infos, _r, _h) in enumerate(pool.layers):
            if not self.mask[layer]:
                continue
            for i in infos:
                n = i.bytes // lwo.dtype_size(i.dtype)
                self.host[(layer, i.name)] = (backend.mem.alloc(i.bytes), i.dtype, n)
        self.fresh = [True] * len(pool.layers)
        self.got = [False] * len(pool.layers)
        self.zero_pending = set()
        self.begun = {}    # layer -> slot addresses
        self.pending = []  # (layer, [(name, dtype, copy of the slot tensor)])
        self.n_transfers = self.bytes = self.n_accumulated = 0
        self.log = []
        self.serial = 0            # counts ends
        self.end_serial = {}       # layer -> the serial of its last end
        self.zero_serial = 0       # the serial at the last zero
        self.optim = None          # the optimizer over this set (close refuses then)

    def begin(self, layer, stream):
        if not self.mask[layer]:
            raise _err(C.LWO_ERR_INVALID_ARGUMENT, "fake lwo_grads_begin: layer %d is frozen"
                       % layer)
        if layer in self.begun:
            raise _err(C.LWO_ERR_LAYER_BUSY, "fake lwo_grads_begin: layer %d already begun"
                       % layer)
        if len(self.begun) >= self.depth:
            raise _err(C.LWO_ERR_RING_FULL, "fake lwo_grads_begin: every slot is begun")
        slot = []
        for i in self.pool.layers[layer][0]:
            addr = self.backend.mem.alloc(i.bytes, fill=0xff)  # unwritten shows as NaN
            slot.append((addr, i.dtype))
        self.begun[layer] = slot
        self.log.append(("begin", layer))
        return slot

    def end(self, layer, stream):
        slot = self.begun.pop(layer, None)
        if slot is None:
            raise _err(C.LWO_ERR_TICKET_STATE, "fake lwo_grads_end: layer %d not begun" % layer)
        copies = []
        for (addr, dt), i in zip(slot, self.pool.layers[layer][0]):
            copies.append((i.name, dt, _at(addr, _DT[dt], i.shape).clone()))
            self.bytes += i.bytes
        self.pending.append((layer, copies))
        self.n_transfers += 1
        self.serial += 1
        self.end_serial[layer] = self.serial
        self.log.append(("end", layer))

    def wait(self):
        for layer, copies in self.pending:
            for name, dt, g in copies:
                addr, hdt, n = self.host[(layer, name)]
                dst = _at(addr, _DT[hdt], (n,))
                if self.fresh[layer]:
                    dst.copy_(g.reshape(-1))
                else:
                    dst.copy_((dst.float() + g.reshape(-1).float()).to(dst.dtype))
                    self.n_accumulated += 1
            self.fresh[layer] = False
            self.got[layer] = True
            self.zero_pending.discard(layer)
        self.pending = []
        for layer in list(self.zero_pending):
            for (l2, name), (addr, hdt, n) in self.host.items():
                if l2 == layer:
                    _at(addr, _DT[hdt], (n,)).zero_()
        self.zero_pending.clear()
        self.log.append(("wait",))
        if self.begun:
            raise _err(C.LWO_ERR_BUSY, "fake lwo_grads_wait: layers %s begun" % sorted(self.begun))

    def zero(self):
        self.wait()
        self.zero_serial = self.serial
        self.fresh = [True] * len(self.pool.layers)
        self.zero_pending = {l for l, m in enumerate(self.mask) if m}
        self.log.append(("zero",))

    def tensor(self, layer, name):
        if not self.mask[layer]:
            raise _err(C.LWO_ERR_INVALID_ARGUMENT, "fake lwo_grads_tensor: frozen layer")
        return self.host[(layer, name)]

    def stats(self):
        return GradsStats(self.n_transfers, self.bytes, self.n_accumulated, 0, 0)

    def close(self):
        if self.optim is not None and not self.optim.closed:
            raise _err(C.LWO_ERR_BUSY, "fake lwo_grads_destroy: an optimizer holds the set")


class Optim:
    """lwo_optim on the CPU: f32 masters from the pool's weights, moments in
    the state dtype (rounded to nearest), PyTorch's AdamW / lwo's SGD
    arithmetic in f32; a step lands every gradient and updates at once
    each trainable layer that got a gradient since the last step and was
    not zeroed since, writing the pool (rounded) and marking it changed;
    clipping by the norm of those gradients and extra_sumsq; delayed: the
    pool gets the previous step's weights at each step, the current ones at
    wait()."""

    def __init__(self, backend, grads, kind, state, flags, n_threads, seed):
        if grads.optim is not None and not grads.optim.closed:
            raise _err(C.LWO_ERR_BUSY, "fake lwo_optim_create: the set has an optimizer")
        self.backend, self.grads, self.pool, self.kind = backend, grads, grads.pool, kind
        self.sdt = torch.bfloat16 if state == "bf16" else torch.float32
        self.clipping = bool(flags & C.LWO_OPTIM_CLIPPING)
        self.delayed = bool(flags & C.LWO_OPTIM_DELAYED)
        self.closed = False
        self.state = {}    # (layer, name) -> {"master", "m", "v"}
        self.group = {}    # (layer, name) -> its hyperparameter group (0 when absent)
        self.used = {}     # layer -> the end serial of its last update
        self.next = {}     # delayed: (layer, name) -> weights of the last update
        self.n_steps = self.n_layer_updates = self.n_clipped = 0
        self.last_norm = 0.0
        self.order = []
        for layer, (infos, _r, host) in enumerate(self.pool.layers):
            if not grads.mask[layer]:
                continue
            for i in infos:
                w = _at(host + i.offset, _DT[i.dtype], i.shape).reshape(-1).float().clone()
                self.state[(layer, i.name)] = {"master": w, "m": torch.zeros(w.numel(),
                                               dtype=self.sdt),
                                               "v": torch.zeros(w.numel(), dtype=self.sdt)}
        grads.optim = self

    def _info(self, layer, name):
        for i in self.pool.layers[layer][0]:
            if i.name == name:
                return i
        raise _err(C.LWO_ERR_NOT_FOUND, "fake lwo_optim: layer %d has no %r" % (layer, name))

    def _publish(self, layer, name, w):
        i = self._info(layer, name)
        host = self.pool.layers[layer][2]
        _at(host + i.offset, _DT[i.dtype], (w.numel(),)).copy_(w.to(_DT[i.dtype]))
        self.pool.version[layer] += 1

    def set_group(self, layer, name, group):
        self._info(layer, name)
        if (layer, name) not in self.state:
            raise _err(C.LWO_ERR_INVALID_ARGUMENT, "fake lwo_optim_set_group: layer %d is frozen"
                       % layer)
        self.group[(layer, name)] = int(group)

    def step_groups(self, n, groups, max_norm=0.0, extra_sumsq=0.0):
        defaults = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, momentum=0.0,
                        dampening=0.0)
        hp = [dict(defaults, **g) for g in groups]
        if any(int(g.get("step", n)) < 1 for g in hp):
            raise _err(C.LWO_ERR_INVALID_ARGUMENT, "fake lwo_optim_step_groups: a step 0")
        if not hp:
            raise _err(C.LWO_ERR_INVALID_ARGUMENT, "fake lwo_optim_step_groups: no group")
        for key, gi in self.group.items():
            if gi >= len(hp):
                raise _err(C.LWO_ERR_INVALID_ARGUMENT, "fake lwo_optim_step_groups: layer %d "
                           "tensor %r is in group %d of %d" % (key[0], key[1], gi, len(hp)))
        self._step(n, hp, max_norm, extra_sumsq)

    def step(self, n, lr, max_norm=0.0, extra_sumsq=0.0, **hyper):
        self.step_groups(n, [dict(hyper, lr=lr)], max_norm=max_norm, extra_sumsq=extra_sumsq)

    def _step(self, n, hp, max_norm, extra_sumsq):
        if max_norm and not self.clipping:
            raise _err(C.LWO_ERR_INVALID_ARGUMENT, "fake lwo_optim_step: max_norm without "
                       "LWO_OPTIM_CLIPPING")
        if n < 1 or extra_sumsq < 0:
            raise _err(C.LWO_ERR_INVALID_ARGUMENT, "fake lwo_optim_step: step %d, extra_sumsq "
                       "%r" % (n, extra_sumsq))
        g = self.grads
        if self.delayed:
            self.wait()
        g.wait()  # the gradients land (the library updates each layer as it lands)
        layers = sorted(l for l, ser in g.end_serial.items()
                        if g.mask[l] and ser > g.zero_serial and ser > self.used.get(l, 0))
        grads = {}
        sq = extra_sumsq
        for layer in layers:
            self.used[layer] = g.end_serial[layer]
            for key in self.state:
                if key[0] != layer:
                    continue
                addr, hdt, cnt = g.host[key]
                grads[key] = _at(addr, _DT[hdt], (cnt,)).float().clone()
                sq += float((grads[key].double() ** 2).sum())
        scale = 1.0
        if max_norm:
            self.last_norm = sq ** 0.5
            c = max_norm / (self.last_norm + 1e-6)
            if c < 1:
                scale = c
                self.n_clipped += 1
        for key, gr in grads.items():
            st = self.state[key]
            h = hp[self.group.get(key, 0)]
            lr, beta1, beta2, eps = h["lr"], h["beta1"], h["beta2"], h["eps"]
            weight_decay, momentum, dampening = h["weight_decay"], h["momentum"], h["dampening"]
            t = int(h.get("step", n))  # the group's own step number
            gr = gr * scale
            p, m = st["master"], st["m"].float()
            p.mul_(1 - lr * weight_decay)
            if self.kind == "adamw":
                v = st["v"].float()
                m.mul_(beta1).add_(gr, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(gr, gr, value=1 - beta2)
                bc1, bc2 = 1 - beta1 ** t, 1 - beta2 ** t
                p.addcdiv_(m, v.sqrt() / math.sqrt(bc2) + eps, value=-lr / bc1)
                st["v"] = v.to(self.sdt)
            else:
                m = gr.clone() if t == 1 else m.mul_(momentum).add_(gr, alpha=1 - dampening)
                p.add_(m, alpha=-lr)
            st["m"] = m.to(self.sdt)
            if self.delayed:
                self.next[key] = p.clone()
            else:
                self._publish(key[0], key[1], p)
        self.n_layer_updates += len(layers)
        self.order = layers
        self.n_steps += 1

    def wait(self):
        for key, w in self.next.items():
            self._publish(key[0], key[1], w)
        self.next = {}

    def read(self, layer, name, which, out):
        st = self.state.get((layer, name))
        if st is None:
            self._info(layer, name)
            raise _err(C.LWO_ERR_INVALID_ARGUMENT, "fake lwo_optim_read: layer %d is frozen"
                       % layer)
        if out.numel() != st[which].numel() or out.dtype != st[which].dtype:
            raise _err(C.LWO_ERR_SIZE_MISMATCH, "fake lwo_optim_read: %r %s" % (name, which))
        out.copy_(st[which])

    def write(self, layer, name, which, src):
        st = self.state.get((layer, name))
        if st is None:
            self._info(layer, name)
            raise _err(C.LWO_ERR_INVALID_ARGUMENT, "fake lwo_optim_write: layer %d is frozen"
                       % layer)
        if src.numel() != st[which].numel() or src.dtype != st[which].dtype:
            raise _err(C.LWO_ERR_SIZE_MISMATCH, "fake lwo_optim_write: %r %s" % (name, which))
        st[which] = src.detach().reshape(-1).clone()
        if which == "master":
            self.next.pop((layer, name), None)
            self._publish(layer, name, st[which])

    def stats(self):
        return lwo.OptimStats(self.n_steps, self.n_layer_updates, 0, 0, 0, 0, 0, self.n_clipped,
                              0, self.last_norm)

    def close(self):
        self.wait()
        self.closed = True


class Backend:
    """What lwo.torch._Backend offers, on the CPU."""

    device_type = "cpu"
    device_index = -1
    events = False

    def __init__(self):
        self.mem = Memory()
        self.pools, self.rings, self.grads_sets, self.optims = [], [], [], []
        self.changed = []
        self.calls = collections.Counter()

    def current_stream(self, device_index):
        return 0

    def transfer_stream(self):
        return 0

    def pool(self, layers):
        p = Pool(self, layers)
        self.pools.append(p)
        return p

    def pool_from_checkpoint(self, checkpoint, names):
        p = CheckpointPool(self, checkpoint, names)
        self.pools.append(p)
        return p

    def layer_changed(self, pool, layer):
        pool.version[layer] += 1
        self.changed.append(layer)

    def ring(self, pool, depth, timing, resident=()):
        r = Ring(self, pool, depth, timing, resident)
        self.rings.append(r)
        return r

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

    def workspace_bytes(self):
        return 0

    def free_bytes(self):
        return 1 << 34

    def grads(self, pool, mask, depth):
        g = Grads(self, pool, mask, depth)
        self.grads_sets.append(g)
        return g

    def optimizer(self, grads, kind, state, flags, n_threads, seed):
        o = Optim(self, grads, kind, state, flags, n_threads, seed)
        self.optims.append(o)
        return o

    # compute ------------------------------------------------------------
    def linear_desc(self, in_features, out_features, dtype, bias, accumulate=False,
                    weight_format=0):
        return {"in": in_features, "out": out_features, "dtype": dtype, "bias": bias,
                "acc": accumulate, "quant": int(weight_format)}

    def _weight(self, d, w, shape=None):
        """The weight as f32 (of `shape`, default [out, in]): dense, or
        dequantized (lwo_dequantize_host) as the library does into its
        workspace of the layer's dtype, from the [rows = shape[0], cols =
        the rest] tensor it was quantized as."""
        dt = _DT[d["dtype"]]
        shape = tuple(shape or (d["out"], d["in"]))
        if not d["quant"]:
            return _at(w, dt, shape).float()
        self.calls["dequantize"] += 1
        cols = 1
        for v in shape[1:]:
            cols *= v
        n = lwo.quant_layout(d["quant"], (shape[0], cols), d["dtype"]).total_bytes
        got = lwo.dequantize(_bytes_at(w, n).numpy(), format=d["quant"],
                             shape=(shape[0], cols), dtype=d["dtype"])
        t = torch.from_numpy(got.view("int16") if d["dtype"] == C.LWO_DTYPE_BF16 else got)
        return t.view(dt).float().view(shape)

    def linear_forward(self, d, tokens, x, w, b, y, stream):
        self.calls["linear_forward"] += 1
        dt = _DT[d["dtype"]]
        X = _at(x, dt, (tokens, d["in"])).float()
        W = self._weight(d, w)
        Y = X @ W.t()
        if d["bias"]:
            Y = Y + _at(b, dt, (d["out"],)).float()
        _at(y, dt, (tokens, d["out"])).copy_(Y.to(dt))

    def linear_backward(self, d, tokens, x, dy, w, dx, dw, db, grad_dtype, stream):
        self.calls["linear_backward"] += 1
        dt = _DT[d["dtype"]]
        gdt = _DT[grad_dtype]
        DY = _at(dy, dt, (tokens, d["out"])).float()
        if db and not d["bias"]:
            raise _err(C.LWO_ERR_INVALID_ARGUMENT, "fake lwo_linear_backward: dbias, no bias")
        if (dw or db) and d["quant"]:
            raise _err(C.LWO_ERR_QUANTIZED_WEIGHT, "fake lwo_linear_backward: dweight of a "
                       "quantized weight")
        if dw:
            X = _at(x, dt, (tokens, d["in"])).float()
            G = _at(dw, gdt, (d["out"], d["in"]))
            val = DY.t() @ X
            G.copy_((G.float() + val).to(gdt) if d["acc"] else val.to(gdt))
        if db:
            G = _at(db, gdt, (d["out"],))
            val = DY.sum(0)
            G.copy_((G.float() + val).to(gdt) if d["acc"] else val.to(gdt))
        if dx:
            if not w:
                raise _err(C.LWO_ERR_INVALID_ARGUMENT, "fake lwo_linear_backward: weight NULL")
            W = self._weight(d, w)
            _at(dx, dt, (tokens, d["in"])).copy_((DY @ W).to(dt))

    def conv_desc(self, module, dtype, bias, padding, accumulate=False, weight_format=0):
        return {"dtype": dtype, "bias": bias, "acc": accumulate, "in": module.in_channels,
                "quant": int(weight_format),
                "out": module.out_channels, "k": tuple(module.kernel_size),
                "stride": tuple(module.stride), "pad": tuple(padding),
                "dil": tuple(module.dilation), "groups": module.groups}

    def conv_output_size(self, d, h, w):
        oh = (h + 2 * d["pad"][0] - d["dil"][0] * (d["k"][0] - 1) - 1) // d["stride"][0] + 1
        ow = (w + 2 * d["pad"][1] - d["dil"][1] * (d["k"][1] - 1) - 1) // d["stride"][1] + 1
        if oh < 1 or ow < 1:
            raise _err(C.LWO_ERR_INVALID_ARGUMENT, "fake lwo_conv2d_output_size: too small")
        return oh, ow

    def _wshape(self, d):
        return (d["out"], d["in"] // d["groups"]) + d["k"]

    def conv_forward(self, d, n, h, w, x, wt, b, y, stream):
        dt = _DT[d["dtype"]]
        oh, ow = self.conv_output_size(d, h, w)
        X = _at(x, dt, (n, d["in"], h, w)).float()
        W = self._weight(d, wt, self._wshape(d))
        B = _at(b, dt, (d["out"],)).float() if d["bias"] else None
        Y = F.conv2d(X, W, B, d["stride"], d["pad"], d["dil"], d["groups"])
        _at(y, dt, (n, d["out"], oh, ow)).copy_(Y.to(dt))

    def conv_backward(self, d, n, h, w, x, dy, wt, dx, dw, db, grad_dtype, stream):
        dt = _DT[d["dtype"]]
        gdt = _DT[grad_dtype]
        oh, ow = self.conv_output_size(d, h, w)
        DY = _at(dy, dt, (n, d["out"], oh, ow)).float()
        ws = self._wshape(d)
        if (dw or db) and d["quant"]:
            raise _err(C.LWO_ERR_QUANTIZED_WEIGHT, "fake lwo_conv2d_backward: dweight of a "
                       "quantized weight")
        if dw:
            X = _at(x, dt, (n, d["in"], h, w)).float()
            val = torch.nn.grad.conv2d_weight(X, ws, DY, d["stride"], d["pad"], d["dil"],
                                              d["groups"])
            G = _at(dw, gdt, ws)
            G.copy_((G.float() + val).to(gdt) if d["acc"] else val.to(gdt))
        if db:
            G = _at(db, gdt, (d["out"],))
            val = DY.sum((0, 2, 3))
            G.copy_((G.float() + val).to(gdt) if d["acc"] else val.to(gdt))
        if dx:
            W = self._weight(d, wt, ws)
            val = torch.nn.grad.conv2d_input((n, d["in"], h, w), W, DY, d["stride"], d["pad"],
                                             d["dil"], d["groups"])
            _at(dx, dt, (n, d["in"], h, w)).copy_(val.to(dt))

    def zero_device(self, address, nbytes, stream):
        if nbytes:
            _bytes_at(address, nbytes).zero_()

    def synchronize(self):
        pass


class PlanningBackend(Backend):
    """Backend with a planner stand-in (lwo_plan_create needs a device):
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
            raise _err(C.LWO_ERR_OVER_BUDGET, "fake lwo_plan_create: a budget of %d bytes holds "
                       "no plan: the smallest ring (depth 1) and gradient staging need %d bytes"
                       % (budget_bytes, need))
        k = self.group_size if group else 1
        groups = [(i, min(k, n - i), self.resident_first and i == 0) for i in range(0, n, k)]
        return {"depth": depths[0] if depths else 3, "groups": groups, "train": train,
                "predicted_ms": self.predicted_ms, "predicted_stall_ms": 0.0, "device_bytes": 0,
                "budget_bytes": budget_bytes, "h2d_bytes": 0, "d2h_bytes": 0, "link": {},
                "ungrouped_ms": 1.0, "first_k_ms": 1.0}
