"""lwo.torch on a GPU: outputs and gradients of streamed models against the
same models resident in PyTorch (bf16 and f32, stated tolerances), bit for
bit against lwo's own compute on resident weights, LoRA (peft) on a frozen
base, groups, a changed module order, activation checkpointing, compile,
per-record statistics, forward passes and training steps captured by
torch.cuda.graph.
Skipped without torch, without CUDA, or where lwo finds no device.

Tolerances, as the largest absolute difference over the largest absolute
value of the reference: f32 1e-4 (lwo and PyTorch both compute in full f32:
TF32 is off for both), bf16 3e-2 (outputs rounded to bf16, sums in another
order)."""

import copy
import gc

import pytest

try:
    import torch
except ImportError as e:  # not installed, or not importable here
    pytest.skip("torch is not importable: %s" % e, allow_module_level=True)
if not torch.cuda.is_available():
    pytest.skip("no CUDA device for torch", allow_module_level=True)

import lwo  # noqa: E402
import lwo.torch as lt  # noqa: E402
from torch_quant_models import (Adapted, ConvAdapted, conv_resident_reference,  # noqa: E402
                                resident_reference, train_fp8_with_lwo_adamw)
from torch_models import CheckpointedBlocks, QV, lora_twins  # noqa: E402

try:
    lt._Backend(torch.cuda.current_device())
except lwo.Error as e:  # pragma: no cover
    pytest.skip("lwo finds no device: %s" % e, allow_module_level=True)

nn = torch.nn
DEV = torch.device("cuda", torch.cuda.current_device())
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def no_tf32():
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def close(a, b, dtype, what=""):
    """Relative error ||a - b|| / ||b|| (the 2-norm over every element): a few
    elements where a ReLU flips after the runs' weights have drifted apart by
    a rounding do not decide it, a wrong result does."""
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    assert a.shape == b.shape, what
    scale = max(b.norm().item(), 1e-6)
    err = (a - b).norm().item() / scale
    assert err <= TOL[dtype], "%s: relative error %g > %g" % (what, err, TOL[dtype])


def mlp(dtype, width=256):
    return nn.Sequential(nn.Linear(192, width), nn.GELU(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, 64, bias=False)).to(dtype)


def forward_backward(m, ref, x, dtype, what):
    """m on one copy of x and ref on another, then the backward of one
    random gradient through both; compares the outputs and dx (the messages
    `what` % "output" and `what` % "dx")."""
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = m(xa), ref(xb)
    close(ya, yb, dtype, what % "output")
    g = torch.randn_like(yb)
    ya.backward(g)
    yb.backward(g)
    close(xa.grad, xb.grad, dtype, what % "dx")


def compare_training(m, ref, make_x, dtype, steps=3, lr=1e-2):
    """SGD on both (the streamed one's optimizer runs on the CPU over the
    pool); compares outputs, dx and every parameter gradient each step."""
    trained = [p for p in m.parameters() if p.requires_grad]
    trained_r = [p for p in ref.parameters() if p.requires_grad]
    # A frozen model has nothing to optimize (and SGD refuses an empty list).
    opt = torch.optim.SGD(trained, lr=lr) if trained else None
    opt_r = torch.optim.SGD(trained_r, lr=lr) if trained_r else None
    for step in range(steps):
        forward_backward(m, ref, make_x(), dtype, "%%s, step %d" % step)
        pa = dict(m.named_parameters())
        for k, q in ref.named_parameters():
            p = pa[k]
            if q.grad is None:
                assert p.grad is None, k
                continue
            assert p.grad is not None, k
            assert p.grad.device.type == "cpu" and p.grad.dtype == p.dtype
            close(p.grad, q.grad, dtype, "grad %s, step %d" % (k, step))
        assert (opt is None) == (opt_r is None)
        if opt is not None:
            opt.step()
            opt_r.step()
            opt.zero_grad()
            opt_r.zero_grad()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_training_matches_resident(dtype):
    m = mlp(dtype)
    ref = copy.deepcopy(m).to(DEV)
    h = lt.offload(m, device=DEV)
    assert m[0].weight.device.type == "cpu"
    compare_training(m, ref, lambda: torch.randn(48, 192, device=DEV, dtype=dtype), dtype)
    st = h.stats()
    assert st["ring"]["n_stages"] > 0 and st["grads"]["n_transfers"] > 0
    assert st["planner"]["mispredictions"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_base_moves_weights_host_to_device_only(dtype):
    m = mlp(dtype)
    for p in m.parameters():
        p.requires_grad_(False)
    ref = copy.deepcopy(m).to(DEV)
    h = lt.offload(m, device=DEV)
    assert h.grads is None
    compare_training(m, ref, lambda: torch.randn(3, 7, 192, device=DEV, dtype=dtype), dtype)


def test_bit_exact_against_lwo_compute_on_resident_weights():
    """The streamed forward equals lwo's linear on the same weights held in
    device memory by PyTorch (the resident path), bit for bit."""
    dtype = torch.bfloat16
    m = mlp(dtype)
    resident_w = [(l.weight.detach().to(DEV), None if l.bias is None else l.bias.detach().to(DEV))
                  for l in m if isinstance(l, nn.Linear)]
    h = lt.offload(m, device=DEV)
    eng = h.backend.engine
    x = torch.randn(64, 192, device=DEV, dtype=dtype)
    with torch.no_grad():
        y = m(x)
        ref = x
        i = 0
        for layer in m:
            if isinstance(layer, nn.Linear):
                w, b = resident_w[i]
                i += 1
                out = torch.empty(ref.shape[0], w.shape[0], device=DEV, dtype=dtype)
                d = lwo.linear_desc(w.shape[1], w.shape[0], dtype="bf16", bias=b is not None)
                eng.linear_forward(d, ref.shape[0], ref.data_ptr(), w.data_ptr(),
                                   None if b is None else b.data_ptr(), out.data_ptr(),
                                   stream=torch.cuda.current_stream())
                ref = out
            else:
                ref = layer(ref)
    assert torch.equal(y, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv2d_matches_resident(dtype):
    m = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
                      nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), nn.ReLU(),
                      nn.Conv2d(32, 32, 3, padding=1, groups=4), nn.Flatten(),
                      nn.Linear(32 * 8 * 8, 10)).to(dtype)
    ref = copy.deepcopy(m).to(DEV)
    lt.offload(m, device=DEV)
    compare_training(m, ref, lambda: torch.randn(4, 3, 16, 16, device=DEV, dtype=dtype), dtype)


