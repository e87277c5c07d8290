"""lwo.torch without a GPU: the adapter's logic (records, planning, tickets,
gradients and their fence, hooks, checkpointing, LoRA, compile, restore)
over the real library on its host backend (host_lwo: the adapter's own C
calls, host memory for device memory, CPU compute), against the same model
resident in PyTorch; and the messages of a machine without
a device. Skipped when torch is not installed."""

import copy
import os

import pytest

try:
    import torch
except ImportError as e:  # not installed, or not importable here
    pytest.skip("torch is not importable: %s" % e, allow_module_level=True)
nn = torch.nn

import lwo  # noqa: E402
import lwo.torch as lt  # noqa: E402

import host_lwo  # noqa: E402
from torch_models import QV, lora_twins  # noqa: E402

torch.manual_seed(0)


def offload(model, **kw):
    be = host_lwo.Backend()
    return lt.offload(model, _backend=be, **kw), be


def mlp(dtype=torch.float32, bias=True):
    return nn.Sequential(nn.Linear(12, 32, bias=bias), nn.GELU(), nn.Linear(32, 24, bias=bias),
                         nn.Tanh(), nn.Linear(24, 8, bias=bias)).to(dtype)


def params(model):
    return dict(model.named_parameters())


def close(a, b, dtype):
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    a, b = a.float(), b.float()
    assert a.shape == b.shape
    scale = max(b.abs().max().item(), 1e-3)
    err = (a - b).abs().max().item() / scale
    assert err <= tol, "relative error %g > %g" % (err, tol)


