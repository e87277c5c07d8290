"""lwo.torch.optim without a GPU: AdamW and SGD over lwo's host optimizer
(the real library on its host backend, host_lwo), against the same model trained resident by PyTorch's
optimizers: parameter groups, schedulers, clipping (streamed and resident
gradients in one norm), state_dict round trips (its own and PyTorch's), the
step begun in the backward pass, the delayed update, the plan's regrouping
(the state moves to the new pool), writes into streamed parameters, misuse.
Skipped when torch is not installed."""

import copy
import io

import pytest

try:
    import torch
except ImportError as e:  # not installed, or not importable here
    pytest.skip("torch is not importable: %s" % e, allow_module_level=True)
nn = torch.nn

import lwo  # noqa: E402
import lwo.torch as lt  # noqa: E402
from lwo.torch import optim as lopt  # noqa: E402

import host_lwo  # noqa: E402


class Net(nn.Module):
    """Streamed linears around a resident LayerNorm (its parameters stay
    with PyTorch's optimizer)."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.a = nn.Linear(12, 32)
        self.norm = nn.LayerNorm(32)
        self.b = nn.Linear(32, 24)
        self.c = nn.Linear(24, 8, bias=False)
        self.to(dtype)

    def forward(self, x):
        return self.c(torch.tanh(self.b(self.norm(self.a(x)))))


def pair(seed=0, dtype=torch.float32, backend=None, **kw):
    torch.manual_seed(seed)
    m = Net(dtype)
    ref = copy.deepcopy(m)
    be = backend or host_lwo.Backend()
    h = lt.offload(m, _backend=be, **kw)
    return m, ref, h, be


def run(model, opt, xs, gs, sched=None, zero=True):
    outs = []
    for x, g in zip(xs, gs):
        y = model(x)
        outs.append(y.detach().clone())
        y.backward(g)
        opt.step()
        if sched is not None:
            sched.step()
        if zero:
            opt.zero_grad()
    return outs


def data(n, seed=1, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(6, 12, generator=gen).to(dtype) for _ in range(n)]
    gs = [torch.randn(6, 8, generator=gen).to(dtype) for _ in range(n)]
    return xs, gs


def close(a, b, tol=2e-5):
    a, b = a.detach().float(), b.detach().float()
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-3)
    assert err <= tol, "relative error %g > %g" % (err, tol)


def same_params(m, ref, tol=2e-5):
    pr = dict(ref.named_parameters())
    for k, p in m.named_parameters():
        close(p, pr[k], tol)


def test_adamw_matches_pytorch_with_a_scheduler_and_groups():
    # weights decayed; biases (streamed) and the LayerNorm (on the GPU) not,
    # at another lr and beta1: as transformers' trainers group them
    m, ref, h, be = pair()

    def groups_of(model):
        named = list(model.named_parameters())
        decay = [p for n, p in named if n.endswith("weight") and not n.startswith("norm")]
        rest = [p for n, p in named if not (n.endswith("weight") and not n.startswith("norm"))]
        return [{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": 3e-3,
                                    "betas": (0.8, 0.99)}]
    groups, groups_r = groups_of(m), groups_of(ref)
    opt = lopt.AdamW(groups, lr=1e-2, weight_decay=0.1)
    opt_r = torch.optim.AdamW(groups_r, lr=1e-2, weight_decay=0.1)
    s = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    s_r = torch.optim.lr_scheduler.StepLR(opt_r, step_size=2, gamma=0.5)
    xs, gs = data(6)
    outs = run(m, opt, xs, gs, s)
    outs_r = run(ref, opt_r, xs, gs, s_r)
    for a, b in zip(outs, outs_r):
        close(a, b)
    opt.synchronize()
    same_params(m, ref)
    assert len(be.optims) == 1 and be.optims[0].n_steps == 6
    # the streamed parameters went to lwo (biases in group 1), the LayerNorm's to PyTorch
    assert "2 on the GPU" in repr(opt) and "5 streamed" in repr(opt)
    assert sorted(be.optims[0].group.values()) == [1, 1]
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.125)


def test_sgd_momentum_and_decoupled_weight_decay():
    m, ref, h, be = pair(seed=3)
    lr, wd, mom = 5e-2, 0.1, 0.9
    opt = lopt.SGD(m.parameters(), lr=lr, momentum=mom, weight_decay=wd)
    opt_r = torch.optim.SGD(ref.parameters(), lr=lr, momentum=mom)
    xs, gs = data(4, seed=4)
    for x, g in zip(xs, gs):
        close(m(x), ref(x))
        m(x).backward(g)
        ref(x).backward(g)
        opt.step()
        with torch.no_grad():  # decoupled: p *= 1 - lr wd, then the step
            for p in ref.parameters():
                p.mul_(1 - lr * wd)
        opt_r.step()
        opt.zero_grad()
        opt_r.zero_grad()
    opt.synchronize()
    same_params(m, ref)


def test_clipping_takes_streamed_and_resident_gradients_in_one_norm():
    m, ref, h, be = pair(seed=5)
    opt = lopt.AdamW(m.parameters(), lr=1e-2, max_norm=0.5)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    xs, gs = data(4, seed=6)
    norms = []
    for x, g in zip(xs, gs):
        m(x).backward(g * 5)
        ref(x).backward(g * 5)
        opt.step()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)))
        opt_r.step()
        opt.zero_grad()
        opt_r.zero_grad()
    opt.synchronize()
    same_params(m, ref)
    assert min(norms) > 0.5  # every step was clipped
    st = opt.stats()[0]
    assert st.n_clipped == 4
    assert st.last_norm == pytest.approx(norms[-1], rel=1e-4)


def saved(sd):
    """sd through torch.save and torch.load (a state_dict loaded as it is
    shares its tensors with the optimizer it came from, in PyTorch too)."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf)