class Switch(nn.Module):
    def __init__(self, n=6, d=128):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(n)])
        self.reverse = False

    def forward(self, x):
        for layer in (reversed(self.layers) if self.reverse else self.layers):
            x = torch.tanh(layer(x))
        return x


def test_changed_module_order_and_groups():
    dtype = torch.float32
    m = Switch()
    ref = copy.deepcopy(m).to(DEV)
    h = lt.offload(m, device=DEV, depth=3, group=lambda name, mod: int(name.split(".")[1]) // 2)
    assert len(h.records) == 3
    make = lambda: torch.randn(16, 128, device=DEV)  # noqa: E731
    compare_training(m, ref, make, dtype, steps=2)
    m.reverse = ref.reverse = True
    compare_training(m, ref, make, dtype, steps=3)
    st = h.stats()["planner"]
    assert st["replans"] == 1
    n = st["mispredictions"]
    compare_training(m, ref, make, dtype, steps=1)
    assert h.stats()["planner"]["mispredictions"] == n


def test_activation_checkpointing():
    dtype = torch.bfloat16
    m = CheckpointedBlocks(128, 256, 4, nn.GELU).to(dtype)
    ref = copy.deepcopy(m).to(DEV)
    lt.offload(m, device=DEV)
    compare_training(m, ref, lambda: torch.randn(32, 128, device=DEV, dtype=dtype), dtype)


def test_lora_on_a_frozen_base_with_peft():
    peft = pytest.importorskip("peft")
    dtype = torch.bfloat16
    m, ref = lora_twins(peft, QV(128, 32).to(dtype), 8)
    ref.to(DEV)
    m.to(DEV)
    h = lt.offload(m, device=DEV, filter=lambda name, mod: "lora_" not in name)
    assert h.grads is None and len(h.modules) == 3
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
    opt_r = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3)
    for step in range(3):
        x = torch.randn(16, 128, device=DEV, dtype=dtype)
        ya, yb = m(x), ref(x)
        close(ya, yb, dtype, "output")
        ya.float().square().mean().backward()
        yb.float().square().mean().backward()
        ra = dict(ref.named_parameters())
        for k, p in m.named_parameters():
            if ra[k].grad is not None:
                close(p.grad, ra[k].grad, dtype, "grad " + k)
        opt.step(); opt_r.step(); opt.zero_grad(); opt_r.zero_grad()


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_training_matches_resident(mode, dtype):
    # inductor on the device, the streamed modules as lwo's custom operators
    # (test_torch_compile.py proves the rest on the CPU); reduce-overhead:
    # CUDA graphs around them, never of them (their host work runs each call)
    torch._dynamo.reset()
    m = mlp(dtype)
    ref = copy.deepcopy(m).to(DEV)
    lt.offload(m, device=DEV, plan=False)
    x = torch.randn(8, 192, device=DEV, dtype=dtype)
    assert torch._dynamo.explain(m)(x).graph_break_count == 0
    torch._dynamo.reset()
    cm = torch.compile(m, mode=mode)
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    opt_r = torch.optim.SGD(ref.parameters(), lr=1e-2)
    for step in range(4):
        x = torch.randn(8, 192, device=DEV, dtype=dtype)
        forward_backward(cm, ref, x, dtype, "compiled %%s, step %d" % step)
        pa = dict(m.named_parameters())
        for k, q in ref.named_parameters():
            assert pa[k].grad is not None and pa[k].grad.device.type == "cpu", k
            close(pa[k].grad, q.grad, dtype, "compiled grad %s, step %d" % (k, step))
        opt.step(); opt_r.step(); opt.zero_grad(); opt_r.zero_grad()
    with torch.no_grad():
        x = torch.randn(8, 192, device=DEV, dtype=dtype)
        close(cm(x), ref(x), dtype, "compiled output under no_grad")
    torch._dynamo.reset()


def test_layer_stats_on_the_device():
    m = mlp(torch.bfloat16, width=1024)
    h = lt.offload(m, device=DEV, stats=True)
    x = torch.randn(64, 192, device=DEV, dtype=torch.bfloat16)
    for _ in range(3):
        m(x).float().sum().backward()
    ls = h.layer_stats()
    assert len(ls) == 3
    assert all(r["stages"] >= 1 for r in ls)
    assert sum(r["bytes_copied"] for r in ls) == h.stats()["ring"]["bytes_copied"]
    assert any(r["copy_ms"] > 0 for r in ls)
    assert all(r["stall_ms"] >= 0 for r in ls)


def test_timing_ring_stats():
    m = mlp(torch.bfloat16, width=1024)
    h = lt.offload(m, device=DEV, timing=True)
    x = torch.randn(64, 192, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):
            m(x)
    r = h.stats()["ring"]
    assert r["copy_ms"] > 0 and r["bandwidth_gbps"] > 0


def test_close_puts_the_weights_back_on_the_device():
    m = mlp(torch.float32)
    ref = copy.deepcopy(m).to(DEV)
    h = lt.offload(m, device=DEV)
    x = torch.randn(4, 192, device=DEV)
    m(x).sum().backward()
    h.close()
    assert m[0].weight.is_cuda and m[0].weight.grad.is_cuda
    close(m(x), ref(x), torch.float32, "restored output")