def train_steps(model, ref, steps=3, lr=0.05, dtype=torch.float32, inputs=None):
    """Runs the same SGD steps on both; compares outputs, dx and every grad."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    opt_r = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=lr)
    for step in range(steps):
        x = inputs[step] if inputs else torch.randn(5, 12, dtype=dtype)
        xa = x.clone().requires_grad_(True)
        xb = x.clone().requires_grad_(True)
        ya, yb = model(xa), ref(xb)
        close(ya, yb, dtype)
        g = torch.randn_like(ya)
        ya.backward(g)
        yb.backward(g)
        close(xa.grad, xb.grad, dtype)
        pa, pb = params(model), params(ref)
        for k in pb:
            if pb[k].grad is None:
                assert pa[k].grad is None, k
            else:
                assert pa[k].grad is not None, k
                assert pa[k].grad.dtype == pa[k].dtype
                close(pa[k].grad, pb[k].grad, dtype)
        opt.step()
        opt_r.step()
        opt.zero_grad()
        opt_r.zero_grad()


# --------------------------------------------------------------------------
def test_offload_moves_weights_into_the_pool():
    m = mlp()
    h, be = offload(m)
    assert len(h.records) == 3 and len(be.pools) == 1
    w = m[0].weight
    assert isinstance(w, nn.Parameter) and w.device.type == "cpu"
    addr, _n = be.pools[0].tensor_host(0, "m0.weight")
    assert w.data_ptr() == addr  # the parameter is the pool's host bytes
    assert type(m[0]).__name__ == "Linear" and isinstance(m[0], nn.Linear)
    assert lt.handle_of(m) is h and lt.is_offloaded(m)
    assert "3 modules in 3 records" in repr(h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_training_matches_resident(dtype, bias):
    m = mlp(dtype, bias)
    ref = copy.deepcopy(m)
    h, be = offload(m)
    train_steps(m, ref, dtype=dtype)
    # every step copied the changed weights again (no stale hits)
    assert be.changed, "the optimizer's writes were not noticed"
    assert h.stats()["planner"]["mispredictions"] == 0


def test_gradients_land_only_after_the_fence():
    m = mlp()
    h, be = offload(m)
    x = torch.randn(4, 12)
    m(x).sum().backward()
    g = be.grads_sets[0]
    assert g.log[-1] == ("wait",)           # the end-of-backward callback ran the fence
    assert not g.pending and not g.begun
    assert m[0].weight.grad is not None
    assert m[0].weight.grad.data_ptr() == g.tensor(0, "m0.weight")[0]


def test_gradient_accumulation_and_zeroing():
    m = mlp()
    ref = copy.deepcopy(m)
    h, be = offload(m)
    xs = [torch.randn(3, 12) for _ in range(3)]
    for x in xs[:2]:  # two micro-batches, no zero in between
        m(x).sum().backward()
        ref(x).sum().backward()
    for (k, p), q in zip(m.named_parameters(), ref.parameters()):
        close(p.grad, q.grad, torch.float32)
    assert be.grads_sets[0].n_accumulated > 0
    # set_to_none: a new sum
    for mod in (m, ref):
        mod.zero_grad(set_to_none=True)
    m(xs[2]).sum().backward()
    ref(xs[2]).sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        close(p.grad, q.grad, torch.float32)
    # zeroed in place: adds to the zeros
    for mod in (m, ref):
        mod.zero_grad(set_to_none=False)
    m(xs[0]).sum().backward()
    ref(xs[0]).sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        close(p.grad, q.grad, torch.float32)
    # handle.zero_grad
    h.zero_grad()
    assert all(p.grad is None for p in m.parameters())


def test_partly_zeroed_grads():
    m = mlp()
    ref = copy.deepcopy(m)
    h, be = offload(m)
    x = torch.randn(3, 12)
    for mod in (m, ref):
        mod(x).sum().backward()
        mod[0].weight.grad = None  # only this one starts again
    for mod in (m, ref):
        mod(x).sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        close(p.grad, q.grad, torch.float32)


def test_a_zeroed_module_outside_the_next_pass_keeps_grad_none():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.use_b = True

        def forward(self, x):
            x = self.a(x)
            return self.b(x) if self.use_b else x

    m = Two()
    h, be = offload(m)
    x = torch.randn(2, 4)
    m(x).sum().backward()
    m.b.weight.grad = None
    m.b.bias.grad = None
    m.use_b = False
    m(x).sum().backward()
    assert m.b.weight.grad is None and m.b.bias.grad is None
    assert m.a.weight.grad is not None


def test_frozen_weights_move_host_to_device_only():
    m = mlp()
    for p in m.parameters():
        p.requires_grad_(False)
    ref = copy.deepcopy(m)
    h, be = offload(m)
    assert h.grads is None and not be.grads_sets
    x = torch.randn(4, 12)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    m(xa).sum().backward()
    ref(xb).sum().backward()
    close(xa.grad, xb.grad, torch.float32)
    assert all(p.grad is None for p in m.parameters())
    # input without grad, frozen weights: no autograd at all
    y = m(x)
    assert not y.requires_grad


def test_first_layer_without_dx_needs_no_weights_in_backward():
    m = mlp()
    h, be = offload(m)
    x = torch.randn(2, 12)  # no grad: layer 0 computes dW only
    m(x).sum().backward()
    ring = be.rings[0]
    # the backward pass acquired records 2 and 1 for dx, not record 0
    log = ring.log
    last_fwd = max(i for i, e in enumerate(log) if e == ("acquire", 2))
    acquired_after = [e[1] for e in log[last_fwd + 1:] if e[0] == "acquire"]
    assert 0 not in acquired_after


def test_requires_grad_turned_on_after_offload():
    m = mlp()
    for p in m.parameters():
        p.requires_grad_(False)
    ref = copy.deepcopy(m)
    h, be = offload(m)
    for mod in (m, ref):
        mod[2].weight.requires_grad_(True)
    x = torch.randn(3, 12)
    m(x).sum().backward()
    ref(x).sum().backward()
    close(m[2].weight.grad, ref[2].weight.grad, torch.float32)
    assert m[2].bias.grad is None and m[0].weight.grad is None


def test_groups_by_prefix_and_by_function():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 16)
            self.b = nn.Linear(16, 16, bias=False)

        def forward(self, x):
            return self.b(torch.relu(self.a(x))) + x

    def model():
        return nn.Sequential(*[Block() for _ in range(3)])

    m = model()
    ref = copy.deepcopy(m)
    h, be = offload(m, group=["0", "1", "2"])
    assert h.record_names() == [["0.a", "0.b"], ["1.a", "1.b"], ["2.a", "2.b"]]
    inputs = [torch.randn(4, 16) for _ in range(3)]

    def steps(mm, rr):
        opt = torch.optim.SGD(mm.parameters(), lr=0.01)
        opt_r = torch.optim.SGD(rr.parameters(), lr=0.01)
        for x in inputs:
            xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
            ya, yb = mm(xa), rr(xb)
            close(ya, yb, torch.float32)
            ya.square().mean().backward()
            yb.square().mean().backward()
            close(xa.grad, xb.grad, torch.float32)
            for p, q in zip(mm.parameters(), rr.parameters()):
                close(p.grad, q.grad, torch.float32)
            opt.step(); opt_r.step(); opt.zero_grad(); opt_r.zero_grad()

    steps(m, ref)
    # one gradient transfer per record per step (a span covers both modules)
    assert be.grads_sets[0].n_transfers == 3 * 3
    m2 = model()
    ref2 = copy.deepcopy(m2)
    h2, be2 = offload(m2, group=lambda name, mod: name.split(".")[0])
    assert len(h2.records) == 3
    steps(m2, ref2)


def test_group_member_without_backward_gets_no_grad():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(6, 6)
            self.b = nn.Linear(6, 6)

        def forward(self, x):
            self.b(x)  # output unused: no backward
            return self.a(x)

    m = Two()
    ref = copy.deepcopy(m)
    h, be = offload(m, group=lambda n, mod: "all")
    x = torch.randn(2, 6)
    m(x).sum().backward()
    ref(x).sum().backward()
    assert m.b.weight.grad is None and ref.b.weight.grad is None
    close(m.a.weight.grad, ref.a.weight.grad, torch.float32)


def test_a_module_called_twice_sums_its_gradients():
    lin = nn.Linear(8, 8)
    m = nn.Sequential(lin, nn.Tanh(), lin)
    ref = copy.deepcopy(m)
    h, be = offload(m)
    assert len(h.records) == 1
    train_steps_shared(m, ref)


def train_steps_shared(m, ref):
    for _ in range(3):
        x = torch.randn(3, 8)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        close(m(xa), ref(xb), torch.float32)
        m(xa).sum().backward()
        ref(xb).sum().backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            close(p.grad, q.grad, torch.float32)
        close(xa.grad, xb.grad, torch.float32)
        for mod in (m, ref):
            with torch.no_grad():
                for p in mod.parameters():
                    p -= 0.1 * p.grad
            mod.zero_grad()


class Switch(nn.Module):
    """Runs its layers in order, or in reverse once .reverse is set."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(10, 10) for _ in range(4)])
        self.reverse = False

    def forward(self, x):
        order = reversed(self.layers) if self.reverse else self.layers
        for layer in order:
            x = torch.tanh(layer(x))
        return x


