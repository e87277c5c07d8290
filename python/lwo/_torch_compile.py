"""lwo.torch under torch.compile: a streamed module's forward as custom
operators that Dynamo records in its graph, instead of a graph break.

Four operators (torch.library.custom_op), registered once per process by
the first offload():

    lwo::linear(x, weight, bias, key, grad, out_features) -> y
    lwo::linear_backward(dy, x, key, x_shape, need_dx, need_dw) -> dx
    lwo::conv2d(x, weight, bias, key, stride, padding, dilation, grad, kernel) -> y
    lwo::conv2d_backward(dy, x, key, x_shape, need_dx, need_dw) -> dx

Each runs the adapter's own per-call code (Offload._linear_forward and the
rest: the prefetch planner's observation, a step's start, the ring's stage,
acquire and release, lwo's compute, the gradient slots and the fence queued
at the end of the backward pass), so a compiled step does what an eager one
does, call for call.

- ``key`` names the streamed module: a CPU int64 scalar tensor holding an id
  that the registry here (_live) maps to the module's state while its handle
  is open. It is a tensor, not an int, so that Dynamo takes it as a graph input
  rather than a constant: a block compiled once (regional compilation) serves
  every block of its kind. An id is never reused; one whose handle was
  closed is an error that names the call and the id.
- ``weight`` and ``bias`` are the module's parameters: the operators never
  read them (lwo's weights travel through its ring), they are inputs so that
  autograd knows the output depends on them. The backward returns None for them: their
  gradients reach ``param.grad`` through lwo's gradient path and its fence,
  as in eager mode.
- ``grad`` says whether this call has a backward (Dynamo decides it while
  tracing, from the grad mode and requires_grad, and guards on them).
- ``out_features`` (linear) and ``kernel`` (conv2d: [out_channels, kh, kw])
  give the fake (tracing) implementations the output's shape: the
  parameters' shapes do not (a parameter split over ranks is flat).
- Every operator is registered with an ordered effect
  (torch._library.effects.EffectType.ORDERED): AOTAutograd threads one token
  through them, so that no pass removes one whose output is unused (a
  backward that sends only dW), merges two alike (one module called twice
  on the same input), moves one past another or recomputes one in the
  backward. They are tagged cudagraph_unsafe: their host work must run at
  every call, which a replayed CUDA graph would not do.
"""

import itertools
import threading
import weakref
from typing import List, Optional

import torch

from . import _capi as C
from ._errors import StateError

_ids = itertools.count(1)
_live = {}         # id -> weakref to the streamed module's state (lwo.torch._Module)
_ops = None        # (linear, conv2d) OpOverloads once registered
_why_not = None    # why the operators could not be registered (then: graph breaks)
_register_lock = threading.Lock()  # offload() in several threads (ranks) at once
# Inductor partitions its CUDA graphs around these (an operator's host work
# must run at every call); its tag check misses operators with effects.
_PARTITION_AROUND = ("lwo::linear", "lwo::linear_backward", "lwo::conv2d",
                     "lwo::conv2d_backward")


def add(s):
    """Gives a streamed module's state `s` its id and key."""
    uid = next(_ids)
    s.uid = uid
    s.key = torch.tensor(uid, dtype=torch.int64)
    _live[uid] = weakref.ref(s, lambda _r, uid=uid: _live.pop(uid, None))


def remove(s):
    """The module's handle is closing: its id is stale from here on."""
    _live.pop(getattr(s, "uid", None), None)


def _state(key, call):
    uid = key.item()
    ref = _live.get(uid)
    s = ref() if ref is not None else None
    if s is None or s.handle.closed:
        raise StateError(C.LWO_ERR_INVALID_HANDLE,
                         "lwo.torch: %s: module id %d is not a module of an open "
                         "lwo.torch.offload handle (its handle was closed, or the id is "
                         "not one offload() gave)" % (call, uid))
    m = s.module
    if m._parameters.get("weight") is not s.weight or (
            s.bias is not None and m._parameters.get("bias") is not s.bias):
        raise RuntimeError(
            "lwo.torch: %s: the weight or bias of streamed module %r was replaced after "
            "offload(); write into it in place (copy_, load_state_dict) or close the "
            "handle and offload again" % (call, s.name))
    return s


def available():
    """True once the operators are registered (register() succeeded)."""
    return _ops is not None


def register():
    """Registers the operators (once per process; later calls return at
    once). Where this torch lacks what they need (torch.library.custom_op
    with register_fake, register_autograd and ordered effects), nothing is
    registered and the streamed modules break the graph as before
    (``why_not()`` says why)."""
    global _ops, _why_not
    if _ops is not None or _why_not is not None:
        return
    with _register_lock:
        if _ops is not None or _why_not is not None:
            return  # registered by another thread meanwhile
        try:
            _ops = _define()
            _partition_around()
        except (AttributeError, ImportError, TypeError, ValueError, RuntimeError) as e:
            # (RuntimeError: the names taken already, by another copy of lwo.torch)
            _why_not = "%s: %s" % (type(e).__name__, e)


def why_not():
    return _why_not


def _partition_around():
    """Names the operators in inductor's custom_should_partition_ops (where
    this torch has it), so that mode="reduce-overhead" captures the graph
    around them, never them."""
    try:
        from torch._inductor import config
    except ImportError:  # pragma: no cover - a torch without inductor
        return
    names = getattr(config, "custom_should_partition_ops", None)
    if isinstance(names, list):
        names.extend(n for n in _PARTITION_AROUND if n not in names)


