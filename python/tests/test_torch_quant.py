"""lwo.torch's quant= option without a GPU, over the real library on
its host backend (host_lwo: quantized records laid out and written by the
library, dequantized by its CPU compute): which linears are
quantized and why the others are not, the records and their bytes, outputs,
dx and the trainable adapter's gradients against the same model resident in
PyTorch with the dequantized weights, re-quantization after an in-place
write, and the refusal of a gradient for a quantized weight. Skipped
without torch or numpy."""

import copy

import pytest

try:
    import torch
except ImportError as e:  # not installed, or not importable here
    pytest.skip("torch is not importable: %s" % e, allow_module_level=True)
np = pytest.importorskip("numpy")
nn = torch.nn

import lwo  # noqa: E402
import lwo.torch as lt  # noqa: E402

import host_lwo  # noqa: E402
from torch_quant_models import (Adapted, Chain, ConvAdapted,  # noqa: E402
                                conv_resident_reference, dequantized, dequantized_conv,
                                resident_reference, straight_through,
                                train_fp8_with_lwo_adamw)

# The host backend computes products in f32 rounded once to the layer's dtype, as the
# reference does on the same (dequantized) weights: only the order of the sums
# differs. Relative error ||a - b|| / ||b||.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def offload(model, **kw):
    be = host_lwo.Backend()
    return lt.offload(model, _backend=be, **kw), be


def close(a, b, dtype, what=""):
    a, b = a.detach().float(), b.detach().float()
    assert a.shape == b.shape, what
    err = (a - b).norm().item() / max(b.norm().item(), 1e-6)
    assert err <= TOL[dtype], "%s: relative error %g > %g" % (what, err, TOL[dtype])


def forward_backward(m, ref, x, dtype, out_what, dx_what):
    """x through m and through ref, then one output gradient back through both:
    the outputs and the input gradients compared."""
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = m(xa), ref(xb)
    close(ya, yb, dtype, out_what)
    g = torch.randn_like(yb)
    ya.backward(g)
    yb.backward(g)
    close(xa.grad, xb.grad, dtype, dx_what)