def test_a_changed_module_order_is_replanned():
    m = Switch()
    ref = copy.deepcopy(m)
    h, be = offload(m, depth=3)
    for step in range(6):
        if step == 2:
            m.reverse = ref.reverse = True
        x = torch.randn(3, 10)
        ya, yb = m(x), ref(x)
        close(ya, yb, torch.float32)
        ya.sum().backward()
        yb.sum().backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            close(p.grad, q.grad, torch.float32)
        m.zero_grad(); ref.zero_grad()
    st = h.stats()["planner"]
    assert st["replans"] == 1
    assert h.plan() == [3, 2, 1, 0, 0, 1, 2, 3]
    before = st["mispredictions"]
    m(torch.randn(3, 10)).sum().backward()
    assert h.stats()["planner"]["mispredictions"] == before


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant):
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(8, 16)
            self.down = nn.Linear(16, 8)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(3)])

        def forward(self, x):
            for b in self.blocks:
                x = checkpoint(b, x, use_reentrant=reentrant)
            return x

    m = Net()
    ref = copy.deepcopy(m)
    h, be = offload(m)
    for _ in range(3):
        x = torch.randn(4, 8, requires_grad=True)
        x2 = x.detach().clone().requires_grad_(True)
        ya, yb = m(x), ref(x2)
        close(ya, yb, torch.float32)
        ya.square().sum().backward()
        yb.square().sum().backward()
        close(x.grad, x2.grad, torch.float32)
        for p, q in zip(m.parameters(), ref.parameters()):
            close(p.grad, q.grad, torch.float32)
        m.zero_grad(); ref.zero_grad()
    if not reentrant:
        # the recomputation is part of the plan: fully predicted from step 2 on
        n = h.stats()["planner"]["mispredictions"]
        x = torch.randn(4, 8, requires_grad=True)
        m(x).sum().backward()
        assert h.stats()["planner"]["mispredictions"] == n


def test_hooks_and_wrappers_on_a_streamed_module():
    m = mlp()
    ref = copy.deepcopy(m)
    h, be = offload(m)
    seen = []
    for mod in (m, ref):
        mod[0].register_forward_pre_hook(lambda mod_, args: (args[0] * 2,))
        mod[2].register_forward_hook(lambda mod_, args, out: out + 1)
        mod[4].register_full_backward_hook(lambda mod_, gi, go: seen.append(go[0].shape))

    class Adapter(nn.Module):  # a LoRA-style wrapper calling the base layer's forward
        def __init__(self, base):
            super().__init__()
            self.base = base
            self.a = nn.Linear(base.in_features, 2, bias=False)
            self.b = nn.Linear(2, base.out_features, bias=False)
            nn.init.normal_(self.b.weight)

        def forward(self, x):
            return self.base(x) + self.b(self.a(x))

    wrapped = Adapter(m[4])
    wrapped_ref = Adapter(ref[4])
    wrapped_ref.load_state_dict(wrapped.state_dict())
    m[4], ref[4] = wrapped, wrapped_ref
    train_steps(m, ref)
    assert len(seen) == 6


def test_lora_with_peft_on_a_frozen_base():
    peft = pytest.importorskip("peft")
    m, ref = lora_twins(peft, QV(16, 4), 4)
    h, be = offload(m, filter=lambda name, mod: "lora_" not in name)
    streamed = sorted(h.modules)
    assert all("base_layer" in n or n.endswith("out") for n in streamed), streamed
    assert h.grads is None  # the base is frozen
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    opt_r = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(4):
        x = torch.randn(6, 16)
        ya, yb = m(x), ref(x)
        close(ya, yb, torch.float32)
        ya.square().mean().backward()
        yb.square().mean().backward()
        for (k, p), q in zip(m.named_parameters(), ref.parameters()):
            if q.grad is not None:
                close(p.grad, q.grad, torch.float32)
        opt.step(); opt_r.step(); opt.zero_grad(); opt_r.zero_grad()