def _define():
    from torch._library.effects import EffectType
    from torch._library.custom_ops import CustomOpDef
    custom_op = torch.library.custom_op
    if not hasattr(CustomOpDef, "register_effect"):
        raise AttributeError("torch %s: torch.library.custom_op has no register_effect"
                             % torch.__version__)
    tags = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
    T = torch.Tensor

    def linear(x: T, weight: T, bias: Optional[T], key: T, grad: bool, out_features: int) -> T:
        s = _state(key, "lwo::linear")
        if grad:
            s.handle._dw_ready(s)
        return s.handle._linear_forward(s, x, grad)

    def linear_fake(x, weight, bias, key, grad, out_features):
        return x.new_empty(x.shape[:-1] + (out_features,))

    def linear_backward(dy: T, x: Optional[T], key: T, x_shape: List[int], need_dx: bool,
                        need_dw: bool) -> T:
        s = _state(key, "lwo::linear_backward")
        dx = s.handle._linear_backward(s, x, dy, need_dx, need_dw, s.dtype)
        return dy.new_empty(0) if dx is None else dx

    def backward_fake(dy, x, key, x_shape, need_dx, need_dw):
        return dy.new_empty(x_shape if need_dx else (0,))

    def conv2d(x: T, weight: T, bias: Optional[T], key: T, stride: List[int], padding: List[int],
               dilation: List[int], grad: bool, kernel: List[int]) -> T:
        s = _state(key, "lwo::conv2d")
        if grad:
            s.handle._dw_ready(s)
        return s.handle._conv_forward(s, x, grad)

    def conv2d_fake(x, weight, bias, key, stride, padding, dilation, grad, kernel):
        n, _c, h, w = x.shape
        out_c, kh, kw = kernel
        oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
        ow = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
        return x.new_empty((n, out_c, oh, ow))

    def conv2d_backward(dy: T, x: Optional[T], key: T, x_shape: List[int], need_dx: bool,
                        need_dw: bool) -> T:
        s = _state(key, "lwo::conv2d_backward")
        dx = s.handle._conv_backward(s, x, tuple(x_shape), dy, need_dx, need_dw, s.dtype)
        return dy.new_empty(0) if dx is None else dx

    ops = {}
    for name, fn, fake in (("linear", linear, linear_fake),
                           ("linear_backward", linear_backward, backward_fake),
                           ("conv2d", conv2d, conv2d_fake),
                           ("conv2d_backward", conv2d_backward, backward_fake)):
        op = custom_op("lwo::" + name, fn, mutates_args=(), tags=tags)
        op.register_fake(fake)
        op.register_effect(EffectType.ORDERED)
        ops[name] = op
    lin_bwd = torch.ops.lwo.linear_backward.default
    conv_bwd = torch.ops.lwo.conv2d_backward.default

    def setup(ctx, inputs, output):
        x, weight, bias = inputs[0], inputs[1], inputs[2]
        need_dw = weight.requires_grad or (bias is not None and bias.requires_grad)
        ctx.need_dw = need_dw
        ctx.x_shape = list(x.shape)
        ctx.save_for_backward(x if need_dw else None, inputs[3])

    def linear_grad(ctx, dy):
        x, key = ctx.saved_tensors
        need_dx = ctx.needs_input_grad[0]
        dx = lin_bwd(dy, x, key, ctx.x_shape, need_dx, ctx.need_dw)
        return dx if need_dx else None, None, None, None, None, None

    def conv2d_grad(ctx, dy):
        x, key = ctx.saved_tensors
        need_dx = ctx.needs_input_grad[0]
        dx = conv_bwd(dy, x, key, ctx.x_shape, need_dx, ctx.need_dw)
        return (dx if need_dx else None,) + (None,) * 8

    ops["linear"].register_autograd(linear_grad, setup_context=setup)
    ops["conv2d"].register_autograd(conv2d_grad, setup_context=setup)
    return torch.ops.lwo.linear.default, torch.ops.lwo.conv2d.default


# --------------------------------------------------------------------------
# What Dynamo traces of a streamed module's forward (lwo.torch's forward
# takes this path where torch.compiler.is_dynamo_compiling(), which Dynamo
# folds to True while it traces; eager calls never come here).
# --------------------------------------------------------------------------
def _cast(s, x):
    """x in the layer's dtype under autocast (as the eager path does); an
    input of another dtype otherwise is the operator's error."""
    if x.dtype != s.dtype and torch.is_autocast_enabled(x.device.type):
        return x.to(s.dtype)
    return x


def _needs_grad(x, w, b):
    """Whether autograd wants the operator's backward for x, w or b."""
    return torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (
        b is not None and b.requires_grad))


def linear_forward(self, input, fallback):
    s = self._lwo_state
    if _ops is None:
        return fallback(self, input)  # a graph break, as in a torch without the operators
    if not input.shape or input.shape[-1] != s.in_f:
        raise RuntimeError("lwo.torch: linear %r takes %d input features, got shape %s"
                           % (s.name, s.in_f, tuple(input.shape)))
    x = _cast(s, input)
    w, b = self.weight, self.bias
    grad = _needs_grad(x, w, b)
    return _ops[0](x, w, b, s.key, grad, s.out_f)


def conv_forward(self, input, fallback):
    s = self._lwo_state
    if _ops is None:
        return fallback(self, input)
    unbatched = input.dim() == 3
    x = input.unsqueeze(0) if unbatched else input
    if x.dim() != 4 or x.shape[1] != s.in_f:
        raise RuntimeError("lwo.torch: conv2d %r takes [N, %d, H, W] input, got shape %s"
                           % (s.name, s.in_f, tuple(input.shape)))
    x = _cast(s, x)
    w, b = self.weight, self.bias
    grad = _needs_grad(x, w, b)
    m = self
    y = _ops[1](x, w, b, s.key, list(m.stride), list(s.padding), list(m.dilation), grad,
                [s.out_f] + list(m.kernel_size))
    return y.squeeze(0) if unbatched else y
