"""What the quantized lwo.torch tests share, on the CPU (test_torch_quant.py,
over the host backend) and on the GPU (test_torch_gpu.py): the frozen-base model
with a trainable adapter, a weight quantized and dequantized by liblwo on
the host, and the model's resident reference on those weights. Imported
only by test files that have found torch."""

import copy

import pytest
import torch

import lwo

nn = torch.nn


def dequantized(w, fmt):
    """w quantized and dequantized by liblwo on the host, as a CPU tensor."""
    np = pytest.importorskip("numpy")
    d = lwo.quantize(w.detach().cpu().contiguous(), fmt).dequantize()
    t = torch.from_numpy(d.view(np.int16) if w.dtype == torch.bfloat16 else d)
    return t.view(w.dtype)


class Adapted(nn.Module):
    """A frozen base (two linears) with a trainable low-rank adapter beside
    the second, and a trainable head."""

    def __init__(self, dtype, d_in=256, d_hidden=384, rank=8, d_out=128, d_head=16):
        super().__init__()
        self.base0 = nn.Linear(d_in, d_hidden)
        self.base1 = nn.Linear(d_hidden, d_out, bias=False)
        self.lora_a = nn.Linear(d_hidden, rank, bias=False)
        self.lora_b = nn.Linear(rank, d_out, bias=False)
        self.head = nn.Linear(d_out, d_head)
        for p in list(self.base0.parameters()) + list(self.base1.parameters()):
            p.requires_grad_(False)
        self.to(dtype)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.base0(x))
        return self.head(torch.tanh(self.base1(h) + self.lora_b(self.lora_a(h))))


def resident_reference(m, fmt, dequant=None):
    """A copy of m whose frozen base (base0, base1) holds its weights
    dequantized, as lwo computes with them (dequant: how a weight is
    quantized and dequantized; default `dequantized`)."""
    dequant = dequant or dequantized
    ref = copy.deepcopy(m)
    with torch.no_grad():
        for name in ("base0", "base1"):
            w = getattr(ref, name).weight
            w.copy_(dequant(w, fmt))
    return ref


class ConvAdapted(nn.Module):
    """A frozen base of two 3x3 convolutions (quantized as [out, in * 9]:
    144 and 288 columns) and a trainable 1x1 head."""

    def __init__(self, dtype):
        super().__init__()
        self.base0 = nn.Conv2d(16, 32, 3, padding=1)
        self.base1 = nn.Conv2d(32, 32, 3, padding=1, bias=False)
        self.head = nn.Conv2d(32, 8, 1)
        for p in list(self.base0.parameters()) + list(self.base1.parameters()):
            p.requires_grad_(False)
        self.to(dtype)

    def forward(self, x):
        return self.head(torch.tanh(self.base1(torch.nn.functional.gelu(self.base0(x)))))


def dequantized_conv(w, fmt):
    """A conv weight quantized as lwo does ([out, in / groups * kh * kw]) and
    dequantized, in its own shape."""
    return dequantized(w.detach().reshape(w.shape[0], -1), fmt).view(w.shape)


def conv_resident_reference(m, fmt):
    return resident_reference(m, fmt, dequantized_conv)


class Chain(nn.Module):
    """Two trainable linears (the first with a bias) whose weights stream
    in fp8-block, and a third that stays dense (int8 does not train)."""

    def __init__(self, dtype):
        super().__init__()
        self.a = nn.Linear(256, 384)
        self.b = nn.Linear(384, 128, bias=False)
        self.to(dtype)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def straight_through(model, fmt, dtype, masters=None):
    """Forward of the reference: each weight W computes as its
    quantization dequantized (in the layer's dtype), its gradient goes to
    W itself, as lwo computes from the record and sends dW to the
    master. masters: {name: f32 tensor} quantized in place of the weights
    (lwo's f32 masters, which a bf16 W only rounds)."""
    masters = masters or {}

    def q(name, w):
        return dequantized(masters.get(name, w.detach().float()), fmt).to(w.device, dtype)

    def fwd(x):
        wa = model.a.weight
        qa = q("a.weight", wa)
        h = torch.tanh(nn.functional.linear(x, wa + (qa - wa).detach(), model.a.bias))
        wb = model.b.weight
        qb = q("b.weight", wb)
        return nn.functional.linear(h, wb + (qb - wb).detach())
    return fwd