def test_state_dict_round_trip_and_pytorchs_own():
    xs, gs = data(6, seed=8)
    m, ref, h, be = pair(seed=7)
    opt = lopt.AdamW(m.parameters(), lr=1e-2)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    run(m, opt, xs[:3], gs[:3])
    run(ref, opt_r, xs[:3], gs[:3])
    raw = opt.state_dict()
    sd = saved(raw)
    st = sd["state"][0]
    assert set(st) >= {"step", "exp_avg", "exp_avg_sq", "master"}
    assert st["master"].dtype == torch.float32 and st["exp_avg"].shape == m.a.weight.shape
    close(st["exp_avg"], opt_r.state[ref.a.weight]["exp_avg"])

    # Into a fresh handle and optimizer: both go on as one.
    m2 = copy.deepcopy(ref)
    h2 = lt.offload(m2, _backend=host_lwo.Backend())
    opt2 = lopt.AdamW(m2.parameters(), lr=1e-2)
    opt2.load_state_dict(sd)
    # PyTorch's own state_dict into lwo's optimizer, and lwo's into PyTorch's.
    m3 = copy.deepcopy(ref)
    h3 = lt.offload(m3, _backend=host_lwo.Backend())
    opt3 = lopt.AdamW(m3.parameters(), lr=1e-2)
    opt3.load_state_dict(saved(opt_r.state_dict()))
    ref4 = copy.deepcopy(ref)
    opt4 = torch.optim.AdamW(ref4.parameters(), lr=1e-2)
    opt4.load_state_dict(saved(raw))
    for mm, oo in ((m, opt), (m2, opt2), (m3, opt3), (ref, opt_r), (ref4, opt4)):
        run(mm, oo, xs[3:], gs[3:])
    for mm, oo in ((m, opt), (m2, opt2), (m3, opt3)):
        oo.synchronize()
        same_params(mm, ref)
    same_params(ref4, ref)
    h2.close()
    h3.close()


def test_in_backward_steps_at_the_end_of_each_pass_and_refuses_accumulation():
    m, ref, h, be = pair(seed=9)
    opt = lopt.AdamW(m.parameters(), lr=1e-2, in_backward=True)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    xs, gs = data(3, seed=10)
    m(xs[0]).backward(gs[0])
    assert be.optims[0].n_steps == 1  # begun by the backward pass
    opt.step()
    assert be.optims[0].n_steps == 1  # not again
    opt.zero_grad()
    run(m, opt, xs[1:], gs[1:])
    run(ref, opt_r, xs, gs)
    opt.synchronize()
    same_params(m, ref)
    m(xs[0]).backward(gs[0])
    with pytest.raises(lwo.StateError, match="in_backward=False"):
        m(xs[1]).backward(gs[1])



