"""lwo.torch.offload(process_group=) without a GPU: a gloo group of one rank
over the host backend (host_lwo.Backend). lwo's communicator comes from an
NCCL unique id broadcast over the group (gloo has no NCCL communicator to
split) and is one of the host backend's one-rank communicators. The model
streams through the sharded pool over it (one shard: the whole record), its
weight gradients through the sharded sink (f32 on the wire, reduced over one
rank) into the shard's f32 host buffer, which lwo.torch.optim updates the
shard from: with f32 weights, exactly as without a group."""

import copy
import os
import re
import threading

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import lwo  # noqa: E402
import lwo.torch as lt  # noqa: E402
import lwo.torch.optim as lopt  # noqa: E402

import host_lwo  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed missing")


@pytest.fixture
def world(tmp_path):
    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method="file://%s" % (tmp_path / "store"))
    yield dist.group.WORLD
    dist.destroy_process_group()


def mlp():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 24), nn.Tanh(),
                         nn.Linear(24, 8))


def adamw_steps(model, n=10, seed=5):
    """n AdamW steps (lwo.torch.optim where the model is offloaded); the
    outputs, input gradients and final parameters."""
    gen = torch.Generator().manual_seed(seed)
    offloaded = lt.handle_of(model) is not None
    opt = (lopt.AdamW if offloaded else torch.optim.AdamW)(model.parameters(), lr=1e-2,
                                                           weight_decay=0.1)
    outs = []
    for _ in range(n):
        x = torch.randn(6, 12, generator=gen).requires_grad_(True)
        y = model(x)
        y.backward(torch.randn(6, 8, generator=gen))
        outs.append((y.detach().clone(), x.grad.clone()))
        opt.step()
        opt.zero_grad()
    if offloaded:
        opt.synchronize()
    return outs, {k: p.detach().clone() for k, p in model.named_parameters()}


