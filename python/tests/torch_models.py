"""Small models the lwo.torch tests share, on the CPU (test_torch_adapter.py,
test_torch_compile.py) and on the GPU (test_torch_gpu.py): blocks under
activation checkpointing, and a base for LoRA adapters with peft. Imported
only by test files that have found torch."""

import copy

import torch
from torch.utils.checkpoint import checkpoint

nn = torch.nn


class CheckpointedBlocks(nn.Module):
    """`n` residual blocks (linear, `act`, linear; `width` to `hidden` and
    back), each run under torch.utils.checkpoint."""

    def __init__(self, width, hidden, n, act, reentrant=False):
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(width, hidden), act(),
                                                   nn.Linear(hidden, width)) for _ in range(n)])

    def forward(self, x):
        for b in self.blocks:
            x = x + checkpoint(b, x, use_reentrant=self.reentrant)
        return x


class QV(nn.Module):
    """Two linears "q" and "v" of `width` (LoRA's targets), a gate of one on
    the other, and a linear "out" to `d_out`."""

    def __init__(self, width, d_out):
        super().__init__()
        self.q = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.out = nn.Linear(width, d_out)

    def forward(self, x):
        return self.out(torch.tanh(self.q(x)) * self.v(x))


def lora_twins(peft, base, r):
    """Two copies of `base`, each with the same LoRA adapters of rank `r`
    (alpha 2r) on q and v: (the one to stream, its resident reference)."""
    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q", "v"], lora_dropout=0.0,
                          init_lora_weights=False)
    m = peft.get_peft_model(copy.deepcopy(base), cfg)
    ref = peft.get_peft_model(copy.deepcopy(base), cfg)
    ref.load_state_dict(m.state_dict())
    return m, ref
