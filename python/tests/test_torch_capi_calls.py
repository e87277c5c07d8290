"""lwo.torch's C calls without a device: each hot call that the adapter
makes through ctypes (ring stage/acquire/release and capture join/leave/
release, gradient begin/end, linear
and convolution forward/backward, layer changed) is made with a NULL handle,
so that liblwo answers LWO_ERR_INVALID_HANDLE naming the call: the arguments
the adapter passes convert to the declared C types (a wrong one would be a
ctypes.ArgumentError before the call) and a failing status becomes lwo's
exception. Skipped without torch."""

import pytest

try:
    import torch
except ImportError as e:  # not installed, or not importable here
    pytest.skip("torch is not importable: %s" % e, allow_module_level=True)

import lwo  # noqa: E402
import lwo.torch as lt  # noqa: E402
from lwo import _capi as C  # noqa: E402


class Null:
    handle = None
    transfer_stream = None


def invalid_handle(call, fn, *args):
    with pytest.raises(lwo.ArgumentError) as e:
        fn(*args)
    assert e.value.status == lwo.LWO_ERR_INVALID_HANDLE, e.value
    assert e.value.message.startswith(call), e.value.message


def test_ring_calls():
    r = lt._Ring(Null())
    invalid_handle("lwo_ring_stage", r.stage, 3)
    invalid_handle("lwo_ring_acquire", r.acquire, 12345, 0)
    invalid_handle("lwo_ring_acquire", r.acquire, 12345, 0x7f00_0000_1000)
    invalid_handle("lwo_ring_release", r.release, 12345, 0)


def test_ring_capture_calls():
    # joining a CUDA graph capture torch began, leaving it, announcing a
    # replay, giving the ring back
    r = lt._Ring(Null())
    invalid_handle("lwo_ring_capture_join", r.capture_join, 0x7f00_0000_1000)
    invalid_handle("lwo_ring_capture_leave", r.capture_leave, 0x7f00_0000_1000)
    invalid_handle("lwo_ring_capture_replay", r.capture_replay, 0x7f00_0000_1000)
    invalid_handle("lwo_ring_capture_release", r.capture_release, 0)


def test_grads_calls():
    g = lt._Grads(Null())
    invalid_handle("lwo_grads_begin", g.begin, 0, 0)
    invalid_handle("lwo_grads_end", g.end, 0, 0x1000)


def test_optim_calls():
    # lwo.torch.optim's calls, on an address that is no handle
    o = object.__new__(lwo.Optimizer)
    o._handle = 0x1000
    try:
        w = lt._Optim(o)
        invalid_handle("lwo_optim_step_groups", w.step_groups, 1,
                       [{"step": 1, "lr": 1e-3, "beta1": 0.9, "weight_decay": 0.0},
                        {"step": 3, "lr": 1e-4}], 1.0, 2.5)
        invalid_handle("lwo_optim_set_group", w.set_group, 0, "m0.weight", 1)
        invalid_handle("lwo_optim_read", w.read, 0, "m0.weight", "master", torch.empty(4))
        invalid_handle("lwo_optim_write", w.write, 0, "m0.weight", "m", torch.empty(4))
        invalid_handle("lwo_optim_wait", w.wait)
    finally:
        o._handle = None


def test_compute_calls():
    be = lt._Backend(0, engine=Null())
    for dt in (C.LWO_DTYPE_BF16, C.LWO_DTYPE_F32, C.LWO_DTYPE_F16):
        for bias in (False, True):
            d = be.linear_desc(256, 512, dt, bias)
            da = be.linear_desc(256, 512, dt, bias, accumulate=True)
            assert d[0].flags == (C.LWO_LINEAR_BIAS if bias else 0)
            assert da[0].flags & C.LWO_LINEAR_ACCUMULATE
            invalid_handle("lwo_linear_forward", be.linear_forward, d, 16, 0x1000, 0x2000,
                           0x3000 if bias else None, 0x4000, 0)
            # dW and db only (no weight, no dx), then dx only (no x)
            invalid_handle("lwo_linear_backward", be.linear_backward, da, 16, 0x1000, 0x2000,
                           None, None, 0x5000, 0x6000 if bias else None, dt, 0x99)
            invalid_handle("lwo_linear_backward", be.linear_backward, d, 16, None, 0x2000,
                           0x3000, 0x4000, None, None, dt, 0)
    # a quantized weight (offload(quant=...)): forward and dx only
    for fmt in (C.LWO_QUANT_FP8_E4M3_CHANNEL, C.LWO_QUANT_INT4_GROUP128):
        d = be.linear_desc(256, 512, C.LWO_DTYPE_BF16, True, weight_format=fmt)
        assert d[0].weight_format == fmt
        invalid_handle("lwo_linear_forward", be.linear_forward, d, 16, 0x1000, 0x2000,
                       0x3000, 0x4000, 0)
        invalid_handle("lwo_linear_backward", be.linear_backward, d, 16, None, 0x2000,
                       0x3000, 0x4000, None, None, C.LWO_DTYPE_BF16, 0)
    conv = torch.nn.Conv2d(8, 16, 3, stride=2, padding=1, groups=2)
    d = be.conv_desc(conv, C.LWO_DTYPE_BF16, True, (1, 1))
    assert d[0].layout == C.LWO_LAYOUT_NCHW and d[0].groups == 2
    assert be.conv_output_size(d, 15, 16) == (8, 8)  # needs no engine: a real answer
    invalid_handle("lwo_conv2d_forward", be.conv_forward, d, 2, 15, 16, 0x1000, 0x2000,
                   0x3000, 0x4000, 0)
    da = be.conv_desc(conv, C.LWO_DTYPE_BF16, True, (1, 1), accumulate=True)
    assert da[0].flags & C.LWO_CONV_ACCUMULATE
    invalid_handle("lwo_conv2d_backward", be.conv_backward, da, 2, 15, 16, 0x1000, 0x2000,
                   None, None, 0x5000, 0x6000, C.LWO_DTYPE_BF16, 0)
    invalid_handle("lwo_pool_layer_changed", be.layer_changed, Null(), 0)


def test_padding_of_convolutions():
    assert lt._conv_padding(torch.nn.Conv2d(1, 1, 3, padding="same")) == (1, 1)
    assert lt._conv_padding(torch.nn.Conv2d(1, 1, (3, 5), padding="same", dilation=2)) == (2, 4)
    assert lt._conv_padding(torch.nn.Conv2d(1, 1, 2, padding="same")) is None
    assert lt._conv_padding(torch.nn.Conv2d(1, 1, 3, padding="valid")) == (0, 0)
    assert lt._conv_padding(torch.nn.Conv2d(1, 1, 3, padding=(2, 1))) == (2, 1)


def test_checkpoint_pool_call(tmp_path):
    """offload(checkpoint=)'s pool: lwo_pool_create_from_checkpoint with
    names= per record (the checkpoint is real: opening it needs no device)."""
    from conftest import write_safetensors

    class NullEngine(Null):
        def _h(self):
            return None

    path = write_safetensors(tmp_path / "m.safetensors",
                             [("a.weight", "BF16", [2, 2], b"\0" * 8),
                              ("a.bias", "BF16", [2], b"\0" * 4)])
    be = lt._Backend(0, engine=NullEngine())
    with lwo.Checkpoint(path) as ck:
        invalid_handle("lwo_pool_create_from_checkpoint", be.pool_from_checkpoint, ck,
                       [["a.weight", "a.bias"]])
