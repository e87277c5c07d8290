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
