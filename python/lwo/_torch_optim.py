"""lwo.torch.optim: torch.optim.Optimizers whose streamed parameters are
updated by lwo's host optimizer (lwo_optim).

    import lwo.torch
    handle = lwo.torch.offload(model)
    opt = lwo.torch.optim.AdamW(model.parameters(), lr=1e-4)
    for x in batches:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

A streamed parameter (a weight or bias of a trainable record of an
lwo.torch.offload handle) is updated on the host by lwo's fused optimizer:
f32 masters and the moments live in host memory, each layer's update runs
on host threads as soon as its gradients are in host memory, and writes the
new weights into the pool rounded to their dtype; the next stage of a
layer waits for that layer's update alone. Every other parameter (norms,
embeddings, LoRA adapters: whatever stays on the GPU) is updated by
PyTorch's own optimizer (fused on CUDA) with the same param_groups, so a
training loop needs one optimizer. docs/PYTHON.md says what is supported.
"""

import math
import weakref

import torch

from . import _capi as C
from ._errors import ArgumentError, StateError

__all__ = ["AdamW", "SGD"]

# state_dict keys of PyTorch's optimizers for lwo's moments.
_STATE_KEYS = {"adamw": (("exp_avg", "m"), ("exp_avg_sq", "v")),
               "sgd": (("momentum_buffer", "m"),)}


def _rank_part(t, shard, what):
    """The elements of tensor `t` (a streamed parameter or state of one) that
    this rank holds, flat; shard: (first, n) of the rank's part (the
    handle's _shard_of). `t` is the whole tensor (its part is sliced out) or
    already the rank's n elements (a parameter split over ranks, or its
    state as state_dict() gives it)."""
    first, n = shard
    flat = t.detach().reshape(-1)
    if flat.numel() == n:
        return flat
    if flat.numel() >= first + n:
        return flat[first:first + n]
    raise ValueError("lwo.torch.optim: %s has %d elements: neither the whole tensor nor this "
                     "rank's %d (elements [%d, %d))" % (what, flat.numel(), n, first, first + n))