def test_conv2d_matches_resident():
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                      nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2, bias=False), nn.ReLU(),
                      nn.Conv2d(8, 4, 1, padding="same"), nn.Flatten(), nn.Linear(4 * 4 * 4, 5))
    ref = copy.deepcopy(m)
    h, be = offload(m)
    assert len(h.records) == 4
    inputs = [torch.randn(2, 3, 8, 8) for _ in range(3)]
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.05)
    for x in inputs:
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ya, yb = m(xa), ref(xb)
        close(ya, yb, torch.float32)
        ya.sum().backward()
        yb.sum().backward()
        close(xa.grad, xb.grad, torch.float32)
        for p, q in zip(m.parameters(), ref.parameters()):
            close(p.grad, q.grad, torch.float32)
        opt.step(); opt_r.step(); opt.zero_grad(); opt_r.zero_grad()
    # unbatched input
    x = torch.randn(3, 8, 8)
    close(m[0](x), ref[0](x), torch.float32)


def test_unsupported_modules_stay_in_pytorch():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 6)
            self.head = nn.Linear(6, 10, bias=False)
            self.head.weight = self.emb.weight       # tied: stays resident
            self.circ = nn.Conv2d(1, 1, 3, padding=1, padding_mode="circular")
            self.odd = nn.Conv2d(1, 1, 2, padding="same")
            self.ok = nn.Linear(6, 6)

        def forward(self, t):
            return self.head(self.ok(self.emb(t)))

    m = Net()
    ref = copy.deepcopy(m)
    h, be = offload(m)
    assert list(h.modules) == ["ok"]
    assert "shared with emb" in h.skipped["head"]
    assert "padding_mode" in h.skipped["circ"]
    assert "symmetrically" in h.skipped["odd"]
    t = torch.tensor([[1, 2, 3]])
    close(m(t), ref(t), torch.float32)
    with pytest.raises(ValueError, match="no nn.Linear"):
        offload(nn.Sequential(nn.ReLU()))


def test_inference_under_no_grad_has_its_own_plan():
    m = mlp()
    ref = copy.deepcopy(m)
    h, be = offload(m)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 12)
            close(m(x), ref(x), torch.float32)
    st = h.stats()["planner"]
    assert st["mispredictions"] == 0 and st["steps"] == 3
    ring = be.rings[0]
    # after the first pass each record is staged ahead of its call: no stage
    # of a record right before its own acquire
    log = ring.log
    late = sum(1 for a, b in zip(log, log[1:]) if a[0] == "stage" and b == ("acquire", a[1]))
    assert late <= 1