def lwo_masters(opt, model):
    """lwo.torch.optim's f32 masters of model's parameters, by name."""
    sd = opt.state_dict()
    idx = {id(p): i for i, p in enumerate(model.parameters())}
    return {k: sd["state"][idx[id(p)]]["master"] for k, p in model.named_parameters()}


def train_fp8_with_lwo_adamw(offload, dtype, dev, close):
    """Chain's weights streamed in fp8-block (offload(model) -> handle, with
    quant_trainable) and trained by lwo.torch.optim.AdamW, against PyTorch's
    AdamW on f32 masters: each step's output equals the layers computed
    from lwo's masters' quantization, the masters follow PyTorch's, and
    the model's state_dict(), sync_params() and close() give the parameters
    the masters' values.
    dev: where the model and the inputs live; close(a, b, dtype, what)."""
    from lwo.torch import optim as lopt
    torch.manual_seed(12)
    m = Chain(dtype).to(dev)
    ref = copy.deepcopy(m).float()  # f32 masters, updated by PyTorch's AdamW
    h = offload(m)
    opt = lopt.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    # lwo's masters start from the parameters (not from their quantization)
    for k, v in lwo_masters(opt, m).items():
        assert torch.equal(v, dict(ref.named_parameters())[k].detach().cpu()), k
    for step in range(4):
        # the layer computes in its dtype from lwo's masters' quantization
        cur = copy.deepcopy(ref).to(dtype)
        masters = lwo_masters(opt, m)
        with torch.no_grad():
            for k, v in masters.items():
                dict(cur.named_parameters())[k].copy_(v)
        x = torch.randn(8, 256, dtype=dtype, device=dev)
        ya = m(x)
        yb = straight_through(cur, "fp8-block", dtype, masters)(x)
        close(ya, yb, dtype, "step %d output" % step)
        g = torch.randn_like(ya)
        ya.backward(g)
        yb.backward(g)
        for p, q in zip(cur.parameters(), ref.parameters()):
            q.grad = p.grad.float()
        opt.step()
        opt_r.step()
        opt.zero_grad()
        opt_r.zero_grad()
    # the masters against PyTorch's AdamW on the same gradients
    for k, v in lwo_masters(opt, m).items():
        close(v, dict(ref.named_parameters())[k].cpu(), dtype, "master of %s" % k)
    final = lwo_masters(opt, m)  # (opt.state_dict() syncs the parameters)
    for k, p in m.named_parameters():
        assert torch.equal(p.cpu(), final[k].to(dtype)), k

    def one_step():
        x = torch.randn(4, 256, dtype=dtype, device=dev)
        m(x).backward(torch.randn(4, 128, dtype=dtype, device=dev))
        opt.step()
        opt.zero_grad()
        opt.synchronize()
    one_step()  # the parameters lag the masters until synced
    assert torch.equal(m.a.weight.cpu(), final["a.weight"].to(dtype))
    # the model's state_dict syncs them first (copies: it shares the
    # parameters' storage, which lwo_masters' state_dict() syncs again)
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    final = lwo_masters(opt, m)
    for k in final:
        assert torch.equal(sd[k].cpu(), final[k].to(dtype)), k
    one_step()
    opt.sync_params()  # and sync_params()
    got = {k: p.detach().clone() for k, p in m.named_parameters()}
    final = lwo_masters(opt, m)
    for k in final:
        assert torch.equal(got[k].cpu(), final[k].to(dtype)), k
    h.close()
    for k, p in m.named_parameters():  # close() gives back the masters' values too
        assert torch.equal(p.cpu(), final[k].to(dtype)), k