class _Binding:
    """lwo's optimizer over one offload handle's gradient set, for the
    streamed parameters of one lwo.torch.optim optimizer. The handle calls
    detach() before it makes its pool or gradient set again (the state is
    kept in tensors) and attach() after (a new lwo optimizer, the state
    written back)."""

    def __init__(self, opt, handle):
        self.opt_ref = weakref.ref(opt)
        self.handle = handle
        self.lwo = None
        self.keys = {}        # param -> (record index, tensor name), while attached
        self.saved = {}       # param -> {"master"|"m"|"v": tensor}, while detached
        self.started = False  # a step begun in a backward pass (in_backward)
        self.open = False     # that step is open: layers are added as they are done
        self.closed = False
        self.groups = {}      # param -> its param_group's index, while attached
        self.lost = False     # the state went with the handle's close()
        self.quantized = ()   # params streamed quantized (fp8-block, trainable), while attached
        self.stale = False    # their masters moved since the parameters were set from them
        handle._optims.append(self)

    # -- the lwo object ----------------------------------------------------
    def attach(self):
        opt = self.opt_ref()
        h = self.handle
        if opt is None or self.closed or h.closed or h.grads is None or self.lwo is not None:
            return
        for other in list(h._optims):
            if other is not self and other.lwo is not None:
                # One optimizer drives a handle's records at a time: the one
                # that steps takes them (the other keeps its state aside,
                # and is dropped once it is gone)
                gone = other.opt_ref() is None
                other.detach(final=gone, keep=not gone)
        # (0 threads: one per core, or with a group the rank's share of its node's)
        self.lwo = h.backend.optimizer(h.grads, opt._kind, opt._state_dtype, opt._flags(),
                                       opt._n_threads or h._host_threads, opt._seed)
        keys = h._param_key
        self.keys = {p: keys[p] for p in opt._streamed_of(h)}
        self.groups = opt._group_signature(self.keys)
        for p, gi in self.groups.items():
            if gi:
                self.lwo.set_group(self.keys[p][0], self.keys[p][1], gi)
        saved, self.saved = self.saved, {}
        # A quantized weight's pool record holds its codes, from which lwo
        # makes the masters; the parameter holds the values they came from.
        self.quantized = tuple(s.weight for s in h.states
                               if s.quant and s.weight in self.keys)
        for p in self.quantized:
            if p not in saved:
                key = self.keys[p]
                self.lwo.write(key[0], key[1], "master", p.detach().reshape(-1).float())
        # masters restored below: written while detached, perhaps, so synced again
        self.stale = any("master" in saved.get(p, ()) for p in self.quantized)
        for p, st in saved.items():
            key = self.keys.get(p)
            if key is None:
                continue
            for which, t in st.items():
                self.lwo.write(key[0], key[1], which, t)

    def detach(self, final=False, keep=True):
        """Waits for the step, keeps the state in tensors (unless not
        `keep`), destroys the lwo optimizer (final: the binding ends)."""
        if self.lwo is not None:
            if self.open:
                self.open = False
                self.lwo.step_close()
            self.lwo.wait()
            self.sync_params()
            self.lost = bool(self.keys) and not keep
            keep = keep and self.opt_ref() is not None  # nobody to read it otherwise
            self.saved = {p: self.read(p) for p in self.keys} if keep else {}
            self.lwo.close()
            self.lwo = None
            self.keys = {}
        self.started = False
        if final:
            self.closed = True
            if self in self.handle._optims:
                self.handle._optims.remove(self)

    def read(self, p):
        """The state of streamed parameter p: f32 master and the moments, as
        flat CPU tensors."""
        if self.lwo is None:
            return self.saved.get(p)
        opt = self.opt_ref()
        layer, name = self.keys[p]
        _first, n = self.handle._shard_of(layer, name)  # (a sharded pool: this rank's part)
        out = {"master": torch.empty(n, dtype=torch.float32)}
        sdt = torch.bfloat16 if opt._state_dtype == "bf16" else torch.float32
        for _key, which in _STATE_KEYS[opt._kind]:
            out[which] = torch.empty(n, dtype=sdt)
        for which, t in out.items():
            self.lwo.read(layer, name, which, t)
        return out

    def write(self, p, state):
        """Sets p's state (a dict as read() returns; missing keys keep
        theirs)."""
        if self.lwo is None:
            cur = self.saved.setdefault(p, {})
            cur.update(state)
            return
        self.lwo.wait()
        layer, name = self.keys[p]
        for which, t in state.items():
            self.lwo.write(layer, name, which, t)
        self.stale |= p in self.quantized and "master" in state

    def params_written(self, rec):
        """Record `rec`'s parameters were written in place (copy_,
        load_state_dict): the masters follow them."""
        if self.lwo is None or not rec.trainable:
            return
        done = False
        for q in rec.params:
            key = self.keys.get(q)
            if key is None:
                continue
            if not done:
                self.lwo.wait()
                done = True
            self.lwo.write(key[0], key[1], "master", _rank_part(
                q, self.handle._shard_of(*key), "parameter").float())

    # -- steps ------------------------------------------------------------
    def owns_all(self):
        """Every parameter in the handle's trainable records is this
        optimizer's: lwo updates whole records."""
        h = self.handle
        mine = self.keys
        for rec in h.records:
            if not rec.trainable:
                continue
            for q in rec.params:
                if q not in mine:
                    s = next(s for s in rec.modules if q is s.weight or q is s.bias)
                    what = "weight" if q is s.weight else "bias"
                    raise ArgumentError(C.LWO_ERR_INVALID_ARGUMENT, (
                        "lwo.torch.optim: the %s of streamed module %r is in a trainable "
                        "record (%s) but not in this optimizer%s: lwo's host optimizer "
                        "updates whole records; give the optimizer every trainable "
                        "parameter of the record, or set requires_grad=False on the others "
                        "before offload()") % (what, s.name, rec.name,
                                               "" if q.requires_grad else
                                               " (it requires no gradient)"))

    def step(self, n, hyper, max_norm=0.0, extra_sumsq=0.0):
        """Starts lwo's step; hyper: one dict of lwo_optim_step_params
        fields per param_group (each tensor is in its parameter's)."""
        opt = self.opt_ref()
        if self.lwo is not None and opt._group_signature(self.keys, self.handle) != self.groups:
            # parameters added (add_param_group) or regrouped since: made again
            self.detach()
        if self.lwo is None:
            self.attach()
            if self.lwo is None:
                return False
        self.owns_all()
        self.handle._unstage_trainable()
        self.lwo.step_groups(n, hyper, max_norm=max_norm, extra_sumsq=extra_sumsq)
        self.stale = bool(self.quantized)
        return True

    def _second_pass(self):
        return StateError(C.LWO_ERR_BUSY, (
            "lwo.torch.optim: a second backward pass ended without optimizer.step() "
            "since the first, but in_backward=True takes a step in each backward pass "
            "(the first's update is already applied); to accumulate gradients over "
            "several backward passes use in_backward=False"))

    def backward_started(self):
        """The handle's backward pass begins: with in_backward=True the step
        opens here (lwo_optim_step_open), and each record is added as its
        last gradient of the pass is ended (layer_done), so its update
        starts as soon as that gradient lands."""
        opt = self.opt_ref()
        if opt is None or not opt._in_backward or opt._delayed or self.closed or self.open:
            return  # (a delayed update runs after every layer has landed: begun at the end)
        if self.started:
            return  # a second pass without a step: refused at its end
        hyper = opt._streamed_hyper()
        if hyper is None:
            return
        if self.lwo is not None and opt._group_signature(self.keys, self.handle) != self.groups:
            self.detach()  # parameters added or regrouped since: made again
        if self.lwo is None:
            self.attach()
            if self.lwo is None:
                return
        self.owns_all()
        self.lwo.wait()  # the last step's tail (its last layers were staged by now)
        self.lwo.step_open(opt._n_steps + 1, hyper)
        self.open = True

    def layer_done(self, layer):
        """Every gradient of pool layer `layer` in this backward pass has
        been ended: the open step updates it once they land."""
        if self.open:
            self.lwo.step_add(layer)

    def backward_ended(self):
        """The handle's backward pass has ended every gradient slot (its
        fence comes next): with in_backward=True the open step takes the
        rest of the layers and closes (or, where none was opened, the step
        starts here, each layer updated as it lands)."""
        opt = self.opt_ref()
        if opt is None or not opt._in_backward or self.closed:
            return
        if self.open:
            self.open = False
            self.handle._unstage_trainable()  # a copy made before the update is old
            self.lwo.step_close()
            self.started = True
            self.stale = bool(self.quantized)
            return
        if self.started:
            raise self._second_pass()
        hyper = opt._streamed_hyper()
        if hyper is None:
            return
        self.started = self.step(opt._n_steps + 1, hyper)

    def wait(self):
        if self.lwo is not None:
            self.lwo.wait()

    def sync_params(self):
        """Where a step or a write moved the masters of quantized weights
        since the last call, waits for the step and sets their parameters
        from the masters (rounded to their dtype); their records keep their
        version, so that the handle does not take this for a write by the
        caller. Otherwise does nothing (not even wait)."""
        if self.lwo is None or not self.stale:
            return
        self.lwo.wait()
        h = self.handle
        changed = set()
        with torch.no_grad():
            for p in self.quantized:
                layer, name = self.keys[p]
                master = torch.empty(p.numel(), dtype=torch.float32)
                self.lwo.read(layer, name, "master", master)
                p.copy_(master.view(p.shape))
                changed.add(layer)
        for layer in changed:
            rec = h.records[layer]
            rec.version = rec.current_version()
        self.stale = False

    def stats(self):
        return self.lwo.stats() if self.lwo is not None else None