def test_compile_matches_resident():
    # (test_torch_compile.py has the rest: the graph, its operators, training)
    m = mlp()
    ref = copy.deepcopy(m)
    h, be = offload(m)
    cm = torch.compile(m, backend="eager")
    x = torch.randn(3, 12, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    ya, yb = cm(x), ref(x2)
    close(ya, yb, torch.float32)
    ya.sum().backward()
    yb.sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        close(p.grad, q.grad, torch.float32)


def test_no_frame_of_lwo_is_traced_under_compile():
    # under torch.compile each streamed module's call runs inside the graph's
    # custom operator, with the frame evaluation off (nothing of lwo.torch
    # below the operator traced); outside it, the same forward runs with no
    # callback to turn off
    cb = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    if cb is None or not hasattr(cb, "get_eval_frame_callback"):
        pytest.skip("this torch has no eval_frame.get_eval_frame_callback")
    m = mlp()
    h, be = offload(m)
    seen = []
    fwd = be.linear_forward

    def lin_fwd(*a):
        seen.append(cb.get_eval_frame_callback())
        return fwd(*a)

    be.linear_forward = h._lin_fwd = lin_fwd
    cm = torch.compile(m, backend="eager")
    x = torch.randn(3, 12)
    for _ in range(2):
        cm(x)
    assert len(seen) == 6 and all(c is None for c in seen), seen
    m(x)
    assert len(seen) == 9 and all(c is None for c in seen)


def test_to_leaves_the_pool_and_state_dict_round_trips():
    m = mlp()
    h, be = offload(m)
    w = m[0].weight
    m.to(torch.float64)     # the rest of the model would change; the pool's tensors do not
    assert m[0].weight is w and w.dtype == torch.float32
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    other = mlp()
    m.load_state_dict(other.state_dict())   # in place: noticed by the version counters
    x = torch.randn(2, 12)
    close(m(x), other(x), torch.float32)
    m.load_state_dict(sd)
    n0 = len(be.changed)
    with torch.no_grad():
        m[2].weight.data.mul_(0)   # behind the version counter ...
    h.mark_changed(m[2])           # ... so declared
    assert len(be.changed) == n0 + 1
    ref = mlp()
    ref.load_state_dict(m.state_dict())
    close(m(x), ref(x), torch.float32)


def test_replacing_a_streamed_weight_is_refused():
    m = mlp()
    h, be = offload(m)
    m[0].weight = nn.Parameter(torch.zeros(32, 12))
    with pytest.raises(RuntimeError, match="replaced after offload"):
        m(torch.randn(1, 12))


def test_input_dtype_and_shape_errors():
    m = mlp()
    h, be = offload(m)
    with pytest.raises(RuntimeError, match="float32 weights but got torch.float64"):
        m(torch.randn(2, 12, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="takes 12 input features"):
        m(torch.randn(2, 11))


def test_close_restores_ordinary_tensors():
    m = mlp()
    ref = copy.deepcopy(m)
    h, be = offload(m)
    w = m[0].weight
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(2, 12)
    m(x).sum().backward()
    h.close(device="cpu")
    assert h.closed and lt.handle_of(m) is None and not lt.is_offloaded(m)
    assert type(m[0]) is nn.Linear and m[0].weight is w   # the same Parameter objects
    ref(x).sum().backward()
    close(w.grad, ref[0].weight.grad, torch.float32)
    opt.step()  # the optimizer still holds them
    close(m(x), m(x), torch.float32)
    h.close()   # twice: nothing


def test_layer_stats():
    m = mlp()
    h, be = offload(m, stats=True)
    m(torch.randn(2, 12)).sum().backward()
    layers = h.layer_stats()
    assert [l["modules"] for l in layers] == [["0"], ["2"], ["4"]]
    assert all(l["accesses"] >= 1 for l in layers)
    assert sum(l["stages"] for l in layers) == h.stats()["ring"]["n_stages"]
    with pytest.raises(ValueError, match="cannot be combined"):
        lt.offload(mlp(), stats=True, timing=True, _backend=host_lwo.Backend())


def test_import_lwo_does_not_import_torch():
    import subprocess
    import sys
    code = ("import sys; import lwo; print('torch' in sys.modules)")
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=os.path.dirname(os.path.dirname(lwo.__file__)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_offload_without_a_gpu_says_why():
    m = mlp()
    with pytest.raises(lwo.Error) as e:
        lt.offload(m)
    assert e.value.status == lwo.LWO_ERR_NO_DEVICE
    assert "lwo_engine_create" in str(e.value)
    with pytest.raises(ValueError, match="not cpu"):
        lt.offload(m, device="cpu")
    # the model is left as it was
    assert not lt.is_offloaded(m) and m[0].weight.device.type == "cpu"


def test_f16_and_autocast():
    m = mlp(torch.float16)
    ref = copy.deepcopy(m)
    h, be = offload(m)
    x = torch.randn(4, 12, dtype=torch.float16)
    close(m(x), ref(x), torch.float16)
    # under autocast an f32 input is cast to the weights' dtype
    mb = mlp(torch.bfloat16)
    refb = copy.deepcopy(mb)
    hb, beb = offload(mb)
    x32 = torch.randn(4, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya = mb(x32)
        yb = refb(x32)
    assert ya.dtype == torch.bfloat16
    close(ya, yb, torch.bfloat16)


def test_timing_and_depths():
    for depth in (1, 2, 4):
        m = mlp()
        ref = copy.deepcopy(m)
        h, be = offload(m, depth=depth, timing=True)
        train_steps(m, ref, steps=2)
        assert be.rings[0].depth == depth
        assert "copy_ms" in h.stats()["ring"]


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("grouped", [False, True])
def test_random_orders_reuse_and_depths(depth, grouped):
    """Every step calls the layers in a new random order, some twice, some
    not at all: results equal the resident model's whatever the plan says."""
    import random
    rnd = random.Random(depth * 10 + grouped)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(6, 6) for _ in range(5)])
            self.order = list(range(5))

        def forward(self, x):
            for i in self.order:
                x = torch.tanh(self.layers[i](x))
            return x

    m = Net()
    ref = copy.deepcopy(m)
    group = (lambda n, mod: int(n.split(".")[1]) % 2) if grouped else None
    h, be = offload(m, depth=depth, group=group)
    for step in range(8):
        order = [rnd.randrange(5) for _ in range(rnd.randrange(2, 8))]
        m.order = ref.order = order
        x = torch.randn(3, 6)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        close(m(xa), ref(xb), torch.float32)
        m(xa).sum().backward()
        ref(xb).sum().backward()
        close(xa.grad, xb.grad, torch.float32)
        for (k, p), q in zip(m.named_parameters(), ref.parameters()):
            if q.grad is None:
                assert p.grad is None, k
            else:
                close(p.grad, q.grad, torch.float32)
        with torch.no_grad():
            for mod in (m, ref):
                for p in mod.parameters():
                    if p.grad is not None:
                        p -= 0.05 * p.grad
        m.zero_grad(); ref.zero_grad()
        assert be.rings[0].live() <= depth


def test_a_transformers_llama_with_lora_on_the_streamed_base():
    try:
        import transformers
        import peft
    except ImportError as e:
        pytest.skip("transformers or peft missing: %s" % e)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=64, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg)
    lcfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    m = peft.get_peft_model(copy.deepcopy(base), lcfg)
    ref = peft.get_peft_model(copy.deepcopy(base), lcfg)
    ref.load_state_dict(m.state_dict())
    h, be = offload(m, filter=lambda n, mod: "lora_" not in n,
                    group=["base_model.model.model.layers.0", "base_model.model.model.layers.1"])
    assert len(h.records) == 3   # two blocks and lm_head
    assert h.grads is None
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    opt_r = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        ids = torch.randint(0, 64, (2, 12), generator=gen)
        la = m(input_ids=ids, labels=ids).loss
        lb = ref(input_ids=ids, labels=ids).loss
        assert abs(la.item() - lb.item()) < 1e-5
        la.backward()
        lb.backward()
        opt.step(); opt_r.step(); opt.zero_grad(); opt_r.zero_grad()
    assert h.stats()["planner"]["replans"] <= 1


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_transformers_llama_trained_whole_with_gradient_checkpointing(reentrant):
    try:
        import transformers
    except ImportError as e:
        pytest.skip("transformers missing: %s" % e)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=64, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg)
    ref = copy.deepcopy(m)
    for mod in (m, ref):
        mod.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        mod.train()
    h, be = offload(m, group=lambda n, mod: n.split(".")[2] if n.startswith("model.layers.")
                    else None)
    assert len(h.records) == 4
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 10), generator=gen)
        la = m(input_ids=ids, labels=ids).loss
        lb = ref(input_ids=ids, labels=ids).loss
        assert abs(la.item() - lb.item()) < 1e-5
        la.backward()
        lb.backward()
        ra = dict(ref.named_parameters())
        for k, p in m.named_parameters():
            if ra[k].grad is None:
                assert p.grad is None, k
            else:
                close(p.grad, ra[k].grad, torch.float32)
        with torch.no_grad():
            for mod in (m, ref):
                for p in mod.parameters():
                    if p.grad is not None:
                        p -= 0.01 * p.grad
        m.zero_grad(); ref.zero_grad()