# --------------------------------------------------------------------------
# Quantized weights: pools of quantized tensors, lwo_dequantize, and
# offload(quant=...) of a frozen base with a trainable adapter beside it.
# The reference model holds the dequantized weights (lwo.quantize and
# lwo.dequantize on the host, the same rule bit for bit as the GPU's), so
# the tolerances are the dense ones above: only the GEMMs' sums differ.
# --------------------------------------------------------------------------
QUANTS = ["fp8", "fp8-block", "int8", "int4"]


@pytest.mark.parametrize("fmt", QUANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_frozen_base_with_a_trainable_adapter(fmt, dtype):
    torch.manual_seed(7)
    m = Adapted(dtype, d_hidden=512, rank=16, d_out=256, d_head=64)
    ref = resident_reference(m, fmt).to(DEV)
    h = lt.offload(m, device=DEV, quant=fmt)
    assert h.quantized == {"base0": fmt, "base1": fmt}
    for name in ("base0", "base1"):  # the parameter is what lwo computes with
        assert torch.equal(getattr(m, name).weight.to(DEV), getattr(ref, name).weight)
    quant_recs = [r for r in h.records if r.quantized]
    assert len(quant_recs) == 2
    compare_training(m, ref, lambda: torch.randn(4, 24, 256, device=DEV, dtype=dtype), dtype)
    st = h.stats()
    assert st["quant"]["saved_bytes"] == sum(r.saved_bytes for r in quant_recs) > 0
    # the quantized records moved their quantized bytes (each stage a copy or a hit)
    for r in quant_recs:
        info = h.pool.tensors(r.index)[0]
        assert info.quant == fmt and info.bytes == lwo.quant_layout(
            fmt, info.shape, info.dtype).total_bytes
    assert st["grads"]["n_transfers"] > 0


@pytest.mark.parametrize("fmt", ["fp8", "fp8-block", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_frozen_conv_base_with_a_trainable_head(fmt, dtype):
    torch.manual_seed(8)
    m = ConvAdapted(dtype)
    ref = conv_resident_reference(m, fmt).to(DEV)
    h = lt.offload(m, device=DEV, quant=fmt)
    assert h.quantized == {"base0": fmt, "base1": fmt}
    for name in ("base0", "base1"):  # the parameter is what lwo computes with
        assert torch.equal(getattr(m, name).weight.to(DEV), getattr(ref, name).weight)
    compare_training(m, ref, lambda: torch.randn(4, 16, 12, 12, device=DEV, dtype=dtype),
                     dtype)
    assert h.stats()["quant"]["saved_bytes"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trainable_fp8_block_weights_with_lwo_adamw_on_the_device(dtype):
    """quant_trainable=True on the device: fp8-block weights streamed,
    dequantized on the GPU, dW in the weights' dtype, lwo's host AdamW writing
    the records from f32 masters (torch_quant_models.train_fp8_with_lwo_adamw)."""
    train_fp8_with_lwo_adamw(
        lambda m: lt.offload(m, device=DEV, quant="fp8-block", quant_trainable=True),
        dtype, DEV, close)


def test_quantized_forward_equals_lwo_dequantize_then_the_dense_linear():
    """A streamed fp8 linear's output equals, bit for bit, lwo_dequantize of
    its quantized bytes (Engine.dequantize, itself equal to the host
    reference) followed by lwo's dense linear on that bf16 weight."""
    np = pytest.importorskip("numpy")
    dtype = torch.bfloat16
    torch.manual_seed(8)
    m = nn.Sequential(nn.Linear(512, 384)).to(dtype).requires_grad_(False)
    w_cpu = m[0].weight.detach().clone()
    b_dev = m[0].bias.detach().to(DEV)
    h = lt.offload(m, device=DEV, quant="fp8")
    eng = h.backend.engine
    q = lwo.quantize(w_cpu, "fp8")
    q_dev = torch.from_numpy(q.data.copy()).to(DEV)
    w_dev = torch.empty(384, 512, dtype=dtype, device=DEV)
    stream = torch.cuda.current_stream()
    eng.dequantize("fp8", (384, 512), q_dev.data_ptr(), w_dev.data_ptr(), dtype="bf16",
                   stream=stream)
    host = torch.from_numpy(q.dequantize("bf16").view(np.int16)).view(dtype)
    assert torch.equal(w_dev.cpu(), host)
    x = torch.randn(96, 512, device=DEV, dtype=dtype)
    with torch.no_grad():
        y = m(x)
    ref = torch.empty(96, 384, device=DEV, dtype=dtype)
    d = lwo.linear_desc(512, 384, dtype="bf16", bias=True)
    eng.linear_forward(d, 96, x.data_ptr(), w_dev.data_ptr(), b_dev.data_ptr(), ref.data_ptr(),
                       stream=stream)
    assert torch.equal(y, ref)


def test_pool_of_quantized_tensors_on_the_device():
    """Pool.write_quantized from numpy f32 and from a torch bf16 tensor: the
    pool's bytes equal lwo.quantize's, tensor_info reports the format and the
    bytes saved, and an acquired slot holds the quantized bytes."""
    np = pytest.importorskip("numpy")
    g = np.random.default_rng()
    w0 = g.standard_normal((256, 384)).astype(np.float32)
    w1 = torch.randn(128, 256, dtype=torch.bfloat16)
    layers = [[lwo.TensorSpec("w", "f32", (256, 384), quant="int8"), ("b", "f32", (256,))],
              [{"name": "w", "dtype": "bf16", "shape": (128, 256), "quant": "int4"}]]
    eng = lt._Backend(torch.cuda.current_device()).engine
    with eng.pool_pinned(layers) as pool:
        pool.write_quantized(0, "w", w0)
        pool.write_quantized(1, "w", w1)
        for layer, (src, fmt) in enumerate(((w0, "int8"), (w1, "int4"))):
            info = pool.tensors(layer)[0]
            q = lwo.quantize(src, fmt)
            assert info.quant == fmt and info.bytes == q.nbytes
            assert info.saved_bytes == q.saved_bytes > 0
            assert bytes(pool.tensor_host(layer, "w").memoryview()) == q.data.tobytes()
        assert pool.saved_bytes() == sum(pool.tensors(i)[0].saved_bytes for i in range(2))
        with pool.ring(depth=1) as ring:
            stream = torch.cuda.current_stream()
            with ring.layer(1, stream) as view:
                t = view["w"]
                assert t.dtype == lwo.LWO_DTYPE_BF16 and t.bytes == pool.tensors(1)[0].bytes
                raw = torch.empty(t.bytes, dtype=torch.uint8, device=DEV)
                src = torch.as_tensor(type("Raw", (), {"__cuda_array_interface__": {
                    "shape": (t.bytes,), "typestr": "|u1", "data": (t.data, False),
                    "version": 3, "strides": None}})(), device=DEV)
                raw.copy_(src)
            torch.cuda.synchronize()
            assert bytes(raw.cpu().numpy()) == bytes(pool.tensor_host(1, "w").memoryview())
        with pytest.raises(lwo.ArgumentError):  # a dense tensor is not quantized
            pool.write_quantized(0, "b", np.zeros(256, np.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_automatic_plan_within_a_budget(dtype):
    # the library's planner from the measured step, applied between steps:
    # training equals resident before and after it
    layers = []
    for _ in range(8):
        layers += [nn.Linear(512, 512), nn.GELU()]
    m = nn.Sequential(nn.Linear(192, 512), *layers, nn.Linear(512, 64)).to(dtype)
    ref = copy.deepcopy(m).to(DEV)
    h = lt.offload(m, device=DEV, budget="128MiB")
    compare_training(m, ref, lambda: torch.randn(64, 192, device=DEV, dtype=dtype), dtype,
                     steps=6)
    pi = h.plan_info
    assert pi is not None and "error" not in pi, pi
    assert pi["predicted_ms"] > 0 and pi["budget_bytes"] <= 128 << 20
    assert pi["records"] == h.record_names() and h.depth == pi["depth"]
    assert sum(len(r) for r in pi["records"]) == 10
    assert len(h.step_times()) == 6
    h.close()


def test_a_budget_below_the_smallest_ring_is_refused():
    m = mlp(torch.bfloat16)
    ref = copy.deepcopy(m).to(DEV)
    with pytest.raises(lwo.ResourceError, match="needs at least"):
        lt.offload(m, device=DEV, budget=4096)
    x = torch.randn(4, 192, device=DEV, dtype=torch.bfloat16)
    close(m.to(DEV)(x), ref(x), torch.bfloat16, "the model after the refusal")


# --------------------------------------------------------------------------
# offload(checkpoint=): a model built on the meta device, its streamed
# weights mapped in place from a safetensors checkpoint (random weights),
# against the same model loaded resident on the device with load_state_dict.
# --------------------------------------------------------------------------
def _ckpt_llama(tmp_path, fp8=False, shards=1, hidden=256):
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from checkpoint_models import fp8_tensors, llama, llama_config, save, tensors_of
    cfg = llama_config(hidden=hidden, vocab=512)
    tensors = tensors_of(llama(cfg))
    dense = tensors
    if fp8:
        tensors, dense = fp8_tensors(tensors)
    return cfg, dense, save(tensors, str(tmp_path), shards=shards)


def _ckpt_lora_steps(m, ref, steps=6, tol=3e-2):
    """LoRA (peft, made after offload) on the streamed base and on the
    resident reference: losses and adapter gradients each step."""
    peft = pytest.importorskip("peft")
    lcfg = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                           target_modules=["q_proj", "v_proj", "down_proj"])
    for p in ref.parameters():
        p.requires_grad_(False)
    torch.manual_seed(11)
    m = peft.get_peft_model(m, lcfg).to(DEV)
    torch.manual_seed(11)
    ref = peft.get_peft_model(ref, lcfg).to(DEV)
    trained = [p for p in m.parameters() if p.requires_grad]
    trained_r = [p for p in ref.parameters() if p.requires_grad]
    assert trained and all(p.is_cuda for p in trained)
    # SGD: an update in proportion to the gradient (AdamW's first steps are
    # about lr x sign(g), which turns roundings of a gradient near 0 into
    # different adapters)
    opt = torch.optim.SGD(trained, lr=0.5)
    opt_r = torch.optim.SGD(trained_r, lr=0.5)
    gen = torch.Generator().manual_seed(5)
    for step in range(steps):
        ids = torch.randint(0, 512, (2, 64), generator=gen).to(DEV)
        la, lb = m(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
        assert abs(la.item() - lb.item()) <= tol * abs(lb.item()), (step, la.item(), lb.item())
        la.backward()
        lb.backward()
        for p, q in zip(trained, trained_r):
            close(p.grad, q.grad, torch.bfloat16, "adapter grad, step %d" % step)
        opt.step(); opt_r.step(); opt.zero_grad(); opt_r.zero_grad()
    return m


@pytest.mark.parametrize("shards", [1, 2])
def test_checkpoint_mapped_llama_matches_resident(tmp_path, shards):
    from checkpoint_models import llama, resident
    cfg, tensors, path = _ckpt_llama(tmp_path, shards=shards)
    ref = resident(lambda: llama(cfg), tensors, device=DEV)
    m = llama(cfg, meta=True)
    h = lt.offload(m, device=DEV, checkpoint=path)
    assert h.checkpoint_info["pool"] == "checkpoint-mapped"  # registered in place
    assert len(h.checkpoint_info["files"]) == shards
    assert m.model.embed_tokens.weight.is_cuda and m.model.rotary_emb.inv_freq.is_cuda
    ids = torch.randint(0, 512, (2, 48), device=DEV)
    with torch.no_grad():
        close(m(input_ids=ids).logits, ref(input_ids=ids).logits, torch.bfloat16, "logits")
    _ckpt_lora_steps(m, ref)
    # the plan ran over the mapped pool (regrouped over the same file bytes)
    assert h.plan_info is not None and "error" not in h.plan_info, h.plan_info


def test_checkpoint_fp8_base_with_lora_matches_dequantized_resident(tmp_path):
    from checkpoint_models import llama, resident
    cfg, dense, path = _ckpt_llama(tmp_path, fp8=True)
    ref = resident(lambda: llama(cfg), dense, device=DEV)
    m = llama(cfg, meta=True)
    h = lt.offload(m, device=DEV, checkpoint=path)
    assert h.checkpoint_info["pool"] == "checkpoint-mapped"
    assert len(h.checkpoint_info["fp8"]) == 14
    assert set(h.quantized.values()) == {"fp8-block"}
    ids = torch.randint(0, 512, (2, 48), device=DEV)
    with torch.no_grad():
        close(m(input_ids=ids).logits, ref(input_ids=ids).logits, torch.bfloat16, "logits")
    _ckpt_lora_steps(m, ref)


def test_checkpoint_with_quant_quantizes_from_the_mapped_bytes(tmp_path):
    from checkpoint_models import llama, resident
    from torch_quant_models import dequantized
    cfg, tensors, path = _ckpt_llama(tmp_path)
    m = llama(cfg, meta=True)
    for p in m.parameters():
        p.requires_grad_(False)
    h = lt.offload(m, device=DEV, checkpoint=path, quant="fp8")
    assert h.checkpoint_info["pool"] == "pinned" and len(h.quantized) == 15
    q = {k: dequantized(v, "fp8") if k.endswith("proj.weight") or k == "lm_head.weight" else v
         for k, v in tensors.items()}
    ref = resident(lambda: llama(cfg), q, device=DEV)
    ids = torch.randint(0, 512, (2, 48), device=DEV)
    with torch.no_grad():
        close(m(input_ids=ids).logits, ref(input_ids=ids).logits, torch.bfloat16, "logits")


def test_checkpoint_mapping_adds_no_host_copy(tmp_path):
    """Host memory beyond the page cache (RssAnon) grows by far less than the
    streamed bytes: the pool and the parameters are the mapped file."""
    from checkpoint_models import rss_anon, save, tensors_of, trim_heap

    if rss_anon() is None:
        pytest.skip("no RssAnon")

    def model():
        return nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(16)],
                             nn.LayerNorm(4096)).to(torch.bfloat16)

    src = model()
    tensors = tensors_of(src)
    path = save(tensors, str(tmp_path))
    streamed = 16 * 4096 * 4096 * 2
    ref = src.to(DEV)
    del src, tensors
    with torch.device("meta"):
        m = model()
    torch.cuda.synchronize()
    trim_heap()  # what the writer freed goes back to the system: a copy would show
    before = rss_anon()
    h = lt.offload(m, device=DEV, checkpoint=path)
    grew = rss_anon() - before
    assert h.checkpoint_info["pool"] == "checkpoint-mapped"
    assert grew < 0.1 * streamed, "RssAnon grew %d bytes for %d streamed" % (grew, streamed)
    x = torch.randn(8, 4096, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        close(m(x), ref(x), torch.bfloat16, "output")


# --------------------------------------------------------------------------
# lwo.torch.optim: lwo's host optimizer from PyTorch
# --------------------------------------------------------------------------
class NormNet(nn.Module):
    """Streamed linears around a LayerNorm that stays on the GPU."""

    def __init__(self, width=256):
        super().__init__()
        self.a = nn.Linear(192, width)
        self.norm = nn.LayerNorm(width)
        self.b = nn.Linear(width, width)
        self.c = nn.Linear(width, 64, bias=False)

    def forward(self, x):
        return self.c(torch.nn.functional.gelu(self.b(self.norm(self.a(x)))))


def updated_like(m, ref, start, what, tol=1e-3):
    """Each parameter's change since `start` against the reference's, as
    close() measures it (the change, not the weight: a wrong update shows)."""
    pr = dict(ref.named_parameters())
    for k, p in m.named_parameters():
        a = p.detach().float().cpu() - start[k]
        b = pr[k].detach().float().cpu() - start[k]
        err = (a - b).norm().item() / max(b.norm().item(), 1e-12)
        assert err <= tol, "%s: %s changed by a relative error %g > %g" % (what, k, err, tol)


@pytest.mark.parametrize("variant", ["plain", "clip", "in_backward", "bf16_state", "sgd"])
def test_host_optimizer_matches_pytorchs_on_the_device(variant):
    m = NormNet()
    ref = copy.deepcopy(m).to(DEV)
    start = {k: p.detach().float().clone() for k, p in m.named_parameters()}
    # the plan regroups at step 3; the budget holds lwo's compute workspaces
    # (32 MiB for each stream the process used it on, 98 MiB after the suite's
    # earlier tests)
    h = lt.offload(m, device=DEV, budget="512MiB")
    kw = {"clip": {"max_norm": 0.5}, "in_backward": {"in_backward": True},
          "bf16_state": {"state": "bf16"}}.get(variant, {})
    if variant == "sgd":
        opt = lt.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9)
        opt_r = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
    else:
        opt = lt.optim.AdamW(m.parameters(), lr=1e-3, **kw)
        opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for step in range(6):
        x = torch.randn(64, 192, device=DEV)
        ya, yb = m(x), ref(x)
        # the weights drift apart by roundings as the steps go on (AdamW
        # divides by the gradients' size): the output within 1e-3
        err = (ya - yb).float().norm().item() / yb.float().norm().item()
        assert err <= 1e-3, "%s: output, step %d: relative error %g" % (variant, step, err)
        g = torch.randn_like(yb) * (8 if variant == "clip" else 1)
        ya.backward(g)
        yb.backward(g)
        opt.step()
        if variant == "clip":
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            assert norm > 0.5
        opt_r.step()
        opt.zero_grad()
        opt_r.zero_grad()
    opt.synchronize()
    assert h.plan_info is not None and "error" not in h.plan_info, h.plan_info
    updated_like(m, ref, start, variant, tol=2e-2 if variant == "bf16_state" else 1e-3)
    st = opt.stats()[0]
    assert st.n_steps >= 3  # steps after the plan's rebuild, on the new optimizer
    if variant == "clip":
        assert st.n_clipped == st.n_steps
    sd = opt.state_dict()
    pa = dict(m.named_parameters())
    for i, (k, p) in enumerate(m.named_parameters()):
        if k.startswith("norm"):
            continue
        st0 = sd["state"][i]
        assert torch.equal(st0["master"].to(p.dtype), p.detach().cpu()), k
    h.close()


def test_host_adamw_state_dict_round_trip_on_the_device():
    m = NormNet()
    m2 = copy.deepcopy(m)
    xs = [torch.randn(32, 192, device=DEV) for _ in range(6)]
    gs = [torch.randn(32, 64, device=DEV) for _ in range(6)]

    def steps(model, opt, a, b):
        for x, g in zip(xs[a:b], gs[a:b]):
            model(x).backward(g)
            opt.step()
            opt.zero_grad()
        opt.synchronize()

    h = lt.offload(m, device=DEV, plan=False)
    opt = lt.optim.AdamW(m.parameters(), lr=1e-3)
    steps(m, opt, 0, 3)
    buf = __import__("io").BytesIO()
    torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, buf)
    at_save = {k: p.detach().float().cpu().clone() for k, p in m.named_parameters()}
    steps(m, opt, 3, 6)
    buf.seek(0)
    saved = torch.load(buf)
    m2.load_state_dict(saved["model"])
    h2 = lt.offload(m2, device=DEV, plan=False)
    opt2 = lt.optim.AdamW(m2.parameters(), lr=1e-3)
    opt2.load_state_dict(saved["opt"])
    steps(m2, opt2, 3, 6)
    # the same updates from the saved state (moments started afresh would
    # change them by a large fraction; GEMMs may round apart by an ulp)
    updated_like(m2, m, at_save, "after the round trip", tol=1e-3)
    h.close()
    h2.close()


def test_host_adamw_delayed_update_on_the_device():
    m = NormNet()
    m.norm.requires_grad_(False)  # every trainable parameter streamed (and delayed)
    h = lt.offload(m, device=DEV, plan=False)
    opt = lt.optim.AdamW(m.parameters(), lr=1e-3, delayed=True)
    x = torch.randn(32, 192, device=DEV)
    y0 = m(x).detach()
    m(x).backward(torch.randn_like(y0))
    opt.step()
    opt.zero_grad()
    y1 = m(x)  # the pool lags the masters by one step
    assert torch.equal(y1.detach(), y0)
    y1.backward(torch.randn_like(y0))
    opt.step()
    opt.synchronize()  # the pool catches up
    sd = opt.state_dict()
    assert torch.equal(sd["state"][0]["master"].to(m.a.weight.dtype), m.a.weight.detach().cpu())
    assert not torch.equal(m(x).detach(), y0)
    h.close()


# --------------------------------------------------------------------------
# CUDA graphs: forward passes captured with torch.cuda.graph (the ring joins
# torch's capture) and replayed, against a twin handle run eagerly (bit for
# bit) and the model resident (within tolerance). The host rewrites streamed
# weights through their parameters between replays, after a synchronize;
# a replay copies them as they are then. They run on the way the installed
# torch offers (test_cuda_graph_capture_path): torch's capture hooks (torch
# 2.14 on), or lwo.torch's wrappers of torch.cuda.CUDAGraph's methods.
# --------------------------------------------------------------------------
def test_cuda_graph_capture_path():
    lt.offload(mlp(torch.float32), device=DEV, plan=False)
    graphs = torch.cuda.graphs
    if hasattr(graphs, "register_graph_capture_start_hook"):
        assert lt._capture_hooks == "hooks"
        assert lt._capture_started in graphs._global_capture_start_hooks.values()
    else:
        assert lt._capture_hooks == "wrappers"
        for name in ("capture_begin", "capture_end", "replay", "reset"):
            assert getattr(torch.cuda.CUDAGraph, name)._lwo_wraps is not None, name
    assert torch.cuda.graphs.CUDAGraph is torch.cuda.CUDAGraph


def _warm(m, x, stream, steps=3):
    """The eager warm-up on the stream the capture will use (lwo allocates a
    stream's workspace and times a shape's algorithms at their first call)."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(steps):
            y = m(x)
    torch.cuda.current_stream().wait_stream(stream)
    return y


def _capture(m, x, stream):
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g, stream=stream):
        y = m(x)
    return g, y


def _replays(g, static_x, static_y, m, twin, ref, writes, dtype, n=20):
    """n replays of g, new inputs each time; before every third one the host
    writes `writes(model)` into m, twin and ref alike. Each output equals
    twin's eager output bit for bit and ref's within tolerance."""
    changed = 0
    for i in range(n):
        static_x.copy_(torch.randn_like(static_x))
        if i % 3 == 1:
            torch.cuda.synchronize()  # no replay reads the pool while the host writes it
            with torch.no_grad():
                for mm in (m, twin, ref):
                    writes(mm)
            changed += 1
        g.replay()
        with torch.no_grad():
            yt, yr = twin(static_x), ref(static_x)
        torch.cuda.synchronize()
        assert torch.equal(static_y, yt), "replay %d differs from eager lwo" % i
        close(static_y, yr, dtype, "replay %d against resident" % i)
    assert changed == len(range(1, n, 3))


def _scale_weight(*names):
    def write(mm):
        params = dict(mm.named_parameters())
        for name in names:
            p = params[name]
            p.mul_(0.75)
            p.add_(0.01)
    return write


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_of_an_mlp_replays_with_the_hosts_writes(dtype):
    m = mlp(dtype).requires_grad_(False)
    twin, ref = copy.deepcopy(m), copy.deepcopy(m).to(DEV)
    h = lt.offload(m, device=DEV, plan=False)
    lt.offload(twin, device=DEV, plan=False)
    s = torch.cuda.Stream()
    static_x = torch.randn(48, 192, device=DEV, dtype=dtype)
    _warm(m, static_x, s)
    g, static_y = _capture(m, static_x, s)
    assert h.cuda_graph is g
    # the first two records are read where the eager steps left them (the
    # ring captures warm): a write through their parameters is seen too
    _replays(g, static_x, static_y, m, twin, ref,
             _scale_weight("0.weight", "2.weight", "4.weight"), dtype)
    # eager use waits for the graph's release
    with pytest.raises(lwo.StateError, match="holds this handle's lwo ring"):
        with torch.no_grad():
            m(static_x)
    del g
    torch.cuda.synchronize()
    assert h.cuda_graph is None
    x = torch.randn(48, 192, device=DEV, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(m(x), twin(x))


class _Block(nn.Module):
    """The benchmark's block (scripts/torch-offload-bench) at a small size."""

    def __init__(self, d=128, ff=512, heads=4):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.norm2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, ff)
        self.down = nn.Linear(ff, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (f(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


def test_cuda_graph_of_the_block_model_with_its_plan():
    dtype = torch.bfloat16
    m = nn.Sequential(*[_Block() for _ in range(6)]).to(dtype).requires_grad_(False)
    twin, ref = copy.deepcopy(m), copy.deepcopy(m).to(DEV)
    groups = ["%d" % i for i in range(6)]
    h = lt.offload(m, device=DEV, group=groups)  # the automatic plan: depth, residents
    lt.offload(twin, device=DEV, group=groups, plan=False)
    s = torch.cuda.Stream()
    static_x = torch.randn(2, 64, 128, device=DEV, dtype=dtype)
    _warm(m, static_x, s, steps=6)
    assert h.plan_info is not None and "error" not in h.plan_info, h.plan_info
    g, static_y = _capture(m, static_x, s)
    streamed = [r for r in h.records if not r.resident]
    assert streamed
    name = streamed[-1].modules[0].name + ".weight"
    _replays(g, static_x, static_y, m, twin, ref, _scale_weight(name), dtype)
    if h.resident:  # a resident record written after the capture: the replay is refused
        rname = h.records[h.resident[0]].modules[0].name + ".bias"
        torch.cuda.synchronize()
        with torch.no_grad():
            dict(m.named_parameters())[rname].add_(1.0)
        with pytest.raises(lwo.StateError, match="resident"):
            g.replay()
    assert h.release_graph()
    with pytest.raises(lwo.StateError, match="no longer holds"):
        g.replay()


def test_cuda_graph_resident_records_and_their_writes():
    dtype = torch.float32
    m = mlp(dtype).requires_grad_(False)
    twin, ref = copy.deepcopy(m), copy.deepcopy(m).to(DEV)
    h = lt.offload(m, device=DEV, plan=False)
    h._apply([(0, 1, True), (1, 1, False), (2, 1, False)], 2)  # the first record resident
    lt.offload(twin, device=DEV, plan=False)
    s = torch.cuda.Stream()
    static_x = torch.randn(48, 192, device=DEV, dtype=dtype)
    _warm(m, static_x, s)
    torch.cuda.synchronize()
    with torch.no_grad():  # written before the capture: the join uploads it
        for mm in (m, twin, ref):
            mm[0].weight.mul_(0.5)
    g, static_y = _capture(m, static_x, s)
    with pytest.raises(lwo.StateError, match="lwo_pool_layer_changed"):
        h.mark_changed(m[0])  # the library holds a resident layer for the graph
    _replays(g, static_x, static_y, m, twin, ref, _scale_weight("4.weight"), dtype, n=9)
    with torch.no_grad():
        m[0].weight.mul_(2.0)
    with pytest.raises(lwo.StateError, match="record 0"):
        g.replay()
    g.reset()  # gives the ring back
    x = torch.randn(48, 192, device=DEV, dtype=dtype)
    with torch.no_grad():
        twin[0].weight.mul_(2.0)
        assert torch.equal(m(x), twin(x))


def test_cuda_graph_of_convolutions():
    dtype = torch.float32
    m = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
                      nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(),
                      nn.Linear(32 * 8 * 8, 10)).to(dtype).requires_grad_(False)
    twin, ref = copy.deepcopy(m), copy.deepcopy(m).to(DEV)
    lt.offload(m, device=DEV, plan=False)
    lt.offload(twin, device=DEV, plan=False)
    s = torch.cuda.Stream()
    static_x = torch.randn(4, 3, 16, 16, device=DEV, dtype=dtype)
    _warm(m, static_x, s)
    g, static_y = _capture(m, static_x, s)
    _replays(g, static_x, static_y, m, twin, ref, _scale_weight("2.weight"), dtype, n=9)


def test_cuda_graph_refusals():
    dtype = torch.bfloat16
    m = mlp(dtype)  # trainable
    ref = copy.deepcopy(m).to(DEV)
    h = lt.offload(m, device=DEV, plan=False)
    s = torch.cuda.Stream()
    x = torch.randn(48, 192, device=DEV, dtype=dtype)
    _warm(m, x, s)
    if torch.torch_version.TorchVersion(torch.__version__) < "2.14":
        # torch 2.10-2.13's make_graphed_callables captures on torch.cuda.graph's
        # stream: warm there, or the capture is refused as cold before the backward
        _warm(m, x, torch.cuda.graph(torch.cuda.CUDAGraph()).capture_stream)
    # make_graphed_callables' training is not captured: its warm-up's
    # torch.autograd.grad over the parameters fails first (lwo's weight
    # gradients never go through autograd), and with allow_unused_input=True
    # its backward is a second graph while the forward's holds the ring
    xg = x.clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="allow_unused"):
        torch.cuda.make_graphed_callables(m, (xg,))
    with pytest.raises(lwo.ArgumentError, match="make_graphed_callables"):
        torch.cuda.make_graphed_callables(m, (xg,), allow_unused_input=True)
    gc.collect()
    h.release_graph()  # the forward's graph, if something still keeps it
    assert h.cuda_graph is None
    m.zero_grad()  # the warm-ups' backward passes summed into param.grad
    # a capture on a stream lwo never computed on (torch hands out streams
    # from a pool of 32: one the earlier tests did not use)
    cold = next(c for c in (torch.cuda.Stream() for _ in range(64))
                if not h.backend.stream_warm(c.cuda_stream))
    g = torch.cuda.CUDAGraph()
    cap = torch.cuda.graph(g, stream=cold)
    with pytest.raises(lwo.StateError, match="stream=s"):
        with torch.no_grad(), cap:
            m(x)
    assert h.cuda_graph is None
    del g, cap
    # training goes on eagerly, right
    compare_training(m, ref, lambda: torch.randn(48, 192, device=DEV, dtype=dtype), dtype,
                     steps=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_of_a_training_step_replays_equal_eager_steps(dtype):
    """A training step (forward and backward) captured with torch.cuda.graph,
    lwo.torch.optim's SGD stepping after each replay, against a twin handle
    trained eagerly on the same inputs: the gradients and the weights equal
    the twin's bit for bit over the replays, and the model trains eagerly
    after the graph."""
    from lwo.torch import optim as lopt
    m = mlp(dtype)
    twin = copy.deepcopy(m)
    h = lt.offload(m, device=DEV, plan=False)
    lt.offload(twin, device=DEV, plan=False)
    opt, opt_t = (lopt.SGD(mm.parameters(), lr=1e-2) for mm in (m, twin))
    s = torch.cuda.Stream()
    static_x = torch.randn(48, 192, device=DEV, dtype=dtype)

    def step(mm, x):
        loss = mm(x).float().square().mean()
        loss.backward()
        return loss

    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up on the stream of the capture
        for mm, o in ((m, opt), (twin, opt_t)):
            step(mm, static_x)
            o.step()
            o.zero_grad()
    torch.cuda.current_stream().wait_stream(s)
    opt.synchronize()
    opt_t.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        static_loss = step(m, static_x)
    assert h.cuda_graph is g
    for i in range(6):
        static_x.copy_(torch.randn_like(static_x))
        g.replay()
        torch.cuda.synchronize()
        h.synchronize()  # the gradient fence
        loss_t = step(twin, static_x)
        torch.cuda.synchronize()
        assert torch.equal(static_loss, loss_t), "replay %d: the loss" % i
        for (n, p), q in zip(m.named_parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad), "replay %d: %s.grad" % (i, n)
        opt.step()
        opt_t.step()
        opt_t.zero_grad()
        opt.synchronize()
        opt_t.synchronize()
        for (n, p), q in zip(m.named_parameters(), twin.parameters()):
            assert torch.equal(p.detach(), q.detach()), "replay %d: %s" % (i, n)
    del g
    torch.cuda.synchronize()
    assert h.cuda_graph is None
    opt.zero_grad()
    x = torch.randn(48, 192, device=DEV, dtype=dtype)
    step(m, x)
    step(twin, x)
    for p, q in zip(m.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_cuda_graph_a_capture_lwo_did_not_join_is_refused():
    """A capture begun below torch's Python layer (torch._C._CUDAGraph's own
    capture_begin: neither torch's hooks nor lwo.torch's wrappers see it):
    the streamed model's step is refused before lwo enqueues anything, and
    the capture ends as usual."""
    dtype = torch.float32
    m = mlp(dtype).requires_grad_(False)
    twin = copy.deepcopy(m)
    h = lt.offload(m, device=DEV, plan=False)
    lt.offload(twin, device=DEV, plan=False)
    s = torch.cuda.Stream()
    x = torch.randn(48, 192, device=DEV, dtype=dtype)
    _warm(m, x, s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        torch._C._CUDAGraph.capture_begin(g, pool=None, capture_error_mode="global")
        try:
            with pytest.raises(lwo.StateError, match="has not joined") as e:
                with torch.no_grad():
                    m(x)
        finally:
            g.capture_end()  # nothing of lwo's in it: it ends
    assert "linear '0'" in str(e.value) and "torch.cuda.graph(g, stream=s)" in str(e.value)
    assert h.cuda_graph is None
    del g, e
    with torch.no_grad():
        assert torch.equal(m(x), twin(x))


def test_make_graphed_callables_for_inference():
    dtype = torch.bfloat16
    m = mlp(dtype).requires_grad_(False)
    ref = copy.deepcopy(m).to(DEV)
    h = lt.offload(m, device=DEV, plan=False)
    x = torch.randn(48, 192, device=DEV, dtype=dtype)
    if torch.torch_version.TorchVersion(torch.__version__) < "2.14":
        # torch 2.10-2.13's make_graphed_callables warms up on a stream of its own and
        # captures on torch.cuda.graph's: lwo must have computed on that one first
        s = torch.cuda.graph(torch.cuda.CUDAGraph()).capture_stream
        if not h.backend.stream_warm(s.cuda_stream):
            with pytest.raises(lwo.StateError, match="lwo has not computed on this stream"):
                torch.cuda.make_graphed_callables(m, (x,))
            assert h.cuda_graph is None
        _warm(m, x, s)
    gm = torch.cuda.make_graphed_callables(m, (x,))
    assert h.cuda_graph is not None
    for i in range(5):
        xi = torch.randn_like(x)
        close(gm(xi), ref(xi), dtype, "graphed call %d" % i)
    assert h.release_graph()
    with pytest.raises(lwo.StateError, match="no longer holds"):
        gm(x)