class Blocks(nn.Module):
    """Streamed linears in blocks, each block optionally under activation
    checkpointing (reentrant or not), then a head outside them (so that the
    outer backward pass is lwo's, a reentrant checkpoint's passes nested in
    it); `shared` calls block 0's first linear again at the end (two nodes of
    one record in a pass)."""

    def __init__(self, ckpt=None, shared=False):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12))
                                    for _ in range(3))
        self.head = nn.Linear(12, 12)
        self.ckpt, self.shared = ckpt, shared

    def forward(self, x):
        for b in self.blocks:
            if self.ckpt is None:
                x = b(x)
            else:
                x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=self.ckpt == "reentrant")
        x = self.head(torch.tanh(x))
        if self.shared:
            x = self.blocks[0][0](x)
        return x


@pytest.mark.parametrize("ckpt,shared", [(None, False), ("non-reentrant", False),
                                         ("reentrant", False), (None, True)])
def test_in_backward_opens_the_step_and_adds_each_record_once_its_nodes_have_run(ckpt, shared):
    """With in_backward=True the step opens when the backward pass begins,
    and each record joins it (lwo_optim_step_add) once every autograd node
    the forward made for it has run, before the pass ends; the rest join at
    the close. A reentrant checkpoint (its forward without grad) and an
    evaluation under no_grad leave those records to the close. The weights
    equal PyTorch's AdamW on the resident model throughout."""
    torch.manual_seed(3)
    m = Blocks(ckpt, shared)
    ref = copy.deepcopy(m)
    be = host_lwo.Backend()
    h = lt.offload(m, _backend=be, plan=False)
    n_rec = len(h.records)
    assert n_rec == 7
    opt = lopt.AdamW(m.parameters(), lr=1e-2, in_backward=True)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(4)
    for step in range(4):
        x = torch.randn(5, 12, generator=gen, requires_grad=True)
        g = torch.randn(5, 12, generator=gen)
        if step == 2:  # an evaluation pass between training steps
            with torch.no_grad():
                m(x)
        for mm, oo in ((m, opt), (ref, opt_r)):
            mm(x).backward(g)
            oo.step()
            oo.zero_grad()
        log = be.optims[-1].log
        k = max(i for i, e in enumerate(log) if e[0] == "open")
        this = log[k:]
        assert this[0] == ("open", step + 1) and this[-1] == ("close",), this
        added = [e[1] for e in this if e[0] == "add"]
        assert len(set(added)) == len(added)
        if step in (0, 2):
            # no count yet (the first pass), or every record reached without grad
            assert added == [], (step, added)
        elif ckpt == "reentrant":
            # the head (in the outer pass); the blocks' records (their forward
            # without grad, their nodes in nested passes) at the close
            assert added == [n_rec - 1], (step, added)
        else:
            # in the backward's order (with the shared linear called last, its
            # record 0 waits for its second node, which runs last)
            assert added == list(range(n_rec))[::-1], (step, added)
        opt.synchronize()
        same_params(m, ref)
    h.close()


def test_accumulation_over_two_backward_passes():
    m, ref, h, be = pair(seed=11)
    opt = lopt.AdamW(m.parameters(), lr=1e-2)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    xs, gs = data(4, seed=12)
    for i in range(0, 4, 2):
        for mm, oo in ((m, opt), (ref, opt_r)):
            mm(xs[i]).backward(gs[i])
            mm(xs[i + 1]).backward(gs[i + 1])
            oo.step()
            oo.zero_grad()
    opt.synchronize()
    same_params(m, ref)


def test_delayed_update_lags_one_step():
    m, ref, h, be = pair(seed=13)
    opt = lopt.AdamW(m.parameters(), lr=1e-2, delayed=True)
    xs, gs = data(2, seed=14)
    w0 = m.a.weight.detach().clone()
    m(xs[0]).backward(gs[0])
    opt.step()
    opt.zero_grad()
    y = m(xs[1])  # streamed weights still those of step 0
    close(m.a.weight, w0, 0)
    y.backward(gs[1])
    opt.step()
    opt.synchronize()  # the pool catches up with the masters
    assert (m.a.weight - w0).abs().max() > 0
    master = opt.state_dict()["state"][0]["master"]
    close(m.a.weight, master)


def test_the_plans_regrouping_carries_the_state():
    be = host_lwo.PlanningBackend(group_size=2)
    m, ref, h, _ = pair(seed=15, backend=be)
    opt = lopt.AdamW(m.parameters(), lr=1e-2)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    xs, gs = data(6, seed=16)
    n_records = len(h.records)
    run(m, opt, xs, gs)
    run(ref, opt_r, xs, gs)
    assert len(h.records) < n_records  # the plan grouped records
    assert len(be.optims) == 2 and be.optims[0].closed  # made again over the new pool
    opt.synchronize()
    same_params(m, ref)


