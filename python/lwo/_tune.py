"""What lwo.torch's automatic plan needs from liblwo's planner, without torch.

- :func:`parse_budget`: a device memory budget as bytes, a string ("16GiB",
  "512 MB", "25%") or a share of the device's free memory (0 < x <= 1).
- :func:`plan`: lwo_plan_create over a pool, with the compute times the
  adapter measured, the link calibrated by the library, and the result as a
  plain dict (depth, groups of records, resident groups, prediction).
- :func:`split_runs`: the planner's groups cut where the records' kinds
  (trainable, quantized) change, so no record mixes them.
- :func:`merge_small`: runs of small records of one kind, merged before the
  plan.
"""

import ctypes
import re

from . import _capi as C
from ._errors import check

_lib = C.lib

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2,
          "g": 1000 ** 3, "gb": 1000 ** 3, "t": 1000 ** 4, "tb": 1000 ** 4,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_budget(budget, free_bytes=None, what="budget"):
    """Bytes of a budget: an int (bytes), a float in (0, 1] (that share of
    `free_bytes`), or a string: a number with a unit (B, kB, MB, GB, TB,
    KiB, MiB, GiB, TiB; case ignored) or a percentage of `free_bytes`
    ("25%"). None stays None. Anything else is a ValueError that names it."""
    if budget is None:
        return None
    if isinstance(budget, bool):
        raise ValueError("%s %r: give bytes, a string such as '16GiB' or '25%%', or a share "
                         "of the device's free memory (0 < share <= 1)" % (what, budget))
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError("%s %d bytes: must be > 0" % (what, budget))
        return budget
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise ValueError("%s %r: a float is a share of the device's free memory, "
                             "0 < share <= 1 (give bytes as an int)" % (what, budget))
        return _share(budget, free_bytes, what, budget)
    if isinstance(budget, str):
        text = budget.strip().lower().replace("_", "")
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(%|[a-z]*)", text)
        if m is None or (m.group(2) not in _UNITS and m.group(2) != "%"):
            raise ValueError("%s %r: not a size (examples: 16GiB, 512MB, 1e9, 25%%)"
                             % (what, budget))
        value = float(m.group(1))
        if m.group(2) == "%":
            if not 0.0 < value <= 100.0:
                raise ValueError("%s %r: a percentage of the device's free memory must be "
                                 "in (0, 100]" % (what, budget))
            return _share(value / 100.0, free_bytes, what, budget)
        n = int(value * _UNITS[m.group(2)])
        if n <= 0:
            raise ValueError("%s %r: must be at least one byte" % (what, budget))
        return n
    raise ValueError("%s %r: give bytes (int), a string such as '16GiB' or '25%%', or a "
                     "share of the device's free memory (float)" % (what, budget))


def _share(share, free_bytes, what, given):
    if free_bytes is None:
        raise ValueError("%s %r: a share of the device's free memory needs a device" %
                         (what, given))
    return max(1, int(share * free_bytes))


def format_bytes(n):
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return "%.2f %s" % (n / size, unit)
    return "%d B" % n


def split_runs(groups, kinds):
    """groups: [(first, n, resident)] over records 0..R-1 in order; kinds:
    a hashable per record. Returns the groups cut into runs of one kind."""
    out = []
    for first, n, resident in groups:
        start = first
        for i in range(first + 1, first + n):
            if kinds[i] != kinds[i - 1]:
                out.append((start, i - start, resident))
                start = i
        out.append((start, first + n - start, resident))
    return out


def merge_small(sizes, kinds, small, run):
    """Groups [(first, n, False)] over records 0..R-1: consecutive records of
    one kind, each under `small` bytes, merged while the group stays within
    `run` bytes; every other record alone."""
    out = []
    i, n = 0, len(sizes)
    while i < n:
        j, total = i + 1, sizes[i]
        if sizes[i] < small:
            while (j < n and sizes[j] < small and kinds[j] == kinds[i]
                   and total + sizes[j] <= run):
                total += sizes[j]
                j += 1
        out.append((i, j - i, False))
        i = j
    return out