# --------------------------------------------------------------------------
# The automatic plan (offload(plan=True)): over host_lwo.PlanningBackend
def deep_mlp(dtype=torch.float32):
    layers = []
    for i in range(6):
        layers += [nn.Linear(12, 12), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(12, 8)).to(dtype)


def test_the_plan_is_made_after_a_measured_step_and_training_stays_exact():
    m = deep_mlp()
    ref = copy.deepcopy(m)
    be = host_lwo.PlanningBackend(group_size=3)
    h = lt.offload(m, _backend=be)
    ids = {k: id(p) for k, p in m.named_parameters()}
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(7):
        if step < 3:
            assert len(h.records) == 7 and h.plan_info is None
        x = torch.randn(4, 12)
        ya, yb = m(x), ref(x)
        if step == 3:  # the plan came at this step's first access
            assert len(be.plan_calls) == 1
            call = be.plan_calls[0]
            assert call["train"] and call["n"] == 7 and call["group"]
            assert all(t > 0 for t in call["fwd_ms"]) and all(t > 0 for t in call["bwd_ms"])
            assert h.record_names()[0] == ["0", "2", "4"] and len(h.records) == 3
            assert h.resident == (0,) and h.depth == 3
            assert h.plan_info["records"] == h.record_names()
        close(ya, yb, torch.float32)
        g = torch.randn_like(ya)
        ya.backward(g)
        yb.backward(g)
        for (k, pa), pb in zip(m.named_parameters(), ref.parameters()):
            close(pa.grad, pb.grad, torch.float32)
        opt.step()
        opt_r.step()
        opt.zero_grad()
        opt_r.zero_grad()
    # the same Parameter objects, now over the new pool's bytes
    assert {k: id(p) for k, p in m.named_parameters()} == ids
    assert be.rings[-1].resident and 0 in be.rings[-1].resident
    st = h.stats()
    assert st["records"] == 3 and st["resident"] == 1
    times = h.step_times()
    assert len(times) >= 6 and all(t["kind"] == "train" and t["measured_ms"] > 0 for t in times)
    h.close()
    x = torch.randn(3, 12)
    close(m(x), ref(x), torch.float32)


def test_the_plan_keeps_gradients_that_are_still_summing():
    # gradient accumulation across the step where the plan would come: it
    # waits for a step that starts with no sum running (after zero_grad)
    m = deep_mlp()
    ref = copy.deepcopy(m)
    be = host_lwo.PlanningBackend(group_size=2, resident_first=False)
    h = lt.offload(m, _backend=be)
    for step in range(7):
        assert len(be.plan_calls) == (1 if step >= 5 else 0)
        x = torch.randn(4, 12)
        m(x).sum().backward()
        ref(x).sum().backward()
        if step == 1:
            continue  # no zero_grad: the sums run on into the planned step
        for pa, pb in zip(m.parameters(), ref.parameters()):
            close(pa.grad, pb.grad, torch.float32)
        if step in (0, 3):
            for mm in (m, ref):
                mm.zero_grad()
    assert len(h.records) == 4


