"""lwo.torch.offload(checkpoint=): a model's weights from a safetensors
checkpoint (one file, a sharded ``*.safetensors.index.json``, or a folder
holding one of them).

- The streamed nn.Linear / nn.Conv2d weights and biases come from the file
  without a PyTorch copy. By default (mapped) the pool is
  lwo_pool_create_from_checkpoint over lwo's mapping of the files (registered
  for DMA in place, or staged where registration is refused), and each
  parameter is a frozen CPU tensor over this process's copy-on-write mapping
  of the same file bytes (the page cache: no copy, shared with every process
  that maps the file; a stray write lands in a private page, never in the
  file, and is refused at the record's next stage). With checkpoint_copy=True,
  or with quant=, the pool is lwo's pinned pool, filled tensor by tensor from
  the mapping (copied, cast, or quantized), and its parameters are writable.
- An F8_E4M3 weight with its "<name>_scale_inv" f32 block scales (as fp8
  checkpoints ship them) streams as it is: one fp8-block128 quantized tensor
  (lwo's rule for checkpoint pools); its parameter is a frozen
  torch.float8_e4m3fn CPU tensor over the file's codes.
- Everything else the model holds (parameters and persistent buffers of the
  modules lwo does not stream) is loaded from the file into tensors on the
  device, one tensor at a time, cast to the model's dtype where it differs.
  Tensors on the meta device that the file does not hold (non-persistent
  buffers such as a rotary embedding's inv_freq; adapters made on the meta
  device) are allocated on the device and initialized by checkpoint_init, or
  for non-persistent buffers by the model's own transformers _init_weights.

Everything the file and the model must agree on (names, shapes, dtypes) is
checked before anything changes. See docs/PYTHON.md.
"""

import ctypes
import glob
import math
import mmap
import os
import warnings

import torch
import torch.nn as nn

from . import _capi as C
from . import _core
from . import torch as _lt
from ._errors import ArgumentError, check

_lib = C.lib

SCALE_SUFFIX = "_scale_inv"
_FP8_BLOCK = C.LWO_QUANT_FP8_E4M3_BLOCK128
_PEFT_ROOT = "base_model.model."

# lwo dtype (a checkpoint tensor's) -> torch dtype (None: torch has none)
_TORCH_OF = {
    C.LWO_DTYPE_F32: torch.float32, C.LWO_DTYPE_BF16: torch.bfloat16,
    C.LWO_DTYPE_F16: torch.float16, C.LWO_DTYPE_F64: torch.float64,
    C.LWO_DTYPE_F8_E4M3: getattr(torch, "float8_e4m3fn", None),
    C.LWO_DTYPE_F8_E5M2: getattr(torch, "float8_e5m2", None),
    C.LWO_DTYPE_F8_E8M0: getattr(torch, "float8_e8m0fnu", None),
    C.LWO_DTYPE_I8: torch.int8, C.LWO_DTYPE_U8: torch.uint8, C.LWO_DTYPE_BOOL: torch.bool,
    C.LWO_DTYPE_I16: torch.int16, C.LWO_DTYPE_U16: getattr(torch, "uint16", None),
    C.LWO_DTYPE_I32: torch.int32, C.LWO_DTYPE_U32: getattr(torch, "uint32", None),
    C.LWO_DTYPE_I64: torch.int64, C.LWO_DTYPE_U64: getattr(torch, "uint64", None),
    C.LWO_DTYPE_C64: torch.complex64,
}
_FLOAT = (torch.float32, torch.bfloat16, torch.float16)
_MAX_LISTED = 8  # names listed in one error message


def resolve(path):
    """The file lwo_checkpoint_open takes for `path`: the path itself, or in
    a folder its model.safetensors.index.json, model.safetensors, or its only
    *.safetensors.index.json / *.safetensors."""
    p = os.fspath(path)
    if not os.path.isdir(p):
        return p
    for name in ("model.safetensors.index.json", "model.safetensors"):
        q = os.path.join(p, name)
        if os.path.isfile(q):
            return q
    for pattern in ("*.safetensors.index.json", "*.safetensors"):
        found = sorted(glob.glob(os.path.join(glob.escape(p), pattern)))
        if len(found) == 1:
            return found[0]
        if found:
            raise ValueError("lwo.torch.offload: checkpoint folder %r holds %d %s files and no "
                             "model.safetensors.index.json: name the one to open"
                             % (p, len(found), pattern))
    raise ValueError("lwo.torch.offload: checkpoint folder %r holds no .safetensors file nor "
                     "a .safetensors.index.json" % p)