def test_one_rank_streams_as_without_a_group(world):
    a, b, ref = mlp(), mlp(), mlp()
    ha = lt.offload(a, _backend=host_lwo.Backend(), process_group=world)
    hb = lt.offload(b, _backend=host_lwo.Backend())
    assert (ha.rank, ha.world_size, ha.comm_path) == (0, 1, "unique-id")
    assert ha.comm is not None and not ha.comm.closed
    assert hb.comm is None and hb.world_size == 1
    # with a group: the sharded pool, of one rank (its shard the whole record)
    info = ha.pool.info()
    assert (info.kind, info.rank, info.n_ranks) == (lwo.LWO_POOL_SHARDED, 0, 1)
    assert hb.pool.info().kind == lwo.LWO_POOL_PINNED
    outs_a, pa = adamw_steps(a)
    outs_b, pb = adamw_steps(b)
    outs_r, pr = adamw_steps(ref)
    for (ya, ga), (yb, gb), (yr, gr) in zip(outs_a, outs_b, outs_r):
        assert torch.equal(ya, yb) and torch.equal(ga, gb)  # the same, bit for bit
        torch.testing.assert_close(ya, yr, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(ga, gr, rtol=2e-5, atol=2e-5)
    for k in pr:
        assert torch.equal(pa[k], pb[k]), k
        torch.testing.assert_close(pa[k], pr[k], rtol=2e-5, atol=2e-5)
    comm = ha.comm
    ha.close()
    hb.close()
    assert comm.closed and ha.comm is None


def _streamed(h):
    """(record, parameter, tensor name) of every streamed parameter."""
    for rec in h.records:
        for s in rec.modules:
            yield rec, s.weight, rec.names[s.w_idx]
            if s.bias is not None:
                yield rec, s.bias, rec.names[s.b_idx]


def test_the_gradient_reaches_the_optimizer_through_the_shard(world):
    m, ref = mlp(), mlp()
    h = lt.offload(m, _backend=host_lwo.Backend(), process_group=world)
    assert h.pool.info().kind == lwo.LWO_POOL_SHARDED
    opt = lopt.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(9)
    m(torch.randn(6, 12, generator=gen)).sum().backward()
    names = {p: n for n, p in m.named_parameters()}
    rp = dict(ref.named_parameters())
    seen = 0
    for rec, p, name in _streamed(h):
        w = h.pool.shard_tensor(rec.index, name)
        g = h.grads.obj.shard(rec.index, name)  # lwo_grads_shard: the rank's f32 sum
        assert (w.first_element, w.n_elements) == (g.first_element, g.n_elements) \
            == (0, p.numel())
        assert p.data_ptr() == w.address       # the parameter is the pool's shard
        assert p.grad.data_ptr() == g.address  # param.grad views the shard's buffer
        # A gradient of the test's own, written into the shard buffer alone:
        # the update must follow it (one read from anywhere else would not).
        G = torch.randn(p.shape, generator=gen)
        lt._host_tensor(g.address, g.n_elements * 4, torch.float32, (g.n_elements,),
                        h.grads).copy_(G.reshape(-1))
        rp[names[p]].grad = G.clone()
        seen += 1
    assert seen == len(rp)  # every parameter of the mlp is streamed
    # the gradient set moved f32 from each slot (the sharded sink's wire)
    st = h.grads.stats()
    assert st.n_transfers == len(h.records) and st.bytes >= 4 * sum(p.numel() for p in rp.values())
    opt.step()
    opt.synchronize()
    ropt.step()
    for k, p in m.named_parameters():
        torch.testing.assert_close(p.detach(), rp[k].detach(), rtol=1e-6, atol=1e-7)
    h.close()


def test_a_bf16_model_sends_f32_gradients_through_the_sharded_sink(world):
    torch.manual_seed(4)
    a = nn.Linear(16, 8).to(torch.bfloat16)
    b = copy.deepcopy(a)
    ha = lt.offload(a, _backend=host_lwo.Backend(), process_group=world)
    hb = lt.offload(b, _backend=host_lwo.Backend())
    x = torch.randn(4, 16).to(torch.bfloat16)
    for m in (a, b):
        m(x).float().square().sum().backward()
    n = sum(p.numel() for p in a.parameters())
    # f32 on the wire with the group; bf16 (the weights' dtype) without
    assert hb.grads.stats().bytes < 4 * n <= ha.grads.stats().bytes
    g = ha.grads.obj
    for (rec, pa, name), pb in zip(_streamed(ha), b.parameters()):
        # param.grad: the shard's f32 sum (torch's grad_dtype f32 while offloaded)
        assert (pa.grad.dtype, pb.grad.dtype) == (torch.float32, torch.bfloat16)
        assert pa.grad.data_ptr() == g.shard(rec.index, name).address
        torch.testing.assert_close(pa.grad.to(torch.bfloat16), pb.grad, rtol=2e-2, atol=2e-2)
    ha.close()
    hb.close()
    for p in a.parameters():  # back to a bf16 parameter with a bf16 gradient
        assert p.dtype == p.grad.dtype == p.grad_dtype == torch.bfloat16


def test_an_empty_batch_zeroes_the_whole_f32_gradient_slot(world):
    # The slot of a bf16 weight is f32 here: an empty batch's zeros must
    # cover all of it (the host backend's slots are 0xff, NaN, when begun).
    a = nn.Linear(16, 8).to(torch.bfloat16)
    h = lt.offload(a, _backend=host_lwo.Backend(), process_group=world)
    a(torch.randn(0, 16).to(torch.bfloat16).requires_grad_(True)).sum().backward()
    for p in a.parameters():
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, torch.zeros_like(p.grad))
    h.close()