def test_a_given_group_and_depth_are_kept_by_the_plan():
    m = deep_mlp()
    be = host_lwo.PlanningBackend(group_size=3)
    h = lt.offload(m, _backend=be, depth=2, group=lambda n, mod: int(n) // 4)
    for _ in range(4):
        m(torch.randn(2, 12)).sum().backward()
        m.zero_grad()
    call = be.plan_calls[0]
    assert call["depths"] == [2] and not call["group"] and call["n"] == 4
    assert h.depth == 2 and len(h.records) == 4


def test_plan_false_measures_nothing_and_a_budget_needs_the_plan():
    m = deep_mlp()
    be = host_lwo.PlanningBackend()
    h = lt.offload(m, _backend=be, plan=False)
    for _ in range(4):
        m(torch.randn(2, 12)).sum().backward()
        m.zero_grad()
    assert be.plan_calls == [] and h.depth == 2 and len(h.records) == 7
    with pytest.raises(ValueError, match="needs plan=True"):
        lt.offload(deep_mlp(), _backend=host_lwo.PlanningBackend(), plan=False, budget="1GiB")


def test_a_budget_below_the_smallest_ring_names_the_bytes():
    m = deep_mlp()
    ref = copy.deepcopy(m)
    with pytest.raises(lwo.ResourceError, match=r"cannot hold a plan: it needs at least"):
        lt.offload(m, _backend=host_lwo.PlanningBackend(), budget=100)
    # the model is whole again
    x = torch.randn(2, 12)
    close(m(x), ref(x), torch.float32)
    assert not lt.is_offloaded(m)


def test_budgets_parse():
    from lwo import _tune
    assert _tune.parse_budget("16GiB") == 16 << 30
    assert _tune.parse_budget("512 MB") == 512 * 10 ** 6
    assert _tune.parse_budget("25%", free_bytes=1000) == 250
    assert _tune.parse_budget(0.5, free_bytes=1000) == 500
    assert _tune.parse_budget(4096) == 4096
    for bad in ("abc", "-5%", "0", 0, 1.5, True, "12 parsecs", [1]):
        with pytest.raises(ValueError):
            _tune.parse_budget(bad, free_bytes=1000)
    assert _tune.split_runs([(0, 4, True)], ["a", "a", "b", "b"]) == [(0, 2, True), (2, 2, True)]


def test_a_model_with_nothing_lwo_computes_stays_resident():
    m = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1, padding_mode="reflect"), nn.ReLU())
    ref = copy.deepcopy(m)
    with pytest.warns(RuntimeWarning, match="nothing to stream"):
        h, be = offload(m)
    assert h.modules == {} and "padding_mode" in h.skipped["0"]
    x = torch.randn(1, 1, 5, 5)
    close(m(x), ref(x), torch.float32)
    assert h.stats()["records"] == 0
    h.close()


def test_small_records_are_merged_before_the_plan():
    # 12 x 12 f32 linears: 768-byte records (with their bias, 1 KiB)
    m = deep_mlp()
    ref = copy.deepcopy(m)
    be = host_lwo.PlanningBackend(group_size=1, resident_first=False,
                                  small_record=2048, small_run=3072)
    h = lt.offload(m, _backend=be)
    for _ in range(5):
        x = torch.randn(3, 12)
        ya, yb = m(x), ref(x)
        close(ya, yb, torch.float32)
        ya.sum().backward()
        yb.sum().backward()
        for pa, pb in zip(m.parameters(), ref.parameters()):
            close(pa.grad, pb.grad, torch.float32)
        m.zero_grad()
        ref.zero_grad()
    # runs of records up to 3 KiB: the planner saw fewer, larger records,
    # and a default budget that holds the largest of them
    assert "error" not in h.plan_info, h.plan_info
    call = be.plan_calls[0]
    assert call["budget_bytes"] >= 3 * max(r.bytes for r in h.records)
    assert call["n"] < 7 and h.plan_info["merged_small"] == call["n"] == len(h.records)
    assert sum(len(r) for r in h.record_names()) == 7
    from lwo import _tune
    assert _tune.merge_small([10, 10, 10, 50, 10], ["a"] * 5, 20, 25) == [
        (0, 2, False), (2, 1, False), (3, 1, False), (4, 1, False)]
    assert _tune.merge_small([10, 10], ["a", "b"], 20, 100) == [(0, 1, False), (1, 1, False)]


def test_steps_far_from_the_prediction_make_a_new_plan():
    # a prediction no step meets (a microsecond): after three such steps the
    # handle measures again and plans depth and residents for its records
    m = deep_mlp()
    be = host_lwo.PlanningBackend(group_size=2, predicted_ms=1e-3)
    h = lt.offload(m, _backend=be)
    for _ in range(30):
        m(torch.randn(3, 12)).sum().backward()
        m.zero_grad()
    assert len(be.plan_calls) == 3  # the first plan and two again, then no more
    assert be.plan_calls[0]["group"] and not be.plan_calls[1]["group"]
    assert be.plan_calls[1]["n"] == be.plan_calls[2]["n"] == len(h.records) == 4
    assert h.plan_info["replans"] == 2
    assert [p["replans"] for p in h.plans] == [0, 1, 2] and h.plans[-1] is h.plan_info
    assert h.plans[0]["applied_at_step"] < h.plans[1]["applied_at_step"] < \
        h.plans[2]["applied_at_step"]
    # a prediction the steps meet is kept
    m2 = deep_mlp()
    be2 = host_lwo.PlanningBackend(group_size=2, predicted_ms=None)
    lt.offload(m2, _backend=be2)
    for _ in range(12):
        m2(torch.randn(3, 12)).sum().backward()
        m2.zero_grad()
    assert len(be2.plan_calls) == 1