def _listed(names):
    names = list(names)
    head = ", ".join(names[:_MAX_LISTED])
    return head + (" and %d more" % (len(names) - _MAX_LISTED) if len(names) > _MAX_LISTED
                   else "")


class _Views:
    """This process's copy-on-write mappings of the checkpoint's files
    (MAP_PRIVATE: pages shared with the page cache until written; a write
    never reaches the file) and CPU tensors over them. Where the system
    refuses a private writable mapping of that size (strict overcommit
    accounting charges it), the mapping is read-only instead, with a
    warning: a write to a streamed parameter would then crash the process."""

    def __init__(self, files):
        self.paths = [f.path for f in files]
        self.maps = []
        self.read_only = False
        for f in files:
            if f.bytes == 0:
                self.maps.append(None)
                continue
            with open(f.path, "rb") as fh:
                try:
                    mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
                except OSError as e:
                    warnings.warn("lwo.torch.offload(checkpoint=): a copy-on-write mapping of "
                                  "%r was refused (%s); it is mapped read-only, so writing a "
                                  "streamed parameter in place would crash the process"
                                  % (f.path, e), RuntimeWarning, stacklevel=4)
                    mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
                    self.read_only = True
            self.maps.append(mm)

    def tensor(self, t, dtype=None, shape=None):
        """A CPU tensor over checkpoint tensor `t` (a CheckpointTensor) in its
        file's mapping: of `dtype` (default: the file's) and `shape`."""
        dt = dtype if dtype is not None else _TORCH_OF[t.dtype]
        shape = tuple(t.shape) if shape is None else tuple(shape)
        n = math.prod(shape)
        if n == 0 or not t.bytes:
            return torch.empty(shape, dtype=dt)
        if self.read_only:
            with warnings.catch_warnings():  # "not writable": said once, above
                warnings.simplefilter("ignore", UserWarning)
                return torch.frombuffer(self.maps[t.file], dtype=dt, count=n,
                                        offset=t.file_offset).view(shape)
        return torch.frombuffer(self.maps[t.file], dtype=dt, count=n,
                                offset=t.file_offset).view(shape)

    def raw(self, t):
        return self.tensor(t, torch.uint8, (t.bytes,))

    def address(self, t):
        """The address of t's first byte in this process's mapping."""
        return self.raw(t).data_ptr()


class _Entry:
    """One tensor object of the model (a parameter or a buffer) and every
    place that holds it."""

    __slots__ = ("tensor", "is_param", "holders", "names", "persistent", "ct", "scale",
                 "streamed", "action")

    def __init__(self, tensor, is_param):
        self.tensor = tensor
        self.is_param = is_param
        self.holders = []       # (module, key, module name), one per module
        self.names = []         # its state_dict names
        self.persistent = False
        self.ct = None          # the checkpoint tensor it is read from
        self.scale = None       # its block scales (an fp8 weight read dense)
        self.streamed = False
        self.action = None      # "load", "init" (meta, not in the file), "keep"


def _model_entries(model):
    entries = {}
    order = []
    for mname, mod in model.named_modules(remove_duplicate=False):
        for group, is_param in ((mod._parameters, True), (mod._buffers, False)):
            for key, t in group.items():
                if t is None:
                    continue
                e = entries.get(id(t))
                if e is None:
                    e = entries[id(t)] = _Entry(t, is_param)
                    order.append(e)
                full = mname + "." + key if mname else key
                if all(h[0] is not mod or h[1] != key for h in e.holders):
                    e.holders.append((mod, key, mname))
                e.names.append(full)
                if is_param or key not in mod._non_persistent_buffers_set:
                    e.persistent = True
    return order