def plan(pool_handle, fwd_ms, bwd_ms, trainable, train, budget_bytes, depths=None,
         group=True, grad_depth=2, link=None):
    """lwo_plan_create over the pool's records. fwd_ms, bwd_ms, trainable:
    per record; train: a training step (else a forward); depths: ring depths
    to try (None: the library's); group: let the planner group consecutive
    records; link: None to calibrate it on the device, or a dict of
    h2d_gbps, d2h_gbps, duplex_h2d_gbps, duplex_d2h_gbps, copy_overhead_ms.
    Returns a dict: depth, groups [(first, n, resident)], predicted_ms,
    predicted_stall_ms, device_bytes, budget_bytes, h2d_bytes, d2h_bytes,
    the link used, ungrouped_ms, first_k_ms. Raises the library's status
    (an over-budget plan: lwo.ResourceError naming the bytes)."""
    n = len(fwd_ms)
    cfg = C.lwo_plan_config()
    _lib.lwo_plan_config_init(cfg)
    keep = []
    f = (ctypes.c_double * n)(*[max(0.0, float(v)) for v in fwd_ms])
    keep.append(f)
    cfg.fwd_ms = f
    if train:
        b = (ctypes.c_double * n)(*[max(0.0, float(v)) for v in bwd_ms])
        t = (ctypes.c_uint8 * n)(*[1 if v else 0 for v in trainable])
        keep += [b, t]
        cfg.bwd_ms = b
        cfg.trainable = t
    flags = (C.LWO_PLAN_TRAIN if train else 0) | (C.LWO_PLAN_GROUP if group else 0)
    if link is None:
        flags |= C.LWO_PLAN_CALIBRATE_LINK
    else:
        cfg.h2d_gbps = link["h2d_gbps"]
        cfg.d2h_gbps = link["d2h_gbps"]
        cfg.duplex_h2d_gbps = link.get("duplex_h2d_gbps", 0.0)
        cfg.duplex_d2h_gbps = link.get("duplex_d2h_gbps", 0.0)
        cfg.copy_overhead_ms = link.get("copy_overhead_ms", 0.0)
    cfg.flags = flags
    cfg.grad_depth = int(grad_depth)
    cfg.budget_bytes = int(budget_bytes)
    if depths:
        d = (ctypes.c_uint32 * len(depths))(*[int(v) for v in depths])
        keep.append(d)
        cfg.depths = d
        cfg.n_depths = len(depths)
    handle = C.lwo_plan_p()
    check(_lib.lwo_plan_create(pool_handle, ctypes.byref(cfg), ctypes.byref(handle)))
    try:
        info = C.lwo_plan_info()
        info.size = ctypes.sizeof(info)
        check(_lib.lwo_plan_get_info(handle, ctypes.byref(info)))
        groups = []
        g = C.lwo_plan_group()
        for i in range(info.n_groups):
            g.size = ctypes.sizeof(g)
            check(_lib.lwo_plan_get_group(handle, i, ctypes.byref(g)))
            groups.append((g.first_layer, g.n_layers, bool(g.resident)))
        return {
            "depth": info.depth, "groups": groups, "train": bool(info.train),
            "predicted_ms": info.predicted_ms, "predicted_stall_ms": info.predicted_stall_ms,
            "device_bytes": info.device_bytes, "budget_bytes": info.budget_bytes,
            "h2d_bytes": info.h2d_bytes, "d2h_bytes": info.d2h_bytes,
            "link": {"h2d_gbps": info.h2d_gbps, "d2h_gbps": info.d2h_gbps,
                     "duplex_h2d_gbps": info.duplex_h2d_gbps,
                     "duplex_d2h_gbps": info.duplex_d2h_gbps,
                     "copy_overhead_ms": info.copy_overhead_ms},
            "ungrouped_ms": info.ungrouped_ms, "first_k_ms": info.first_k_ms,
        }
    finally:
        _lib.lwo_plan_destroy(handle)