def test_the_optimizer_state_of_the_shard_round_trips(world):
    # lwo.torch.optim's state of a sharded pool (the shard's masters and
    # moments) equals that of the pinned pool, and loads into a new model
    a, b, c = mlp(), mlp(), mlp()
    ha = lt.offload(a, _backend=host_lwo.Backend(), process_group=world)
    hb = lt.offload(b, _backend=host_lwo.Backend())
    hc = lt.offload(c, _backend=host_lwo.Backend(), process_group=world)
    oa, ob, oc = (lopt.AdamW(m.parameters(), lr=1e-2) for m in (a, b, c))
    x = torch.randn(5, 12, generator=torch.Generator().manual_seed(2))
    for m, o in ((a, oa), (b, ob)):
        for _ in range(3):
            m(x).square().sum().backward()
            o.step()
            o.zero_grad()
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["state"].keys() == sb["state"].keys() and len(sa["state"]) == 6
    for i in sa["state"]:
        for k in ("exp_avg", "exp_avg_sq", "master"):
            assert torch.equal(sa["state"][i][k], sb["state"][i][k]), (i, k)
    with torch.no_grad():
        for pc, pa in zip(c.parameters(), a.parameters()):
            pc.copy_(pa)
    oc.load_state_dict(sa)
    for m, o in ((a, oa), (c, oc)):
        m(x).square().sum().backward()
        o.step()
        o.synchronize()
    for pa, pc in zip(a.parameters(), c.parameters()):
        assert torch.equal(pa, pc)
    for h in (ha, hb, hc):
        h.close()


def test_split_needs_an_nccl_group(world):
    with pytest.raises(RuntimeError, match="_comm_ptr"):
        lt.offload(mlp(), _backend=host_lwo.Backend(), process_group=world, dist_comm="split")


def test_the_split_path_on_the_host_backend(world):
    # What offload does with a group's NCCL communicator, over the host
    # backend's one-rank communicator standing in for PyTorch's.
    be = host_lwo.Backend()
    parent = be.engine.nccl_comm_create(lwo.nccl_get_unique_id(), 1, 0)
    child = be.engine.nccl_comm_split(parent.handle, 0, 0)  # a raw address, as _comm_ptr gives
    assert child.handle != parent.handle
    parent.close()
    child2 = be.engine.nccl_comm_split(child, 1, 0)
    child2.close()
    child.close()
    with pytest.raises(lwo.ArgumentError, match="color -2"):
        be.engine.nccl_comm_split(1234, -2, 0)  # refused before the pointer is looked at
    with pytest.raises(lwo.Error, match="one-rank communicators"):
        be.engine.nccl_comm_split(1234, 0, 0)   # not one of the host backend's