def _candidates(name, key):
    """The checkpoint names tried for model name `name`, in order."""
    if callable(key):
        got = key(name)
        return [] if got is None else [got]
    prefix = key or ""
    out = [prefix + name]
    plain = name[len(_PEFT_ROOT):] if name.startswith(_PEFT_ROOT) else name
    plain = plain.replace(".base_layer.", ".")  # peft's wrapper of a tuned module
    if plain != name:
        out.append(prefix + plain)
    return out


class Source:
    """What a handle keeps of its checkpoint: the open lwo.Checkpoint, the
    mappings, where each streamed tensor comes from, and checkpoint_info."""

    def __init__(self, path, ckpt, mapped):
        self.path = path
        self.ckpt = ckpt
        self.mapped = mapped
        self.files = ckpt.files()
        self.views = _Views(self.files)
        self.by_name = {t.name: t for t in ckpt.tensors()}
        self.where = {}       # (id(module), "weight" | "bias") -> CheckpointTensor
        self.fp8 = {}         # module name -> (codes, scales) CheckpointTensors
        self.fp8_ids = set()  # id(module) of those
        self.first_pool = None
        self._mapped_pools = []  # every mapped pool made (Offload.close destroys them)
        self.info = {}
        self._entries = []
        self._init = None

    @property
    def label(self):
        return "lwo.torch.offload(checkpoint=%r)" % (self.path,)

    @property
    def progress_label(self):
        if self.mapped:
            return "lwo.torch.offload: mapping the checkpoint's weights"
        return "lwo.torch.offload: reading the checkpoint's weights into the pool"

    # ----------------------------------------------------------------
    # Setup (lwo.torch.offload)
    # ----------------------------------------------------------------
    def _lookup(self, e, key):
        for name in e.names:
            for cand in _candidates(name, key):
                t = self.by_name.get(cand)
                if t is not None:
                    return t
        return None

    def _tried(self, e, key):
        out = []
        for name in e.names:
            for cand in _candidates(name, key):
                if cand not in out:
                    out.append(cand)
        return out

    def _fp8_scale(self, t):
        if t.dtype != C.LWO_DTYPE_F8_E4M3:
            return None
        return self.by_name.get(t.name + SCALE_SUFFIX)

    def _check_scale(self, t, sc):
        """lwo's rule for an fp8 weight and its block scales (as
        lwo_pool_create_from_checkpoint checks it)."""
        if len(t.shape) != 2 or t.shape[0] < 1 or t.shape[1] < 1:
            return "fp8 tensor %r %s has scales %r beside it, but a block-quantized weight " \
                "is 2-D [rows, cols]" % (t.name, list(t.shape), sc.name)
        if sc.dtype != C.LWO_DTYPE_F32:
            return "scales %r of fp8 tensor %r are %s (must be F32)" % (
                sc.name, t.name, sc.dtype_name)
        want = [(t.shape[0] + 127) // 128, (t.shape[1] + 127) // 128]
        if list(sc.shape) != want:
            return "scales %r of fp8 tensor %r %s must be %s (one per 128 x 128 block), not " \
                "%s" % (sc.name, t.name, list(t.shape), want, list(sc.shape))
        return None

    def plan(self, model, targets, key, init, device):
        """Matches the model's tensors to the checkpoint's and checks every
        one; raises before anything changes."""
        label = self.label
        self._init = init
        entries = _model_entries(model)
        self._entries = entries
        by_id = {id(e.tensor): e for e in entries}
        problems, missing, needs_init = [], [], []
        used = set()
        # the streamed modules' weights and biases
        for mname, m in targets:
            for pkey in ("weight", "bias"):
                p = getattr(m, pkey, None)
                if p is None:
                    continue
                e = by_id[id(p)]
                e.streamed = True
                t = self._lookup(e, key)
                what = "%s of %s %r" % (pkey, "linear" if isinstance(m, nn.Linear) else
                                        "conv2d", mname)
                if t is None:
                    missing.append((e.names[0], self._tried(e, key), what))
                    continue
                used.add(t.name)
                sc = self._fp8_scale(t) if pkey == "weight" else None
                if sc is not None:
                    why = self._check_scale(t, sc)
                    if why is None and p.dtype != torch.bfloat16:
                        why = ("%s: %r is an fp8 weight with block scales, which lwo streams "
                               "as bf16, but the model's %s is %s: build the model in "
                               "torch.bfloat16 (on the meta device: model.to(torch.bfloat16))"
                               % (what, t.name, e.names[0], p.dtype))
                    if why is None and tuple(p.shape) != tuple(t.shape):
                        why = "%s: the model's %s is %s, %r in the file %s" % (
                            what, e.names[0], list(p.shape), t.name, list(t.shape))
                    if why is not None:
                        problems.append(why)
                        continue
                    used.add(sc.name)
                    self.fp8[mname] = (t, sc)
                    self.fp8_ids.add(id(m))
                    self.where[(id(m), pkey)] = t
                    continue
                why = self._check_streamed(e, t, what)
                if why is not None:
                    problems.append(why)
                    continue
                self.where[(id(m), pkey)] = t
        # everything else: loaded, initialized, or kept
        for e in entries:
            if e.streamed:
                continue
            is_meta = e.tensor.device.type == "meta"
            t = self._lookup(e, key) if e.persistent else None
            if t is None:
                if not is_meta:
                    e.action = "keep"
                elif e.persistent and init is None:
                    missing.append((e.names[0], self._tried(e, key), None))
                else:
                    e.action = "init"
                    needs_init.append(e)
                continue
            used.add(t.name)
            sc = self._fp8_scale(t)
            if sc is not None and e.tensor.dtype in _FLOAT:
                why = self._check_scale(t, sc)
                if why is not None:
                    problems.append(why)
                    continue
                used.add(sc.name)
                e.scale = sc
            elif _TORCH_OF.get(t.dtype) is None:
                problems.append("%s: %r in the file is %s, which torch has no dtype for" % (
                    e.names[0], t.name, t.dtype_name))
                continue
            elif _TORCH_OF[t.dtype].is_floating_point != e.tensor.dtype.is_floating_point \
                    or _TORCH_OF[t.dtype].is_complex != e.tensor.is_complex():
                problems.append("%s is %s in the model, %r is %s in the file: the values do not "
                                "convert (a float and an integer type)" % (
                                    e.names[0], e.tensor.dtype, t.name, t.dtype_name))
                continue
            if tuple(e.tensor.shape) != tuple(t.shape):
                problems.append("%s is %s in the model, %r is %s in the file" % (
                    e.names[0], list(e.tensor.shape), t.name, list(t.shape)))
                continue
            e.ct = t
            e.action = "load"
        if missing:
            lines = []
            for name, tried, what in missing:
                lines.append("%s%s (looked up %s)" % (name, " (%s)" % what if what else "",
                                                      " or ".join(repr(x) for x in tried)
                                                      if tried else "nothing: checkpoint_key "
                                                      "gave None"))
            sample = _listed(repr(n) for n in list(self.by_name)[:3])
            hint = ("checkpoint_key= maps the model's names to the file's (its names begin "
                    "%s); a checkpoint saved from a model with tied weights holds one name of "
                    "each tied pair (build the model tied too)" % sample)
            if any(what is None for _n, _t, what in missing):
                hint += "; tensors on the meta device that no file holds (new adapters) can " \
                    "be made by checkpoint_init="
            raise ArgumentError(C.LWO_ERR_NOT_FOUND, "%s: %d tensor%s the model needs %s not "
                                "in %s: %s. %s" % (
                                    label, len(missing), "s" if len(missing) > 1 else "",
                                    "are" if len(missing) > 1 else "is", self._files_text(),
                                    _listed(lines), hint))
        if problems:
            raise ArgumentError(C.LWO_ERR_INVALID_ARGUMENT, "%s: %s" % (label, "; ".join(
                problems[:_MAX_LISTED]) + (" and %d more" % (len(problems) - _MAX_LISTED)
                                           if len(problems) > _MAX_LISTED else "")))
        self.info = {
            "files": [f.path for f in self.files],
            "mapped_bytes": sum(f.bytes for f in self.files),
            "pool": None,
            "streamed": [t.name for t in self.where.values()] +
                        [sc.name for _t, sc in self.fp8.values()],
            "fp8": sorted(self.fp8),
            "resident": [e.ct.name for e in entries if e.action == "load"],
            "initialized": [e.names[0] for e in needs_init],
            "kept": [e.names[0] for e in entries if e.action == "keep"],
            "cast": {e.names[0]: "%s -> %s" % (e.ct.dtype_name, e.tensor.dtype)
                     for e in entries if e.action == "load" and e.scale is None
                     and _TORCH_OF[e.ct.dtype] != e.tensor.dtype},
            "unmatched": [n for n in self.by_name if n not in used],
            "seconds": None,
        }

    def _files_text(self):
        if len(self.files) == 1:
            return repr(self.files[0].path)
        return "%r (%d files)" % (self.path, len(self.files))

    def _check_streamed(self, e, t, what):
        p = e.tensor
        if tuple(p.shape) != tuple(t.shape):
            return "%s: the model's %s is %s, %r in the file %s" % (
                what, e.names[0], list(p.shape), t.name, list(t.shape))
        file_dt = _TORCH_OF.get(t.dtype)
        if file_dt == p.dtype:
            return None
        if file_dt not in _FLOAT:
            fp8 = " (an F8_E4M3 weight streams with its block scales %r beside it)" % (
                t.name + SCALE_SUFFIX) if t.dtype == C.LWO_DTYPE_F8_E4M3 else ""
            return "%s: %r is %s in %s; lwo computes f32, bf16 and f16 weights%s" % (
                what, t.name, t.dtype_name, self._files_text(), fp8)
        if self.mapped:
            return ("%s: the model's %s is %s but %r is %s in %s; a mapped weight streams in "
                    "the file's dtype: build the model in it (on the meta device: "
                    "model.to(%s)), or give checkpoint_copy=True to cast it into lwo's pinned "
                    "pool" % (what, e.names[0], p.dtype, t.name, t.dtype_name,
                              self._files_text(), file_dt))
        return None

    def load_resident(self, device):
        """Loads what lwo does not stream, tensor by tensor, into tensors on
        `device` (in place where the model's tensor is not on the meta
        device), and initializes what the file does not hold."""
        fresh = []
        with torch.no_grad():
            for e in self._entries:
                if e.action == "load":
                    src = self._dense(e.ct, e.scale, e.tensor.dtype) if e.scale is not None \
                        else self.views.tensor(e.ct)
                    if e.tensor.device.type == "meta":
                        dst = torch.empty(tuple(e.tensor.shape), dtype=e.tensor.dtype,
                                          device=device)
                        dst.copy_(src)
                        self._replace(e, dst)
                    else:
                        e.tensor.copy_(src)
                elif e.action == "init":
                    dst = torch.empty(tuple(e.tensor.shape), dtype=e.tensor.dtype, device=device)
                    _fill_unset(dst)
                    self._replace(e, dst)
                    fresh.append(e)
        if fresh:
            self._initialize(fresh)

    def _replace(self, e, t):
        if e.is_param:
            t = nn.Parameter(t, requires_grad=e.tensor.requires_grad)
        for mod, key, _n in e.holders:
            (mod._parameters if e.is_param else mod._buffers)[key] = t
        e.tensor = t

    def _initialize(self, fresh):
        """checkpoint_init(name, module) for each module holding tensors the
        file lacks; then transformers' own _init_weights(module) for a module
        whose only tensors are such non-persistent buffers; what neither set
        is an error."""
        mods = []
        for e in fresh:
            for mod, _k, mname in e.holders:
                if all(mod is not m for _n, m in mods):
                    mods.append((mname, mod))
        if self._init is not None:
            with torch.no_grad():
                for mname, mod in mods:
                    self._init(mname, mod)
        left = [e for e in fresh if _unset(e.tensor)]
        if left:
            fresh_ids = {id(e.tensor) for e in fresh}
            for mname, mod in mods:
                own = [t for t in list(mod._parameters.values()) + list(mod._buffers.values())
                       if t is not None]
                mine = [e for e in left if any(h[0] is mod for h in e.holders)]
                if not mine or any(e.persistent for e in mine) or \
                        any(id(t) not in fresh_ids for t in own):
                    continue
                owner = self._pretrained_owner(mname)
                if owner is not None:
                    with torch.no_grad():
                        owner._init_weights(mod)
            left = [e for e in left if _unset(e.tensor)]
        if left:
            raise ArgumentError(C.LWO_ERR_NOT_FOUND, (
                "%s: %s %s on the meta device and not in the checkpoint, and nothing "
                "initialized %s: give checkpoint_init=fn(name, module), called for each module "
                "holding such tensors once they are allocated on the device, to set them (a "
                "non-persistent buffer such as a rotary embedding's inv_freq is made by "
                "transformers' _init_weights where the model has one)") % (
                    self.label, _listed(e.names[0] for e in left),
                    "are" if len(left) > 1 else "is", "them" if len(left) > 1 else "it"))

    def _pretrained_owner(self, mname):
        """The innermost module above `mname` (itself included) that has
        transformers' _init_weights and a config (a PreTrainedModel)."""
        model_mods = dict(self._root.named_modules()) if self._root is not None else {}
        parts = mname.split(".") if mname else []
        for i in range(len(parts), -1, -1):
            m = model_mods.get(".".join(parts[:i]))
            if m is not None and callable(getattr(m, "_init_weights", None)) and \
                    getattr(m, "config", None) is not None:
                return m
        return None

    _root = None

    def _dense(self, t, sc, dtype):
        """The dense values of fp8 weight t with block scales sc, in `dtype`
        (lwo_dequantize_host of the codes and scales), as a CPU tensor."""
        rows, cols = t.shape
        lay = _core.quant_layout(_FP8_BLOCK, (rows, cols), "bf16")
        buf = torch.zeros(lay.total_bytes, dtype=torch.uint8)
        buf[lay.data_offset:lay.data_offset + lay.data_bytes].copy_(self.views.raw(t))
        buf[lay.scale_offset:lay.scale_offset + lay.scale_bytes].copy_(self.views.raw(sc))
        out_dt = dtype if dtype in _FLOAT else torch.float32
        out = torch.empty((rows, cols), dtype=out_dt)
        d = _core._quant_desc(_FP8_BLOCK, _lt._LWO_DTYPE[out_dt], rows, cols)
        check(_lib.lwo_dequantize_host(ctypes.byref(d), buf.data_ptr(), buf.numel(),
                                       out.data_ptr(), out.numel() * out.element_size(), 0))
        return out if out_dt == dtype else out.to(dtype)

    # ----------------------------------------------------------------
    # The pool and the parameters (Offload._create, _apply, close)
    # ----------------------------------------------------------------
    def _names(self, records):
        """Per record, the checkpoint names of its modules' tensors (an fp8
        weight with its scales, in the same layer so that lwo pairs them)."""
        out = []
        for rec in records:
            names = []
            for s in rec.modules:
                m = s.module
                t = self.where[(id(m), "weight")]
                names.append(t.name)
                if s.name in self.fp8:
                    names.append(self.fp8[s.name][1].name)
                if (id(m), "bias") in self.where:
                    names.append(self.where[(id(m), "bias")].name)
            out.append(names)
        return out

    def _bind_names(self, pool, records):
        """rec.names, and each module's w_idx / b_idx, from the mapped pool."""
        for rec in records:
            infos = pool.tensors(rec.index)
            at = {t.name: i for i, t in enumerate(infos)}
            rec.names = [t.name for t in infos]
            for s in rec.modules:
                m = s.module
                s.w_idx = at[self.where[(id(m), "weight")].name]
                b = self.where.get((id(m), "bias"))
                s.b_idx = at[b.name] if b is not None else -1

    def pool(self, handle, backend, records):
        if not self.mapped:
            pool = backend.pool(handle._pool_layers(records))
            kind = "pinned"
        else:
            if not hasattr(backend, "pool_from_checkpoint"):
                raise TypeError("%s: the backend %r has no pool_from_checkpoint" % (
                    self.label, type(backend).__name__))
            pool = backend.pool_from_checkpoint(self.ckpt, self._names(records))
            self._bind_names(pool, records)
            # The first pool registered the files for DMA; pools built later
            # (the plan's records) find them registered and use them as they
            # are, so the first lives as long as any of them.
            self.first_pool = pool
            self._mapped_pools.append(pool)
            kind = {C.LWO_POOL_CHECKPOINT_MAPPED: "checkpoint-mapped",
                    C.LWO_POOL_CHECKPOINT_STAGED: "checkpoint-staged"}.get(
                        pool.info().kind, "kind %d" % pool.info().kind)
        self.info["pool"] = kind
        return pool

    def release(self):
        """After Offload.close() (its ring closed): the mapped pools are
        destroyed, the first of them unregistering the files (no parameter is
        over a mapped pool's memory: they are copies by then, or over this
        process's own mapping)."""
        for pool in reversed(self._mapped_pools):
            close = getattr(pool, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # a ring of it still open (LWO_ERR_BUSY): it goes with it
                    pass
        self._mapped_pools = []
        self.first_pool = None

    def regroup(self, handle, records):
        """A new mapped pool whose records group the same checkpoint tensors
        as `records` (the plan's grouping): nothing is copied."""
        pool = handle.backend.pool_from_checkpoint(self.ckpt, self._names(records))
        pool._lwo_first = self.first_pool
        self._mapped_pools.append(pool)
        self._bind_names(pool, records)
        return pool

    def adopt(self, handle, m, key, rec, idx):
        """The streamed parameter m.<key> (weight or bias) over its checkpoint
        tensor: a frozen CPU tensor over the file's bytes (mapped), or the
        pinned pool's bytes filled from them."""
        old = m._parameters[key]
        t = self.where[(id(m), key)]
        if self.mapped:
            p = nn.Parameter(self.views.tensor(t), requires_grad=False)
        else:
            addr, nbytes = handle.pool.tensor_host(rec.index, rec.names[idx])
            host = _lt._host_tensor(addr, nbytes, old.dtype, tuple(old.shape), handle.pool)
            host.copy_(self.views.tensor(t))
            # beside an fp8 weight (quantized: frozen) a bias is frozen too, as
            # lwo_grads_create refuses a trainable record with a quantized tensor
            p = nn.Parameter(host, requires_grad=old.requires_grad and id(m) not in self.fp8_ids)
        m._parameters[key] = p
        return p

    def adopt_quantized(self, handle, m, rec, s):
        """A quantized streamed weight: an fp8 weight of the file (its codes
        and scales as they are: in place, or copied into the pinned pool's
        quantized tensor), or with quant= a dense one quantized from the
        mapped bytes into the pinned pool."""
        old = m._parameters["weight"]
        if s.name in self.fp8:
            t, sc = self.fp8[s.name]
            if not self.mapped:
                dst = handle.pool.tensor_host(rec.index, rec.names[s.w_idx])
                lay = _core.quant_layout(_FP8_BLOCK, tuple(t.shape), "bf16")
                raw = _lt._host_tensor(dst.address, dst.bytes, torch.uint8, (dst.bytes,),
                                       handle.pool)
                raw[lay.data_offset:lay.data_offset + lay.data_bytes].copy_(self.views.raw(t))
                raw[lay.scale_offset:lay.scale_offset + lay.scale_bytes].copy_(
                    self.views.raw(sc))
            # peft reads a base layer's compute_dtype (as for bitsandbytes
            # layers) to give its adapters the dtype lwo computes in, not fp8.
            m.compute_dtype = s.dtype
            p = nn.Parameter(self.views.tensor(t), requires_grad=False)
            m._parameters["weight"] = p
            return p
        shape2 = _lt._quant_shape(old)
        name = rec.names[s.w_idx]
        src = self.views.tensor(self.where[(id(m), "weight")]).reshape(shape2)
        handle.pool.write_quantized(rec.index, name, src)
        dense = torch.empty(shape2, dtype=old.dtype)
        _lt._dequantize_host(handle.pool, rec.index, name, s.quant, old.dtype, dense)
        p = nn.Parameter(dense.view(tuple(old.shape)), requires_grad=False)
        m._parameters["weight"] = p
        return p

    def layer_changed(self, handle, rec):
        """Offload._layer_changed for a record of this checkpoint: a write to
        the file's bytes (a mapped record's parameters, an fp8 weight of the
        file) is refused; a pinned record that holds an fp8 weight of the file
        has its other quantized weights quantized again. Returns True if it
        did it all, False to leave it to Offload._layer_changed."""
        if self.mapped:
            s = rec.modules[0]
            raise ArgumentError(C.LWO_ERR_UNSUPPORTED, (
                "lwo.torch: %s %r streams from the read-only mapping of %s, which lwo copies "
                "to the device as the file holds it: its parameters were written in place (or "
                "handle.mark_changed named it), and lwo would not stream that write (it stays "
                "in this process's copy-on-write view of the file). Offload with "
                "checkpoint_copy=True for weights that change") % (
                    s.kind, s.name, self._files_text()))
        ro = [s for s in rec.modules if s.name in self.fp8]
        if not ro:
            return False
        for s in ro:
            if s.weight._version:
                raise ArgumentError(C.LWO_ERR_UNSUPPORTED, (
                    "lwo.torch: %s %r streams the fp8 weight %r of %s as the file holds it: "
                    "its parameter (the file's codes, read-only) was written in place, and lwo "
                    "would not stream that write") % (s.kind, s.name, self.fp8[s.name][0].name,
                                                      self._files_text()))
        for s in rec.modules:
            if s.quant and s.name not in self.fp8:
                handle.pool.write_quantized(rec.index, rec.names[s.w_idx],
                                            s.weight.detach().contiguous().view(
                                                _lt._quant_shape(s.weight)))
        handle.backend.layer_changed(handle.pool, rec.index)
        return True

    def refuse_grad(self, handle, rec):
        """Offload._make_grads for a record that became trainable."""
        ro = [s for s in rec.modules if self.mapped or s.name in self.fp8]
        if ro:
            s = ro[0]
            raise ArgumentError(C.LWO_ERR_UNSUPPORTED, (
                "lwo.torch: %s %r streams from the read-only mapping of %s: its weight and "
                "bias cannot require a gradient (an optimizer would write them). Offload with "
                "checkpoint_copy=True to train them (copied into lwo's pinned pool), or train "
                "an adapter beside them") % (s.kind, s.name, self._files_text()))

    def dense(self, s, p):
        """What close() puts back for parameter p of module s: an fp8 weight
        dequantized (bf16), else its data."""
        if p is s.weight and s.name in self.fp8:
            t, sc = self.fp8[s.name]
            return self._dense(t, sc, s.dtype)
        return p.data


def _fill_unset(t):
    """Fills a fresh tensor with what marks it as not initialized: NaN, or
    an integer type's least value."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).min)


def _unset(t):
    if not t.numel():
        return False
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    if t.dtype == torch.bool:
        return False
    return bool((t == torch.iinfo(t.dtype).min).all())


def prepare(model, checkpoint, targets, device, key=None, init=None, copy=False):
    """Opens the checkpoint and matches it to the model (see Source.plan);
    nothing changes before every check passed. Returns the Source."""
    if key is not None and not callable(key) and not isinstance(key, str):
        raise TypeError("lwo.torch.offload: checkpoint_key must be a str (a prefix of the "
                        "file's names) or a callable name -> file name, not %r" % (key,))
    if init is not None and not callable(init):
        raise TypeError("lwo.torch.offload: checkpoint_init must be a callable (name, module), "
                        "not %r" % (init,))
    path = resolve(checkpoint)
    ckpt = _core.Checkpoint(path)
    src = Source(path, ckpt, mapped=not copy)
    src._root = model
    src.plan(model, targets, key, init, device)
    return src