class _Clock(nn.Module):
    """Moves the test's clock (the backend's events read it) by `seconds[0]` at each
    call: steps of a known length, whatever the host's load."""

    def __init__(self, seconds, now):
        super().__init__()
        self.seconds, self.now = seconds, now

    def forward(self, x):
        self.now[0] += self.seconds[0]
        return x


def test_a_plan_faster_than_predicted_is_kept_and_a_step_that_changes_replans():
    delay, now = [0.02], [0.0]
    m = nn.Sequential(deep_mlp(), _Clock(delay, now))
    # a prediction far above what the steps take: the plan delivers more
    # than it promised, and is kept
    be = host_lwo.PlanningBackend(group_size=2, predicted_ms=1e6)
    be.event = lambda: now[0]
    be.record = lambda e: now[0]
    h = lt.offload(m, _backend=be)
    for _ in range(14):
        m(torch.randn(3, 12)).sum().backward()
        m.zero_grad()
    assert len(be.plan_calls) == 1 and h.plan_info["replans"] == 0
    # the steps then take three times as long as the plan's first ones (the
    # shapes changed): measured again and planned anew
    delay[0] = 0.06
    for _ in range(10):
        m(torch.randn(3, 12)).sum().backward()
        m.zero_grad()
    assert len(be.plan_calls) == 2 and h.plan_info["replans"] == 1


def test_the_loads_progress_on_stderr(capsys):
    lt.offload(mlp(), _backend=host_lwo.Backend(), progress=True)
    err = capsys.readouterr().err
    assert "lwo.torch.offload: copying weights into the pool" in err and "100%" in err
    m = mlp().requires_grad_(False)
    lt.offload(m, _backend=host_lwo.Backend(), quant="int8", progress=True)
    assert "quantizing and copying" in capsys.readouterr().err
    for progress in (None, False):  # a load this short says nothing by default
        lt.offload(mlp(), _backend=host_lwo.Backend(), progress=progress)
        assert capsys.readouterr().err == ""
    # by time: a bar once the load has run `after` seconds
    import io
    from lwo.torch import _Progress
    out = io.StringIO()
    bar = _Progress("loading", 100, None, after=0.0, stream=out)
    for _ in range(4):
        bar.last = 0.0
        bar.add(25)
    bar.done()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("loading:") and lines[-1].startswith("loading: 100%"), lines


def test_sums_survive_a_module_made_trainable_between_micro_batches():
    # layer 0 trainable and accumulating; layer 2 switched on between two
    # backward passes: the gradient set is made again, and layer 0's sum must
    # carry on (the new set starts its layers afresh)
    m = mlp()
    for p in m.parameters():
        p.requires_grad_(False)
    m[0].weight.requires_grad_(True)
    ref = copy.deepcopy(m)
    h, be = offload(m)
    x1, x2 = torch.randn(3, 12), torch.randn(3, 12)
    m(x1).sum().backward()
    ref(x1).sum().backward()
    for mod in (m, ref):
        mod[2].weight.requires_grad_(True)
    m(x2).sum().backward()
    ref(x2).sum().backward()
    close(m[0].weight.grad, ref[0].weight.grad, torch.float32)
    close(m[2].weight.grad, ref[2].weight.grad, torch.float32)
    # and once more, both trainable from the start of the pass
    x3 = torch.randn(3, 12)
    m(x3).sum().backward()
    ref(x3).sum().backward()
    close(m[0].weight.grad, ref[0].weight.grad, torch.float32)
    close(m[2].weight.grad, ref[2].weight.grad, torch.float32)


def test_the_next_record_is_staged_ahead_at_every_module_of_a_record():
    # records of three linears each (the plan's grouping), depth 2: while a
    # record's modules run, the next record of the plan is already staged
    # (prefetched), in forward and in backward, at every module, step after step
    m = nn.Sequential(*[nn.Linear(12, 12) for _ in range(12)])
    be = host_lwo.Backend()
    h = lt.offload(m, _backend=be, depth=2, plan=False, group=lambda n, mod: int(n) // 3)
    x = torch.randn(4, 12, requires_grad=True)
    for _ in range(4):  # warm-up and the plan
        m(x).sum().backward()
    assert len(h.records) == 4 and h.depth == 2 and not h.resident
    seen, cur = [], [None]
    fwd, bwd, acquire = be.linear_forward, be.linear_backward, h._acquire

    def acquired(rec, stream):
        cur[0] = rec.index
        return acquire(rec, stream)

    def ahead(order):
        i = order.index(cur[0])
        if i + 1 < len(order):
            seen.append(order[i + 1] in h._prefetched)

    def lin_fwd(*a):
        ahead([0, 1, 2, 3])
        return fwd(*a)

    def lin_bwd(*a):
        ahead([3, 2, 1, 0])
        return bwd(*a)

    be.linear_forward, be.linear_backward = lin_fwd, lin_bwd
    h._lin_fwd, h._acquire = lin_fwd, acquired
    for _ in range(2):
        m(x).sum().backward()
    assert len(seen) >= 2 * (9 + 9) and all(seen), seen