class _Optimizer(torch.optim.Optimizer):
    """The part AdamW and SGD share (see AdamW)."""

    _kind = None

    def __init__(self, params, defaults, state="f32", stochastic_rounding=False, max_norm=None,
                 delayed=False, in_backward=False, n_threads=0, seed=0, fused=None):
        super().__init__(params, defaults)
        if state not in ("f32", "bf16"):
            raise ArgumentError(C.LWO_ERR_INVALID_ARGUMENT, "lwo.torch.optim: state %r is "
                                "neither 'f32' nor 'bf16'" % (state,))
        if stochastic_rounding and state != "bf16":
            raise ArgumentError(C.LWO_ERR_INVALID_ARGUMENT, "lwo.torch.optim: "
                                "stochastic_rounding needs state='bf16'")
        if max_norm is not None and not (math.isfinite(max_norm) and max_norm > 0):
            raise ArgumentError(C.LWO_ERR_INVALID_ARGUMENT, "lwo.torch.optim: max_norm %r is "
                                "not a positive number" % (max_norm,))
        if max_norm is not None and (delayed or in_backward):
            raise ArgumentError(C.LWO_ERR_INVALID_ARGUMENT, (
                "lwo.torch.optim: max_norm with %s: clipping by the global norm needs every "
                "gradient of the step before its updates are final, which the %s does not "
                "wait for") % (("delayed=True", "one-step-delayed update") if delayed else
                               ("in_backward=True", "step begun in the backward pass")))
        self._state_dtype = state
        self._stochastic = bool(stochastic_rounding)
        self._max_norm = max_norm
        self._delayed = bool(delayed)
        self._in_backward = bool(in_backward)
        self._n_threads = int(n_threads)
        self._seed = int(seed)
        self._fused = fused
        self._n_steps = 0
        self._group_steps = []  # each param_group's steps (the streamed tensors' step numbers)
        self._bindings = {}   # handle -> _Binding
        self._inner = None    # PyTorch's optimizer over the other parameters
        self._inner_params = None
        self._inner_ids = None
        self._classify()

    # -- which parameter goes where ---------------------------------------
    def _flags(self):
        return ((C.LWO_OPTIM_STOCHASTIC_ROUNDING if self._stochastic else 0)
                | (C.LWO_OPTIM_CLIPPING if self._max_norm is not None else 0)
                | (C.LWO_OPTIM_DELAYED if self._delayed else 0))

    def _streamed_of(self, handle):
        """This optimizer's parameters that `handle` streams."""
        keys = handle._param_key
        return [p for g in self.param_groups for p in g["params"] if p in keys]

    def _classify(self):
        """Splits the parameters between lwo (streamed by a live handle) and
        PyTorch (the rest), making bindings and the inner optimizer anew
        where that changed (offload() or close() since the last step)."""
        from . import torch as lt
        handles = [h for h in list(lt._LIVE_HANDLES) if not h.closed and h.records]
        streamed = {}
        for h in handles:
            for p in self._streamed_of(h):
                streamed[p] = h
        for h in list(self._bindings):
            b = self._bindings[h]
            if h.closed or b.closed:
                if b.lost:
                    raise StateError(C.LWO_ERR_INVALID_HANDLE, (
                        "lwo.torch.optim: the offload handle of this optimizer's streamed "
                        "parameters was closed: their state stayed with it; make a new "
                        "optimizer after close()"))
                del self._bindings[h]
        for h in set(streamed.values()):
            if h not in self._bindings:
                b = _Binding(self, h)
                self._bindings[h] = b
                b.attach()
        if self._max_norm is not None and len(self._bindings) > 1:
            raise ArgumentError(C.LWO_ERR_INVALID_ARGUMENT, (
                "lwo.torch.optim: max_norm over parameters streamed by %d offload handles: "
                "clipping takes the norm of one handle's gradients (and the GPU's); offload "
                "the model with one offload() call") % len(self._bindings))
        rest = [[p for p in g["params"] if p not in streamed] for g in self.param_groups]
        ids = [[id(p) for p in ps] for ps in rest]
        if ids != self._inner_ids:
            self._inner_ids = ids
            self._inner_params = rest
            self._inner = self._make_inner(rest) if any(rest) else None
        self._streamed = streamed

    def _make_inner(self, groups):
        gs = []
        for g, ps in zip(self.param_groups, groups):
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = ps
            gs.append(d)
        return self._torch_optimizer(gs)

    def _sync_inner(self):
        for g, ig in zip(self.param_groups, self._inner.param_groups):
            for k, v in g.items():
                if k != "params":
                    ig[k] = v

    def _group_signature(self, keys, handle=None):
        """param -> the index of its param_group, for the streamed parameters
        of `keys` (or, with `handle`, of the handle as it streams them now)."""
        if handle is not None:
            keys = handle._param_key
        return {p: i for i, g in enumerate(self.param_groups) for p in g["params"] if p in keys}

    def _streamed_hyper(self):
        """lwo's hyperparameters of each param_group (lwo_optim_step_params
        fields; lwo updates each streamed tensor with its group's), or None if
        no group holds a streamed parameter."""
        if not any(p in self._streamed for g in self.param_groups for p in g["params"]):
            return None
        out = []
        for g, n in zip(self.param_groups, self._next_steps()):
            self._check_group(g)
            if self._kind == "adamw":
                b1, b2 = g["betas"]
                out.append({"step": n, "lr": g["lr"], "beta1": b1, "beta2": b2,
                            "eps": g["eps"], "weight_decay": g["weight_decay"]})
            else:
                out.append({"step": n, "lr": g["lr"], "momentum": g["momentum"],
                            "dampening": g["dampening"], "weight_decay": g["weight_decay"]})
        return out

    def _next_steps(self):
        """Each param_group's step number for the coming step: its own count
        (a group added later starts at 1, as PyTorch's per-parameter steps
        do), advanced where the group has a parameter that requires a
        gradient."""
        gs = self._group_steps
        gs += [0] * (len(self.param_groups) - len(gs))
        return [n + 1 if any(p.requires_grad for p in g["params"]) else max(n, 1)
                for g, n in zip(self.param_groups, gs)]

    # -- the torch.optim.Optimizer interface ------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One step: the streamed parameters' updates start on lwo's host
        threads (they run on while this returns; the next stage of each
        layer waits for its own), the others are updated by PyTorch's
        optimizer on their device. With max_norm the gradients are first
        clipped to it by their global norm (streamed and not)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._classify()
        for b in self._bindings.values():
            j = b.handle._joined
            if j is not None:
                raise StateError(C.LWO_ERR_CAPTURING, (
                    "lwo.torch.optim: step() in a CUDA graph capture (stream 0x%x) of a "
                    "streamed model: lwo's optimizer updates the weights on the host, "
                    "which a graph does not replay; step after each replay instead "
                    "(graph.replay(); optimizer.step())") % (j.stream or 0))
        n = self._n_steps + 1
        hyper = self._streamed_hyper()
        resident = [p for g in (self._inner_params or []) for p in g if p.grad is not None]
        extra = 0.0
        if self._max_norm is not None and resident:
            extra = float(sum(torch.sum(p.grad.detach().float() ** 2) for p in resident))
        started = False
        for b in self._bindings.values():
            if b.started:
                b.started = False
                started = True
            elif hyper is not None:
                started |= b.step(n, hyper, max_norm=self._max_norm or 0.0, extra_sumsq=extra)
        if self._inner is not None:
            if self._max_norm is not None and resident:
                if self._bindings and started:
                    b = next(iter(self._bindings.values()))
                    b.wait()  # the norm, streamed gradients included
                    norm = b.stats().last_norm
                else:
                    norm = math.sqrt(extra)
                c = self._max_norm / (norm + 1e-6)
                if c < 1:
                    torch._foreach_mul_([p.grad for p in resident], c)
            self._sync_inner()
            self._inner_step()
        self._n_steps = n
        self._group_steps = [n_ if any(p.requires_grad for p in g["params"]) else c
                             for g, n_, c in zip(self.param_groups, self._next_steps(),
                                                 self._group_steps)]
        return loss

    def _inner_step(self):
        self._inner.step()

    def zero_grad(self, set_to_none=True):
        if not set_to_none:
            self.synchronize()  # an update may still read the host gradients
        super().zero_grad(set_to_none=set_to_none)

    def synchronize(self):
        """Waits for the streamed parameters' updates: after it, reading a
        streamed parameter gives the new weights (lwo's own stages wait by
        themselves)."""
        for b in self._bindings.values():
            b.wait()

    wait = synchronize

    def sync_params(self):
        """Waits for the updates, then sets the parameters of weights streamed
        quantized (offload(quant_trainable=True)) from their f32 masters,
        rounded to their dtype. lwo computes from the masters; the parameter
        follows them here, at state_dict() (the optimizer's or the
        model's) and at the handle's close(), not after every step."""
        for b in self._bindings.values():
            b.wait()
            b.sync_params()

    def stats(self):
        """lwo_optim_stats of each handle's host optimizer (a list)."""
        return [s for s in (b.stats() for b in self._bindings.values()) if s is not None]

    def state_dict(self):
        """PyTorch's layout: for a streamed parameter "step" and the moments
        under PyTorch's names (AdamW: exp_avg, exp_avg_sq; SGD:
        momentum_buffer) in the state dtype, flat in the parameter's shape,
        and "master", its f32 master weights."""
        self._classify()
        self.sync_params()
        merged = {}
        inner_state = self._inner.state if self._inner is not None else {}
        self._next_steps()  # (the counts' list as long as the groups)
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                b = self._bindings.get(self._streamed.get(p))
                if b is not None:
                    st = b.read(p)
                    if st is None:
                        continue
                    d = {"step": torch.tensor(float(self._group_steps[gi]))}
                    for key, which in _STATE_KEYS[self._kind]:
                        d[key] = st[which].view(p.shape)
                    d["master"] = st["master"].view(p.shape)
                    merged[p] = d
                elif p in inner_state:
                    merged[p] = inner_state[p]
        saved = self.state
        self.state = merged
        try:
            out = super().state_dict()
        finally:
            self.state = saved
        out["lwo"] = {"steps": self._n_steps}
        return out

    def load_state_dict(self, state_dict):
        """Loads a state_dict of this class, or of PyTorch's own optimizer of
        the same kind (the masters then come from the parameters as they
        are)."""
        self._classify()
        self.synchronize()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)):
            raise ValueError("lwo.torch.optim: the loaded state_dict's param_groups do not match "
                             "this optimizer's (their count or sizes differ)")
        by_id = {}
        for sg, g in zip(groups, self.param_groups):
            for i, p in zip(sg["params"], g["params"]):
                by_id[i] = p
            for k, v in sg.items():
                if k != "params":
                    g[k] = v
        inner_sd = {"state": {}, "param_groups": []}
        inner_ids = {}
        if self._inner is not None:
            for sg, ps in zip(groups, self._inner_params):
                ids = [i for i in sg["params"] if any(by_id[i] is q for q in ps)]
                inner_sd["param_groups"].append(dict({k: v for k, v in sg.items()
                                                      if k != "params"}, params=ids))
                inner_ids.update({i: True for i in ids})
        steps = state_dict.get("lwo", {}).get("steps")
        group_of = {i: gi for gi, sg in enumerate(groups) for i in sg["params"]}
        group_steps = [0] * len(groups)
        sdt = torch.bfloat16 if self._state_dtype == "bf16" else torch.float32
        shard_keys = {}  # binding -> its handle's param -> (record, tensor name)
        for i, st in state_dict["state"].items():
            p = by_id.get(i)
            if p is None:
                continue
            b = self._bindings.get(self._streamed.get(p))
            if b is None:
                if i in inner_ids:
                    inner_sd["state"][i] = st
                continue
            keys = shard_keys.get(b)
            if keys is None:
                keys = shard_keys[b] = b.handle._param_key
            # this rank's part of each tensor (a sharded pool's shard; else all)
            shard = b.handle._shard_of(*keys[p])
            new = {}
            for key, which in _STATE_KEYS[self._kind]:
                if key in st:
                    new[which] = _rank_part(st[key], shard, "state %r of parameter %d"
                                            % (key, i)).to("cpu", sdt).contiguous()
            m = st.get("master")
            new["master"] = _rank_part(m if m is not None else p, shard,
                                       "master of parameter %d" % i).to(
                                           "cpu", torch.float32).contiguous()
            b.write(p, new)
            if "step" in st:
                gi = group_of[i]
                group_steps[gi] = max(group_steps[gi], int(float(st["step"])))
                if state_dict.get("lwo") is None:
                    steps = max(int(steps or 0), int(float(st["step"])))
        if self._inner is not None:
            self._inner.load_state_dict(inner_sd)
        self._n_steps = int(steps or 0)
        for gi, (sg, ps) in enumerate(zip(groups, [g["params"] for g in self.param_groups])):
            for i in sg["params"]:
                st = state_dict["state"].get(i)
                if st is not None and "step" in st:
                    group_steps[gi] = max(group_steps[gi], int(float(st["step"])))
        self._group_steps = group_steps

    def __repr__(self):
        return "lwo.torch.optim.%s(%d streamed, %d on the GPU, state %s%s%s)" % (
            type(self).__name__, len(getattr(self, "_streamed", {})),
            sum(len(g) for g in (self._inner_params or [])), self._state_dtype,
            ", max_norm %g" % self._max_norm if self._max_norm is not None else "",
            ", delayed" if self._delayed else "")