def test_a_write_into_a_streamed_parameter_reaches_the_masters():
    m, ref, h, be = pair(seed=17)
    opt = lopt.AdamW(m.parameters(), lr=1e-2)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    xs, gs = data(3, seed=18)
    run(m, opt, xs[:1], gs[:1])
    run(ref, opt_r, xs[:1], gs[:1])
    opt.synchronize()
    with torch.no_grad():
        m.b.weight.mul_(0.5)
        ref.b.weight.mul_(0.5)
    run(m, opt, xs[1:], gs[1:])
    run(ref, opt_r, xs[1:], gs[1:])
    opt.synchronize()
    same_params(m, ref)


def test_a_group_added_later_takes_its_hyperparameters():
    # b frozen at offload(), then made trainable in a group of its own: the
    # gradient set and lwo's optimizer are made again, the state carried
    torch.manual_seed(23)
    m = Net()
    m.b.requires_grad_(False)
    m.norm.requires_grad_(False)
    ref = copy.deepcopy(m)
    lt.offload(m, _backend=host_lwo.Backend())
    opt = lopt.AdamW([m.a.weight, m.a.bias, m.c.weight], lr=1e-2)
    opt_r = torch.optim.AdamW([ref.a.weight, ref.a.bias, ref.c.weight], lr=1e-2)
    xs, gs = data(4, seed=24)
    run(m, opt, xs[:2], gs[:2])
    run(ref, opt_r, xs[:2], gs[:2])
    for mm, oo in ((m, opt), (ref, opt_r)):
        mm.b.requires_grad_(True)
        oo.add_param_group({"params": list(mm.b.parameters()), "lr": 5e-3, "weight_decay": 0.0})
    run(m, opt, xs[2:], gs[2:])
    run(ref, opt_r, xs[2:], gs[2:])
    opt.synchronize()
    same_params(m, ref)


def test_misuse_has_clear_errors():
    m, ref, h, be = pair(seed=19)
    m(torch.randn(2, 12)).sum().backward()
    # a record's parameter left out of the optimizer
    opt = lopt.AdamW([m.a.weight, m.b.weight, m.b.bias, m.c.weight], lr=1e-2)
    with pytest.raises(lwo.ArgumentError, match="bias of streamed module 'a'"):
        opt.step()
    with pytest.raises(lwo.ArgumentError, match="max_norm with in_backward"):
        lopt.AdamW(m.parameters(), max_norm=1.0, in_backward=True)
    with pytest.raises(lwo.ArgumentError, match="amsgrad"):
        lopt.AdamW(m.parameters(), amsgrad=True)
    with pytest.raises(lwo.ArgumentError, match="state"):
        lopt.AdamW(m.parameters(), state="f16")
    # closing the handle ends the streamed state
    opt = lopt.AdamW(m.parameters(), lr=1e-2)
    opt.zero_grad()
    m(torch.randn(2, 12)).sum().backward()
    opt.step()
    h.close()
    with pytest.raises(lwo.StateError, match="closed"):
        opt.step()


def test_bf16_model_keeps_f32_masters():
    """bf16 weights streamed, f32 masters on the host: the master weights
    follow an f32 reference of the same steps; the streamed weights are
    their rounding."""
    torch.manual_seed(21)
    ref = Net(torch.float32)
    m = copy.deepcopy(ref).to(torch.bfloat16)
    h = lt.offload(m, _backend=host_lwo.Backend())
    opt = lopt.AdamW(m.parameters(), lr=1e-3, state="bf16")
    xs, gs = data(3, seed=22)
    for x, g in zip(xs, gs):
        m(x.bfloat16()).backward(g.bfloat16())
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    sd = opt.state_dict()
    assert sd["state"][0]["exp_avg"].dtype == torch.bfloat16
    master = sd["state"][0]["master"]
    assert master.dtype == torch.float32
    assert torch.equal(m.a.weight, master.to(torch.bfloat16))
    # small steps move the masters by less than a bf16 weight's spacing:
    # kept in f32 they are not lost
    assert (master - master.to(torch.bfloat16).float()).abs().max() > 0