@pytest.mark.parametrize("fmt", ["fp8", "fp8-block", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_base_quantized_adapter_trained(fmt, dtype):
    torch.manual_seed(1)
    m = Adapted(dtype)
    ref = resident_reference(m, fmt)
    h, be = offload(m, quant=fmt)
    assert h.quantized == {"base0": fmt, "base1": fmt}
    assert set(h.quant_skipped) == {"lora_a", "lora_b", "head"}
    assert all("trainable" in why for why in h.quant_skipped.values())
    # the parameters are the dequantized weights lwo computes with, frozen
    for name in ("base0", "base1"):
        w, wr = getattr(m, name).weight, getattr(ref, name).weight
        assert w.device.type == "cpu" and not w.requires_grad and w.dtype == dtype
        assert torch.equal(w.view(torch.uint8) if dtype == torch.float32 else w.view(torch.int16),
                           wr.view(torch.uint8) if dtype == torch.float32 else
                           wr.view(torch.int16)), name
    # the records hold the quantized bytes; only the trainable ones get gradients
    pool = be.pools[0]
    for rec in h.records:
        if rec.quantized:
            info = pool.tensors(rec.index)[0]
            assert info.quant == fmt
            assert info.bytes == lwo.quant_layout(fmt, info.shape, info.dtype).total_bytes
            assert rec.saved_bytes == info.dense_bytes - info.bytes > 0
    assert h.stats()["quant"]["saved_bytes"] == sum(r.saved_bytes for r in h.records) > 0
    assert be.grads_sets[0].mask == [not r.quantized for r in h.records]

    params = [p for p in m.parameters() if p.requires_grad]
    params_r = [p for p in ref.parameters() if p.requires_grad]
    assert len(params) == len(params_r) == 4
    opt, opt_r = torch.optim.SGD(params, lr=0.05), torch.optim.SGD(params_r, lr=0.05)
    for step in range(3):
        forward_backward(m, ref, torch.randn(6, 256, dtype=dtype), dtype, "step %d output" % step,
                         "step %d dx (through the quantized weights)" % step)
        for (k, p), q in zip([(k, p) for k, p in m.named_parameters() if p.requires_grad],
                             params_r):
            assert p.grad is not None, k
            close(p.grad, q.grad, dtype, "step %d grad of %s" % (step, k))
        for name in ("base0", "base1"):
            assert getattr(m, name).weight.grad is None
        opt.step(); opt_r.step(); opt.zero_grad(); opt_r.zero_grad()
    assert be.calls["dequantize"] >= 3 * 2 * 2  # forward and dx of both base layers


def test_an_inplace_write_quantizes_again():
    torch.manual_seed(2)
    m = Adapted(torch.float32)
    ref = resident_reference(m, "int8")
    h, be = offload(m, quant="int8")
    x = torch.randn(4, 256)
    with torch.no_grad():
        close(m(x), ref(x), torch.float32, "before the write")
        new = torch.randn(384, 256) * 0.05
        m.base0.weight.copy_(new)  # noticed through the version counter
        ref.base0.weight.copy_(dequantized(new, "int8"))
        writes = be.calls["write_quantized"]
        close(m(x), ref(x), torch.float32, "after the write")
        assert be.calls["write_quantized"] == writes + 1


def test_which_modules_are_quantized():
    m = nn.Sequential(nn.Linear(200, 256), nn.ReLU(), nn.Linear(256, 128),
                      nn.Conv2d(3, 4, 3), nn.Linear(128, 8))
    for p in m.parameters():
        p.requires_grad_(False)
    m[4].bias.requires_grad_(True)  # a trainable bias keeps its linear dense
    h, be = offload(m, quant="int4")
    assert h.quantized == {"2": "int4"}
    assert "128" in h.quant_skipped["0"]  # int4 takes in_features multiples of 128
    assert "128" in h.quant_skipped["3"]  # a conv is quantized as [out, in * kh * kw]: 27
    assert "trainable" in h.quant_skipped["4"]
    # a function chooses per module
    m2 = nn.Sequential(nn.Linear(128, 256), nn.Linear(256, 128)).requires_grad_(False)
    h2, _ = offload(m2, quant=lambda name, mod: "fp8-block" if name == "1" else None)
    assert h2.quantized == {"1": "fp8-block"} and h2.quant_skipped == {}
    with pytest.raises(ValueError, match="unknown quantized format"):
        offload(nn.Sequential(nn.Linear(128, 8)), quant="fp4")


def test_a_group_keeps_its_quantized_modules_in_a_record_apart():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.base = nn.Linear(128, 128).requires_grad_(False)
            self.adapter = nn.Linear(128, 128, bias=False)

        def forward(self, x):
            return self.base(x) + self.adapter(x)

    torch.manual_seed(3)
    m = nn.Sequential(Block(), Block())
    ref = copy.deepcopy(m)
    with torch.no_grad():
        for b in ref:
            b.base.weight.copy_(dequantized(b.base.weight, "fp8"))
    h, be = offload(m, group=["0", "1"], quant="fp8")
    assert h.record_names() == [["0.base"], ["0.adapter"], ["1.base"], ["1.adapter"]]
    assert [r.name for r in h.records] == ["0 [fp8]", "0", "1 [fp8]", "1"]
    x = torch.randn(5, 128)
    m(x).square().sum().backward()
    ref(x).square().sum().backward()
    for b, br in zip(m, ref):
        close(b.adapter.weight.grad, br.adapter.weight.grad, torch.float32, "adapter grad")
        assert b.base.weight.grad is None and b.base.bias.grad is None


def test_a_gradient_for_a_quantized_weight_is_refused():
    m = nn.Sequential(nn.Linear(128, 64), nn.Linear(64, 8)).requires_grad_(False)
    h, be = offload(m, quant="fp8")
    x = torch.randn(3, 128)
    m[0].weight.requires_grad_(True)
    with pytest.raises(lwo.ArgumentError) as e:
        m(x)
    assert e.value.status == lwo.LWO_ERR_QUANTIZED_WEIGHT
    assert "'0'" in e.value.message and "fp8" in e.value.message
    m[0].weight.requires_grad_(False)
    with torch.no_grad():  # the handle stays usable
        y = m(x)
    assert y.shape == (3, 8)


def test_close_gives_back_the_dequantized_weights():
    torch.manual_seed(4)
    m = nn.Sequential(nn.Linear(128, 64)).requires_grad_(False)
    want = dequantized(m[0].weight, "fp8-block")
    h, be = offload(m, quant="fp8-block")
    h.close()
    assert type(m[0]) is nn.Linear
    assert torch.equal(m[0].weight, want)


@pytest.mark.parametrize("fmt", ["fp8", "fp8-block", "int8"])
def test_a_frozen_conv_base_streams_quantized(fmt):
    torch.manual_seed(5)
    m = ConvAdapted(torch.float32)
    ref = conv_resident_reference(m, fmt)
    h, be = offload(m, quant=fmt)
    assert h.quantized == {"base0": fmt, "base1": fmt} and "head" in h.quant_skipped
    # the parameter is the dequantized weight in the conv's own shape
    assert m.base0.weight.shape == (32, 16, 3, 3)
    assert torch.equal(m.base0.weight, dequantized_conv(ref.base0.weight, fmt))
    opt = torch.optim.SGD(m.head.parameters(), lr=0.05)
    opt_r = torch.optim.SGD(ref.head.parameters(), lr=0.05)
    for step in range(3):
        forward_backward(m, ref, torch.randn(2, 16, 6, 6), torch.float32, "output, step %d" % step,
                         "dx, step %d" % step)
        close(m.head.weight.grad, ref.head.weight.grad, torch.float32, "head grad")
        opt.step()
        opt_r.step()
        opt.zero_grad()
        opt_r.zero_grad()
    assert be.calls["dequantize"] > 0
    # a quantized conv cannot become trainable
    m.base0.weight.requires_grad_(True)
    with pytest.raises(lwo.ArgumentError, match="conv 'base0' streams its weight quantized"):
        m(torch.randn(1, 16, 4, 4))


# ---- trainable weights streamed quantized (quant_trainable=True) ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trainable_fp8_block_weights_with_a_torch_optimizer(dtype):
    torch.manual_seed(11)
    m = Chain(dtype)
    ref = copy.deepcopy(m)
    h, be = offload(m, quant="fp8-block", quant_trainable=True)
    assert h.quantized == {"a": "fp8-block", "b": "fp8-block"}
    assert all(r.quantized and r.trainable for r in h.records)
    # the parameter keeps the weight's own values: the master
    for name in ("a", "b"):
        w, wr = getattr(m, name).weight, getattr(ref, name).weight
        assert w.requires_grad and w.device.type == "cpu" and torch.equal(w, wr), name
    fwd = straight_through(ref, "fp8-block", dtype)
    opt = torch.optim.SGD([p for p in m.parameters()], lr=0.1)
    writes = be.calls["write_quantized"]
    for step in range(3):
        # the reference from the parameters as they are (a code can flip
        # where two updates differ in their last bit, so it takes lwo's)
        with torch.no_grad():
            for p, q in zip(m.parameters(), ref.parameters()):
                q.copy_(p)
        forward_backward(m, fwd, torch.randn(8, 256, dtype=dtype), dtype,
                         "step %d output (from the updated weights' quantization)" % step,
                         "step %d dx" % step)
        for (k, p), (_k, q) in zip(m.named_parameters(), ref.named_parameters()):
            assert p.grad is not None and p.grad.dtype == dtype, k
            close(p.grad, q.grad, dtype, "step %d grad of %s" % (step, k))
            q.grad = None
        opt.step()
        opt.zero_grad()
    # each step's update quantized each weight again before its next stage
    assert be.calls["write_quantized"] >= writes + 2 * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trainable_fp8_block_weights_with_lwo_adamw(dtype):
    train_fp8_with_lwo_adamw(lambda m: offload(m, quant="fp8-block", quant_trainable=True)[0],
                             dtype, torch.device("cpu"), close)


def test_the_parameters_are_synced_once_per_step():
    """The model's state_dict() syncs every quantized weight's parameter
    from its master once after a step, not once per streamed module."""
    from lwo.torch import optim as lopt
    torch.manual_seed(13)
    m = Chain(torch.float32)
    offload(m, quant="fp8-block", quant_trainable=True)
    opt = lopt.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(4, 256)).sum().backward()
    opt.step()
    (b,) = opt._bindings.values()
    reads = []
    real = b.lwo.read
    b.lwo.read = lambda *a: (reads.append(a[:3]), real(*a))[1]
    m.state_dict()
    assert sorted(r[2] for r in reads) == ["master", "master"]  # a.weight, b.weight
    m.state_dict()
    opt.sync_params()
    assert len(reads) == 2  # nothing moved since
    m(torch.randn(4, 256)).sum().backward()
    opt.step()
    m.state_dict()
    assert len(reads) == 4


def test_quant_trainable_refusals_and_formats_that_do_not_train():
    with pytest.raises(ValueError, match="quant_trainable=True needs quant="):
        offload(Chain(torch.float32), quant_trainable=True)
    m = Chain(torch.float32)
    h, be = offload(m, quant="int8", quant_trainable=True)
    assert h.quantized == {}
    assert all("int8 does not train" in why for why in h.quant_skipped.values())
    m2 = Chain(torch.float32)
    h2, _ = offload(m2, quant="fp8-block")  # without quant_trainable: they stay dense
    assert h2.quantized == {} and all("quant_trainable" in why
                                      for why in h2.quant_skipped.values())