class AdamW(_Optimizer):
    """torch.optim.AdamW whose streamed parameters are updated by lwo's host
    optimizer (PyTorch's AdamW arithmetic on f32 masters; the pool gets
    their rounding to the weights' dtype).

    lr, betas, eps, weight_decay: as torch.optim.AdamW (amsgrad, maximize
    and capturable are not supported). lwo's options:

    - state: "f32" (default) or "bf16" moments of the streamed parameters.
    - stochastic_rounding: bf16 moments rounded stochastically (seed=).
    - max_norm: clips the step's gradients to this global norm, streamed
      and resident together (lwo's speculative clipping: each layer is
      updated as it lands and redone if the norm asks; twice the state's
      host memory).
    - delayed: the one-step-delayed update of the streamed parameters (the
      pool lags the masters by one step; see lwo_optim's LWO_OPTIM_DELAYED).
    - in_backward: the streamed step opens as each backward pass begins,
      and each layer is updated as its last gradient of the pass lands,
      while the GPU goes on with the pass; every backward pass is then a
      step (no accumulation over several).
    - n_threads: lwo's update threads (0: one per CPU; for a model offloaded
      with process_group= over nodes of several ranks, the node's CPUs /
      node_size).
    - fused: PyTorch's fused AdamW for the parameters on the GPU (None:
      fused where they are all CUDA tensors)."""

    _kind = "adamw"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, state="f32", stochastic_rounding=False,
                 max_norm=None, delayed=False, in_backward=False, n_threads=0, seed=0,
                 fused=None):
        if amsgrad or maximize:
            raise ArgumentError(C.LWO_ERR_INVALID_ARGUMENT, "lwo.torch.optim.AdamW: %s is "
                                "not supported" % ("amsgrad" if amsgrad else "maximize"))
        if not 0.0 <= lr:
            raise ValueError("lwo.torch.optim.AdamW: invalid lr %r" % (lr,))
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, state=state, stochastic_rounding=stochastic_rounding,
                         max_norm=max_norm, delayed=delayed, in_backward=in_backward,
                         n_threads=n_threads, seed=seed, fused=fused)

    def _check_group(self, g):
        b1, b2 = g["betas"]
        if not (0 <= b1 < 1 and 0 <= b2 < 1 and g["eps"] > 0 and g["weight_decay"] >= 0
                and g["lr"] >= 0):
            raise ArgumentError(C.LWO_ERR_INVALID_ARGUMENT, (
                "lwo.torch.optim.AdamW: a param_group's hyperparameters are out of range: lr "
                "%r, betas %r, eps %r, weight_decay %r") % (g["lr"], g["betas"], g["eps"],
                                                            g["weight_decay"]))

    def _torch_optimizer(self, groups):
        fused = self._fused
        ps = [p for g in groups for p in g["params"]]
        if fused is None:
            fused = bool(ps) and all(p.is_cuda and p.is_floating_point() for p in ps)
        return torch.optim.AdamW(groups, fused=fused or None)