def test_bad_arguments_are_refused(world, monkeypatch):
    with pytest.raises(ValueError, match="dist_comm must be"):
        lt.offload(mlp(), _backend=host_lwo.Backend(), process_group=world, dist_comm="x")
    with pytest.raises(ValueError, match="goes with process_group"):
        lt.offload(mlp(), _backend=host_lwo.Backend(), dist_comm="unique-id")
    for kw, what in (({"quant": "int8"}, "quant="), ({"checkpoint": "x.safetensors"},
                                                       "checkpoint=")):
        m = mlp()
        with pytest.raises(NotImplementedError, match="%s: with a group the weights stream "
                           "through a sharded pool" % what):
            lt.offload(m, _backend=host_lwo.Backend(), process_group=world, **kw)
        assert lt.handle_of(m) is None and not lt.is_offloaded(m)
    with pytest.raises(ValueError, match="node_size goes with process_group"):
        lt.offload(mlp(), _backend=host_lwo.Backend(), node_size=1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    for bad in (3, 0, -2, 2.0, True, "2"):
        m = mlp()
        with pytest.raises(ValueError, match="node_size %s: it must be a positive integer that "
                           "divides the group's 4 ranks" % re.escape(repr(bad))):
            lt.offload(m, _backend=host_lwo.Backend(), process_group=world, node_size=bad)
        assert lt.handle_of(m) is None and not lt.is_offloaded(m)  # nothing changed


def test_the_node_size_defaults_to_local_world_size(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert lt._node_size(None, 4) == 4          # one node
    for env, want in (("2", 2), ("4", 4), ("3", 4), ("8", 4), ("x", 4), ("0", 4)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", env)
        assert lt._node_size(None, 4) == want, env  # where it divides the group's ranks
    assert lt._node_size(1, 4) == 1


def test_a_group_needs_torch_distributed():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        lt.offload(mlp(), _backend=host_lwo.Backend(), process_group=object())


# --------------------------------------------------------------------------
# N ranks in one process: each rank a thread with its own host engine and
# its own copy of the model, their group a stand-in for a torch.distributed
# one. lwo's communicator of it comes from the host backend's
# lwo_nccl_comm_create of N ranks, which meet by a shared 128-byte id (its
# collectives rendezvous across the threads; torch's ops and lwo's ctypes
# calls release the GIL, so the ranks run concurrently).
# --------------------------------------------------------------------------
class _Group:
    """What lwo.torch reads of a process group of `size` ranks, for rank
    `rank` (the tests' stand-in for _group_ranks and _dist_comm)."""

    def __init__(self, rank, size, uid):
        self.rank, self.size, self.uid = rank, size, uid


@pytest.fixture
def threads(monkeypatch):
    """run(n, body): body(rank, group, wait) in n threads at once (wait: a
    barrier of the n); returns the ranks' results, or raises the first
    rank's error."""
    monkeypatch.setattr(lt, "_group_ranks", lambda g: (g.rank, g.size))
    made = []

    def dist_comm(g, engine, rank, world, path):
        made.append((rank, world))
        return engine.nccl_comm_create(g.uid, world, rank), "unique-id"
    monkeypatch.setattr(lt, "_dist_comm", dist_comm)

    # a rank that fails leaves the others waiting in a collective: they fail
    # at the host communicators' deadline (120 s by default)
    prev = host_lwo.set_comm_deadline(30000)

    def run(n, body):
        uid = os.urandom(128)
        barrier = threading.Barrier(n, timeout=120)
        out, errs = [None] * n, []

        def one(r):
            try:
                out[r] = body(r, _Group(r, n, uid), barrier.wait)
            except BaseException as e:  # noqa: BLE001 - reported below
                errs.append((r, e))
                barrier.abort()
        ts = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(240)
        assert not any(t.is_alive() for t in ts), "a rank hangs (errors so far: %r)" % errs
        if errs:
            r, e = min(errs, key=lambda x: isinstance(x[1], threading.BrokenBarrierError))
            raise AssertionError("rank %d: %r" % (r, e)) from e
        assert sorted(made) == [(r, n) for r in range(n)]
        made.clear()
        return out
    yield run
    host_lwo.set_comm_deadline(prev)


def _batches(n_ranks, n_steps, seed):
    """Each rank's micro-batches: [rank][step] = (x, dy), different per rank."""
    gen = torch.Generator().manual_seed(seed)
    return [[(torch.randn(6, 12, generator=gen), torch.randn(6, 8, generator=gen))
             for _ in range(n_steps)] for _ in range(n_ranks)]


def _resident_steps(batches, n_steps, torch_opt_cls, lr=1e-2, weight_decay=0.1):
    """The resident model trained on the gradients summed over the ranks'
    micro-batches: each step's outputs per rank, its summed gradients, the
    final parameters."""
    ref = mlp()
    opt = torch_opt_cls(ref.parameters(), lr=lr, weight_decay=weight_decay)
    outs, grads = [], []
    for i in range(n_steps):
        ys = []
        for rank_batches in batches:
            x, dy = rank_batches[i]
            y = ref(x)
            y.backward(dy)  # the gradients add up over the ranks
            ys.append(y.detach().clone())
        outs.append(ys)
        grads.append({k: p.grad.clone() for k, p in ref.named_parameters()})
        opt.step()
        opt.zero_grad()
    return outs, grads, {k: p.detach().clone() for k, p in ref.named_parameters()}


def _twin_steps(batches, n_steps):
    """An offload without a group, each step's micro-batches run one after
    the other (its gradients added up on the host in rank order, as the
    host backend's collectives sum them) before one lwo.torch.optim.AdamW
    step: its outputs per step and rank, its first gradients and the final
    parameters."""
    m = mlp()
    h = lt.offload(m, _backend=host_lwo.Backend())
    opt = lopt.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    outs, grad0 = [], None
    for i in range(n_steps):
        ys = []
        for rank_batches in batches:
            x, dy = rank_batches[i]
            y = m(x)
            y.backward(dy)
            ys.append(y.detach().clone())
        outs.append(ys)
        if i == 0:
            grad0 = {k: p.grad.clone() for k, p in m.named_parameters()}
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    params = {k: p.detach().clone() for k, p in m.named_parameters()}
    h.close()
    return outs, grad0, params


def _pool_bytes(h):
    """(this rank's pool bytes, the records' bytes) of every record."""
    return (sum(h.pool.shard_host(r.index).bytes for r in h.records),
            sum(h.pool.record_bytes(r.index) for r in h.records))


def _train_ranks(threads, n, node_size, opt_kind, n_steps=10, seed=21):
    """n ranks (node_size per node) offload their copies of mlp() and train
    n_steps, each rank on its own micro-batches; per rank: the outputs,
    param.grad and param_shards() after the first backward, the parameters
    (this rank's elements) at the end, full_state_dict(), what the handle
    says of its group and pool, and the parameters after close()."""
    batches = _batches(n, n_steps, seed)
    models = [mlp() for _ in range(n)]  # the same initial weights (seeded)

    def body(r, g, wait):
        m = models[r]
        be = host_lwo.Backend()
        h = lt.offload(m, _backend=be, process_group=g, node_size=node_size)
        wait()  # every handle made before any optimizer looks for them
        info = h.pool.info()
        rep = {"rank": h.rank, "world": h.world_size, "node_size": h.node_size,
               "node": h.node, "kind": info.kind, "n_ranks": info.n_ranks,
               "pool": _pool_bytes(h), "shards": h.param_shards(),
               "shapes": {k: tuple(p.shape) for k, p in m.named_parameters()},
               "grads_threads": be.grads_sets[-1].n_threads,
               "replica": be.grads_sets[-1].replica_comm is not None,
               "host_limit": be.engine.host_usage()[0],
               "derived_limit": be.engine._lwo_derived_host_limit}
        assert all(p.data_ptr() == 0 or h.pool.shard_tensor(rec.index, name).address ==
                   p.data_ptr() for rec, p, name in _streamed(h))  # views of the pool
        opt = (lopt.AdamW if opt_kind == "lwo" else torch.optim.AdamW)(
            m.parameters(), lr=1e-2, weight_decay=0.1)
        outs = []
        for i in range(n_steps):
            x, dy = batches[r][i]
            y = m(x)
            y.backward(dy)
            outs.append(y.detach().clone())
            if i == 0:
                rep["grad0"] = {k: p.grad.clone() for k, p in m.named_parameters()}
                rep["grad_is_shard"] = all(
                    p.grad.data_ptr() == h.grads.obj.shard(rec.index, name).address
                    for rec, p, name in _streamed(h) if p.numel())
            opt.step()
            opt.zero_grad()
        if opt_kind == "lwo":
            rep["opt_threads"] = be.optims[-1].n_threads
            opt.synchronize()
        rep["outs"] = outs
        rep["params"] = {k: p.detach().clone() for k, p in m.named_parameters()}
        rep["full"] = h.full_state_dict()
        wait()
        h.close()
        rep["closed"] = {k: p.detach().clone() for k, p in m.named_parameters()}
        return rep
    return batches, threads(n, body)


def _whole(reps, name):
    """A tensor put together from the ranks' elements (param_shards) of one
    node's ranks."""
    sh = reps[0]["shards"][name]
    flat = torch.full((sh.numel,), float("nan"))
    for rep in reps:
        s = rep["shards"][name]
        assert s.shape == sh.shape
        flat[s.first:s.first + s.n_elements] = rep["params"][name].reshape(-1)
    return flat.view(sh.shape)


@pytest.mark.parametrize("n,node_size,opt_kind", [(2, 2, "lwo"), (4, 2, "lwo"),
                                                   (2, 1, "lwo"), (2, 2, "torch")])
def test_n_ranks_train_as_the_resident_model_on_the_summed_gradients(threads, n, node_size,
                                                                      opt_kind):
    # n ranks, node_size per node: 2 ranks of one node, 2 nodes of 2, and 2
    # nodes of one rank (whole parameters); lwo.torch.optim.AdamW, or
    # torch.optim.AdamW over the flat shards
    steps = 10
    batches, reps = _train_ranks(threads, n, node_size, opt_kind, steps)
    ref_outs, ref_grads, ref_params = _resident_steps(batches, steps, torch.optim.AdamW)
    # with two ranks (a sum of two: the same in any layout) and lwo's AdamW the
    # run equals an offload without a group on the same micro-batches, bit for bit
    twin = _twin_steps(batches, steps) if n == 2 and opt_kind == "lwo" else None
    cores = len(os.sched_getaffinity(0))
    names = list(ref_params)
    n_nodes = n // node_size
    for r, rep in enumerate(reps):
        # what the handle says of the group, its nodes and the pool over a node
        assert (rep["rank"], rep["world"], rep["node_size"], rep["node"]) == (
            r, n, node_size, r // node_size)
        assert (rep["kind"], rep["n_ranks"]) == (lwo.LWO_POOL_SHARDED, node_size)
        assert rep["replica"] == (n_nodes > 1)
        # the node's host threads and memory limit, shared by its ranks
        threads_ = 0 if node_size == 1 else max(1, cores // node_size)  # 0: one per core
        assert rep["grads_threads"] == threads_
        if opt_kind == "lwo":
            assert rep["opt_threads"] == threads_
        assert rep["derived_limit"] and rep["host_limit"] == rep["derived_limit"] // node_size
        # each parameter: a flat tensor of the rank's elements of the tensor
        # (over one rank: the whole tensor)
        for k in names:
            sh = rep["shards"][k]
            assert sh.shape == tuple(ref_params[k].shape)
            assert rep["shapes"][k] == (sh.shape if node_size == 1 else (sh.n_elements,))
        # forward: the resident model's outputs for the rank's micro-batch
        for i in range(steps):
            torch.testing.assert_close(rep["outs"][i], ref_outs[i][r], rtol=2e-5, atol=2e-5)
            if twin is not None:
                assert torch.equal(rep["outs"][i], twin[0][i][r]), (r, i)
        # the first gradient: the rank's elements of the sum over every rank
        assert rep["grad_is_shard"]
        for k in names:
            sh = rep["shards"][k]
            want = ref_grads[0][k].reshape(-1)[sh.first:sh.first + sh.n_elements]
            torch.testing.assert_close(rep["grad0"][k].reshape(-1), want, rtol=1e-5,
                                       atol=1e-6)
            if twin is not None:
                assert torch.equal(rep["grad0"][k].reshape(-1), twin[1][k].reshape(-1)[
                    sh.first:sh.first + sh.n_elements]), (r, k)
    # some rank holds none of some tensor (the mlp's first bias: all of it on rank 1)
    assert any(rep["shards"][k].n_elements == 0 for rep in reps for k in names) == (
        node_size > 1)
    for node in range(n_nodes):
        mine = reps[node * node_size:(node + 1) * node_size]
        # the node's ranks hold one copy of the model between them
        held = sum(rep["pool"][0] for rep in mine)
        whole = mine[0]["pool"][1]
        assert whole <= held < whole + 64 * node_size * len(ref_params), (held, whole)
        for k in names:
            # every element on exactly one rank of the node
            assert sum(rep["shards"][k].n_elements for rep in mine) == ref_params[k].numel()
            got = _whole(mine, k)
            torch.testing.assert_close(got, ref_params[k], rtol=2e-5, atol=2e-5)
            if twin is not None:
                assert torch.equal(got, twin[2][k]), k
            if node:  # the replicas: the same sums, the same updates, bit for bit
                assert torch.equal(got, _whole(reps[:node_size], k)), k
            for rep in mine:
                # full_state_dict() and close(): the whole tensors, gathered
                assert torch.equal(rep["full"][k], got), k
                assert torch.equal(rep["closed"][k], got), k


def test_two_ranks_state_dicts(threads):
    # model.state_dict(): each rank's shards; the optimizer's state_dict the
    # shards' state, which loads back into a new optimizer on the same rank;
    # close() with gradients set drops them (said in a warning)
    import warnings
    models = [mlp() for _ in range(2)]
    xs = [torch.randn(5, 12, generator=torch.Generator().manual_seed(30 + r)) for r in range(2)]
    gen = torch.Generator().manual_seed(31)
    wholes = [{k: torch.rand(p.numel(), generator=gen) for k in ("exp_avg", "exp_avg_sq",
                                                                   "master")}
              for p in mlp().parameters()]

    def body(r, g, wait):
        m = models[r]
        h = lt.offload(m, _backend=host_lwo.Backend(), process_group=g)
        wait()
        sd = m.state_dict()
        for k, sh in h.param_shards().items():
            assert sd[k].shape == (sh.n_elements,)
        opt = lopt.AdamW(m.parameters(), lr=1e-2)
        for _ in range(2):
            m(xs[r]).square().sum().backward()
            opt.step()
            opt.zero_grad()
        st = opt.state_dict()
        for (k, p), s in zip(m.named_parameters(), st["state"].values()):
            assert s["exp_avg"].shape == s["master"].shape == p.shape, k
        opt2 = lopt.AdamW(m.parameters(), lr=1e-2)
        opt2.load_state_dict(st)
        st2 = opt2.state_dict()
        for i in st["state"]:
            for k in ("exp_avg", "exp_avg_sq", "master"):
                assert torch.equal(st["state"][i][k], st2["state"][i][k])
        # whole tensors (PyTorch's own optimizer's state, say): the rank's part is taken
        shards = list(h.param_shards().values())
        whole = copy.deepcopy(st)
        for i, sh in zip(whole["state"], shards):
            for k in ("exp_avg", "exp_avg_sq", "master"):
                whole["state"][i][k] = wholes[i][k].view(sh.shape)
        opt2.load_state_dict(whole)
        st3 = opt2.state_dict()
        for i, sh in zip(whole["state"], shards):
            for k in ("exp_avg", "exp_avg_sq", "master"):
                want = wholes[i][k][sh.first:sh.first + sh.n_elements]
                assert torch.equal(st3["state"][i][k], want), (i, k)
        # the whole tensors, gathered, load back (each rank takes its elements),
        # and lwo.torch.optim's masters follow them
        full = h.full_state_dict()
        shards = h.param_shards()
        half = {k: t * 0.5 for k, t in full.items()}
        h.load_full_state_dict(half)
        for k, p in m.named_parameters():
            sh = shards[k]
            assert torch.equal(p, half[k].reshape(-1)[sh.first:sh.first + sh.n_elements]), k
        with torch.no_grad():
            m(xs[r])  # (its stages notice the write: the masters follow)
        masters = opt2.state_dict()["state"]
        for (k, p), st in zip(m.named_parameters(), masters.values()):
            assert torch.equal(st["master"], p.float()), k
        with pytest.raises(ValueError, match=r"load_full_state_dict: '0.weight' has shape "
                           r"\(12, 32\), not the model's \(32, 12\)"):
            h.load_full_state_dict(dict(full, **{"0.weight": full["0.weight"].t()}))
        m(xs[r]).square().sum().backward()
        wait()
        h.close()
        return {k: (tuple(p.shape), p.grad) for k, p in m.named_parameters()}
    with warnings.catch_warnings(record=True) as w:  # (the process's: both ranks')
        warnings.simplefilter("always")
        reps = threads(2, body)
    assert sum("close(): the gradients of 6 parameters split over 2 ranks were dropped" in
               str(x.message) for x in w) == 2
    for rep in reps:
        for k, p in mlp().named_parameters():
            assert rep[k] == (tuple(p.shape), None), k


def test_two_ranks_of_a_bf16_model(threads):
    # a bf16 parameter split over ranks: flat bf16 over the pool, its grad the
    # f32 shard of the sum (torch's grad_dtype f32 until close(), which gives
    # back bf16 and the whole tensor)
    torch.manual_seed(4)
    base = nn.Linear(16, 8).to(torch.bfloat16)
    models = [copy.deepcopy(base) for _ in range(2)]
    xs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(40 + r)).to(torch.bfloat16)
          for r in range(2)]
    ref = copy.deepcopy(base).float()
    for x in xs:
        ref(x.float()).square().sum().backward()

    def body(r, g, wait):
        m = models[r]
        h = lt.offload(m, _backend=host_lwo.Backend(), process_group=g)
        m(xs[r]).float().square().sum().backward()
        out = {}
        for k, p in m.named_parameters():
            assert (p.dtype, p.grad.dtype, p.grad_dtype) == (torch.bfloat16, torch.float32,
                                                             torch.float32), k
            out[k] = (h.param_shards()[k], p.detach().clone(), p.grad.clone())
        h.close()  # (drops the gradient shards)
        for k, p in m.named_parameters():
            assert (p.dtype, p.grad_dtype, p.grad) == (torch.bfloat16, torch.bfloat16, None), k
            assert torch.equal(p, base.state_dict()[k]), k  # whole again, as it was
        return out
    with pytest.warns(RuntimeWarning, match="close"):
        reps = threads(2, body)
    for k, p in ref.named_parameters():
        got = torch.zeros(p.numel())
        for rep in reps:
            sh, w, gr = rep[k]
            assert w.shape == gr.shape == (sh.n_elements,)
            assert torch.equal(w, base.state_dict()[k].reshape(-1)[sh.first:sh.first + w.numel()])
            got[sh.first:sh.first + sh.n_elements] = gr
        torch.testing.assert_close(got.view(p.shape), p.grad, rtol=2e-2, atol=2e-2)


def test_two_ranks_of_a_convolution(threads):
    # a Conv2d's 4-D weight split over 2 ranks (flat over the pool): two steps
    # of lwo.torch.optim.AdamW, each rank on its own images, equal bit for bit
    # to an offload without a group running both ranks' images in turn
    def net():
        torch.manual_seed(6)
        return nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.GELU(), nn.Flatten(),
                             nn.Linear(5 * 6 * 6, 4))
    gen = torch.Generator().manual_seed(50)
    xs = [[torch.randn(2, 3, 6, 6, generator=gen) for _ in range(2)] for _ in range(2)]
    models = [net() for _ in range(2)]

    def body(r, g, wait):
        m = models[r]
        h = lt.offload(m, _backend=host_lwo.Backend(), process_group=g)
        wait()
        opt = lopt.AdamW(m.parameters(), lr=1e-2)
        ys = []
        for i in range(2):
            y = m(xs[r][i])
            y.square().sum().backward()
            ys.append(y.detach().clone())
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        shapes = {k: tuple(p.shape) for k, p in m.named_parameters()}
        full = h.full_state_dict()
        wait()
        h.close()
        return ys, shapes, full

    reps = threads(2, body)
    twin = net()
    h = lt.offload(twin, _backend=host_lwo.Backend())
    opt = lopt.AdamW(twin.parameters(), lr=1e-2)
    for i in range(2):
        for r in range(2):
            y = twin(xs[r][i])
            y.square().sum().backward()
            assert torch.equal(y, reps[r][0][i]), (r, i)
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    for k, p in twin.named_parameters():
        assert sum(rep[1][k][0] for rep in reps) == p.numel() and all(
            len(rep[1][k]) == 1 for rep in reps), k   # flat, the elements split
        for rep in reps:
            assert torch.equal(rep[2][k], p.detach()), k
    h.close()