class SGD(_Optimizer):
    """torch.optim.SGD whose streamed parameters are updated by lwo's host
    optimizer. lr, momentum, dampening, weight_decay: as torch.optim.SGD,
    except that weight decay is decoupled (p *= 1 - lr * weight_decay, as
    AdamW's; the same as PyTorch's SGD without momentum), for every
    parameter, on the GPU too. nesterov and maximize are not supported;
    state, max_norm, delayed, in_backward, n_threads: as AdamW's."""

    _kind = "sgd"

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, maximize=False, state="f32", max_norm=None, delayed=False,
                 in_backward=False, n_threads=0, seed=0):
        if nesterov or maximize:
            raise ArgumentError(C.LWO_ERR_INVALID_ARGUMENT, "lwo.torch.optim.SGD: %s is not "
                                "supported" % ("nesterov" if nesterov else "maximize"))
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay)
        super().__init__(params, defaults, state=state, max_norm=max_norm, delayed=delayed,
                         in_backward=in_backward, n_threads=n_threads, seed=seed)

    def _check_group(self, g):
        if not (g["lr"] >= 0 and g["momentum"] >= 0 and 0 <= g["dampening"] <= 1
                and g["weight_decay"] >= 0):
            raise ArgumentError(C.LWO_ERR_INVALID_ARGUMENT, (
                "lwo.torch.optim.SGD: a param_group's hyperparameters are out of range: lr %r, "
                "momentum %r, dampening %r, weight_decay %r") % (
                    g["lr"], g["momentum"], g["dampening"], g["weight_decay"]))

    def _torch_optimizer(self, groups):
        gs = [dict(g, weight_decay=0.0) for g in groups]  # decoupled, below
        return torch.optim.SGD(gs)

    def _inner_step(self):
        for g in self._inner.param_groups:
            wd = g["weight_decay"]
            if wd:
                ps = [p for p in g["params"] if p.grad is not None]
                if ps:
                    torch._foreach_mul_(ps, 1 - g["lr"] * wd)
        saved = [g["weight_decay"] for g in self._inner.param_groups]
        for g in self._inner.param_groups:
            g["weight_decay"] = 0.0
        try:
            self._inner.step()
        finally:
            for g, wd in zip(self._inner.param_groups, saved):
                g["weight_decay"] = wd
