"""lwo.torch.offload(checkpoint=) without a GPU, over the real library
on its host backend (host_lwo; its checkpoint pools are the library's own,
mapping the files): models built on the meta device
read from safetensors files (one file, the shards of an index, fp8 weights
with block scales) against the same models loaded resident with
load_state_dict; the parameters over the mapped file bytes (no copy, host
memory); what the file and the model disagree on (missing, extra, dtypes,
shapes, tied weights); quant= and checkpoint_copy= (the pinned pool); LoRA on
the mapped base; the plan's regrouping of a mapped pool; writes refused."""

import ctypes
import gc
import json
import os

import pytest

try:
    import torch
except ImportError as e:  # not installed, or not importable here
    pytest.skip("torch is not importable: %s" % e, allow_module_level=True)
pytest.importorskip("safetensors")
transformers = pytest.importorskip("transformers")
nn = torch.nn

import lwo  # noqa: E402
import lwo.torch as lt  # noqa: E402

import host_lwo  # noqa: E402
from checkpoint_models import (SCALE, fp8_tensors, llama, llama_config, resident,  # noqa: E402
                               rss_anon, save, tensors_of, trim_heap)

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def close(a, b, dtype, what=""):
    a, b = a.detach().float(), b.detach().float()
    assert a.shape == b.shape, what
    err = (a - b).norm().item() / max(b.norm().item(), 1e-6)
    assert err <= TOL[dtype], "%s: relative error %g > %g" % (what, err, TOL[dtype])


def offload(model, backend=None, **kw):
    be = backend or host_lwo.Backend()
    return lt.offload(model, _backend=be, **kw), be


def file_mapping_of(address):
    """The path of the file mapping that holds `address` (/proc/self/maps), or None."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                return parts[5] if len(parts) > 5 else None
    return None


needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/maps"),
                                reason="no /proc/self/maps")


@pytest.fixture
def tiny(tmp_path):
    """(config, the reference tensors, path of one bf16 file)."""
    cfg = llama_config()
    tensors = tensors_of(llama(cfg))
    return cfg, tensors, save(tensors, str(tmp_path))


def compare_logits(m, ref, dtype=torch.bfloat16, steps=2):
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 10), generator=gen)
        with torch.no_grad():
            close(m(input_ids=ids).logits, ref(input_ids=ids).logits, dtype, "logits")


def train_both(m, ref, opt, opt_r, seed, steps, tol, tokens=8, each_step=None):
    """Trains m and ref side by side for steps on the same random token ids
    (a generator seeded with seed), their losses within tol at every step;
    each_step() runs after the backward passes, before the optimizers step."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, tokens), generator=gen)
        la, lb = m(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
        assert abs(la.item() - lb.item()) < tol, (la.item(), lb.item())
        la.backward()
        lb.backward()
        if each_step is not None:
            each_step()
        opt.step(); opt_r.step(); opt.zero_grad(); opt_r.zero_grad()


# --------------------------------------------------------------------------
@needs_proc
@pytest.mark.parametrize("shards", [1, 3])
def test_a_meta_llama_streams_its_mapped_checkpoint(tmp_path, shards):
    cfg = llama_config()
    tensors = tensors_of(llama(cfg))
    path = save(tensors, str(tmp_path), shards=shards)
    ref = resident(lambda: llama(cfg), tensors)
    m = llama(cfg, meta=True)
    h, be = offload(m, checkpoint=path)
    info = h.checkpoint_info
    assert info["pool"] == "checkpoint-mapped" and len(info["files"]) == shards
    assert info["mapped_bytes"] == sum(os.path.getsize(f) for f in info["files"])
    streamed = [n for n in tensors if n.endswith("proj.weight") or n == "lm_head.weight"]
    assert sorted(info["streamed"]) == sorted(streamed)
    assert sorted(info["resident"]) == sorted(set(tensors) - set(streamed))
    assert info["unmatched"] == [] and info["kept"] == [] and info["cast"] == {}
    assert info["initialized"] == ["model.rotary_emb.inv_freq",
                                   "model.rotary_emb.original_inv_freq"]
    assert info["seconds"] > 0
    assert host_lwo.is_checkpoint_pool(be.pools[0])
    # no tensor is left on the meta device; the rotary buffers were made by the
    # model's own _init_weights, equal to the reference's
    assert all(t.device.type != "meta" for t in list(m.parameters()) + list(m.buffers()))
    assert torch.equal(m.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    # the streamed parameters are the file's bytes, frozen; the rest are copies
    files = {os.path.realpath(f) for f in info["files"]}
    for name, mod in h.modules.items():
        w = mod.weight
        assert w.device.type == "cpu" and not w.requires_grad, name
        assert os.path.realpath(file_mapping_of(w.data_ptr())) in files, name
        assert torch.equal(w, tensors[name + ".weight"]), name
    assert file_mapping_of(m.model.norm.weight.data_ptr()) not in files
    assert m.model.norm.weight.requires_grad  # the model's own requires_grad
    compare_logits(m, ref)


def test_the_pool_reads_the_file_in_place_and_keeps_its_layout(tiny):
    cfg, tensors, path = tiny
    m = llama(cfg, meta=True)
    h, be = offload(m, checkpoint=path, group=["model.layers.0", "model.layers.1"], plan=False)
    pool = be.pools[0]
    with lwo.Checkpoint(path) as ck:
        by_name = {t.name: t for t in ck.tensors()}
    bases = set()
    probe = lwo.Ring(pool, depth=1)  # what a stage of each record copies
    for rec in h.records:
        infos = pool.tensors(rec.index)
        assert rec.names == [i.name for i in infos]
        lo = min(by_name[n].file_offset for n in rec.names)
        hi = max(by_name[n].file_offset + by_name[n].bytes for n in rec.names)
        for i in infos:  # the tensors lie together in the file: the file's layout, one run
            assert i.offset == by_name[i.name].file_offset - lo
            bases.add(pool.tensor_host(rec.index, i.name).address - by_name[i.name].file_offset)
        before = probe.stats()
        probe.release(probe.stage(rec.index))
        after = probe.stats()
        assert after.n_copies - before.n_copies == 1
        assert after.bytes_copied - before.bytes_copied == hi - lo
    probe.close()
    # in place: every tensor at its offset in one mapping of the file
    assert len(bases) == 1
    if os.path.exists("/proc/self/maps"):
        assert file_mapping_of(bases.pop() + 8) == os.path.realpath(path)
    assert len(h.records) == 3  # two blocks and lm_head
    ref = resident(lambda: llama(cfg), tensors)
    compare_logits(m, ref)
    st = h.stats()["ring"]
    assert st["n_copies"] > 0


@needs_proc
def test_offload_adds_no_copy_of_the_streamed_weights_to_host_memory(tmp_path):
    if rss_anon() is None:
        pytest.skip("no RssAnon in /proc/self/status")

    def model():
        return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)], nn.LayerNorm(1024))

    src = model()
    path = save(tensors_of(src), str(tmp_path))
    streamed = sum(p.numel() * 4 for mod in src[:16] for p in mod.parameters())
    del src
    with torch.device("meta"):
        m = model()
    gc.collect()
    trim_heap()  # what the writer freed goes back to the system: a copy would show
    before = rss_anon()
    h, be = offload(m, checkpoint=path, plan=False)
    gc.collect()
    grew = rss_anon() - before
    ring = 2 * host_lwo.max_record(be.pools[0])  # the host backend's "device" slots are host memory
    resident_bytes = 2 * 1024 * 4      # the LayerNorm
    assert streamed == 16 * (1024 * 1024 + 1024) * 4
    # a copy of the streamed weights would be 64 MiB; lwo's tables and the
    # interpreter's own allocations are a few MiB
    assert grew <= 1.1 * resident_bytes + ring + (8 << 20), (grew, streamed)
    x = torch.randn(3, 1024)
    with torch.no_grad():
        ref = model()
        ref.load_state_dict(tensors_of_file(path))
        close(m(x), ref(x), torch.float32)


def tensors_of_file(path):
    from safetensors.torch import load_file
    return load_file(path)


def test_a_folder_and_a_sharded_index_are_found(tmp_path):
    cfg = llama_config()
    tensors = tensors_of(llama(cfg))
    save(tensors, str(tmp_path / "one"))
    save(tensors, str(tmp_path / "sharded"), shards=2)
    for folder in ("one", "sharded"):
        m = llama(cfg, meta=True)
        h, _be = offload(m, checkpoint=tmp_path / folder)
        assert len(h.checkpoint_info["files"]) == (1 if folder == "one" else 2)
    with pytest.raises(ValueError, match="holds no .safetensors"):
        offload(llama(cfg, meta=True), checkpoint=tmp_path)


# --------------------------------------------------------------------------
# What the file and the model disagree on
# --------------------------------------------------------------------------
def test_a_tensor_the_model_needs_is_missing(tiny, tmp_path):
    cfg, tensors, _path = tiny
    cut = dict(tensors)
    del cut["model.layers.1.mlp.down_proj.weight"], cut["model.norm.weight"]
    path = save(cut, str(tmp_path / "cut"))
    m = llama(cfg, meta=True)
    with pytest.raises(lwo.ArgumentError) as info:
        offload(m, checkpoint=path)
    msg = str(info.value)
    assert info.value.status == lwo.LWO_ERR_NOT_FOUND
    assert "2 tensors the model needs are not in %r" % path in msg
    assert "model.layers.1.mlp.down_proj.weight (weight of linear " \
        "'model.layers.1.mlp.down_proj')" in msg
    assert "model.norm.weight (looked up 'model.norm.weight')" in msg
    assert "checkpoint_key=" in msg
    # nothing changed: the model is on the meta device as it was, not streamed
    assert all(p.device.type == "meta" for p in m.parameters())
    assert not lt.is_offloaded(m)


def test_extra_tensors_are_reported_not_refused(tiny, tmp_path):
    cfg, tensors, _path = tiny
    more = dict(tensors, **{"extra.bias": torch.ones(3), "model.layers.0.unused": torch.ones(2)})
    path = save(more, str(tmp_path / "more"))
    m = llama(cfg, meta=True)
    h, _be = offload(m, checkpoint=path)
    assert sorted(h.checkpoint_info["unmatched"]) == ["extra.bias", "model.layers.0.unused"]
    compare_logits(m, resident(lambda: llama(cfg), tensors))


def test_a_dtype_mismatch_names_both_and_says_how_to_fix_it(tiny):
    cfg, tensors, path = tiny
    m = llama(cfg, dtype=torch.float32, meta=True)
    with pytest.raises(lwo.ArgumentError) as info:
        offload(m, checkpoint=path)
    msg = str(info.value)
    assert "weight of linear 'model.layers.0.self_attn.q_proj': the model's " \
        "model.layers.0.self_attn.q_proj.weight is torch.float32 but " \
        "'model.layers.0.self_attn.q_proj.weight' is BF16 in %r" % path in msg
    assert "model.to(torch.bfloat16)" in msg and "checkpoint_copy=True" in msg
    assert all(p.device.type == "meta" for p in m.parameters())


def test_checkpoint_copy_casts_into_the_pinned_pool_and_trains(tiny):
    cfg, tensors, path = tiny
    m = llama(cfg, dtype=torch.float32, meta=True)
    ref = resident(lambda: llama(cfg, dtype=torch.float32), tensors)
    h, be = offload(m, checkpoint=path, checkpoint_copy=True, plan=False)
    info = h.checkpoint_info
    assert info["pool"] == "pinned" and not host_lwo.is_checkpoint_pool(be.pools[0])
    assert set(info["cast"]) == set(tensors) - set(info["streamed"])
    assert info["cast"]["model.norm.weight"] == "BF16 -> torch.float32"
    w = m.model.layers[0].self_attn.q_proj.weight
    assert w.requires_grad and w.dtype == torch.float32
    assert w.data_ptr() == be.pools[0].tensor_host(
        w_rec(h, "model.layers.0.self_attn.q_proj"), "m0.weight").address
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.05)
    train_both(m, ref, opt, opt_r, seed=1, steps=3, tol=1e-4, each_step=lambda: close(
        w.grad, ref.model.layers[0].self_attn.q_proj.weight.grad, torch.float32))
    assert be.changed  # the optimizer's writes into the pool were noticed


def w_rec(h, name):
    return h.modules[name]._lwo_state.record.index


def test_a_shape_mismatch_is_refused(tiny):
    cfg, _tensors, path = tiny
    m = llama(llama_config(hidden=32, vocab=80), meta=True)
    with pytest.raises(lwo.ArgumentError) as info:
        offload(m, checkpoint=path)
    assert "the model's lm_head.weight is [80, 32], 'lm_head.weight' in the file [64, 32]" \
        in str(info.value)
    assert "model.embed_tokens.weight is [80, 32] in the model" in str(info.value)


def test_tied_weights_are_read_once_and_left_resident(tmp_path):
    cfg = llama_config(tied=True)
    src = llama(cfg)
    tensors = tensors_of(src)
    assert "lm_head.weight" not in tensors  # saved as save_pretrained does: one name
    path = save(tensors, str(tmp_path))
    m = llama(cfg, meta=True)
    h, _be = offload(m, checkpoint=path)
    assert "lm_head" in h.skipped and "shared" in h.skipped["lm_head"]
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert m.lm_head.weight.device.type == "cpu"  # the host backend: loaded, not meta
    assert "model.embed_tokens.weight" in h.checkpoint_info["resident"]
    compare_logits(m, resident(lambda: llama(cfg), tensors))
    # an untied model wants both: the error says why the file may hold one
    with pytest.raises(lwo.ArgumentError, match="tied weights"):
        offload(llama(llama_config(tied=False), meta=True), checkpoint=path)


def test_checkpoint_key_maps_the_model_names(tiny):
    cfg, tensors, path = tiny
    with torch.device("meta"):
        m = transformers.LlamaModel(cfg).to(torch.bfloat16)  # no "model." in its names
    h, _be = offload(m, checkpoint=path, checkpoint_key="model.")
    assert h.checkpoint_info["unmatched"] == ["lm_head.weight"]
    ref = resident(lambda: llama(cfg), tensors)
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        close(m(input_ids=ids).last_hidden_state, ref.model(input_ids=ids).last_hidden_state,
              torch.bfloat16)
    m2 = llama(cfg, meta=True)
    h2, _be = offload(m2, checkpoint=path, checkpoint_key=lambda n: n)
    assert h2.checkpoint_info["unmatched"] == []
    with pytest.raises(TypeError, match="checkpoint_key"):
        offload(llama(cfg, meta=True), checkpoint=path, checkpoint_key=3)
    with pytest.raises(ValueError, match="go with checkpoint="):
        offload(llama(cfg), checkpoint_copy=True)


# --------------------------------------------------------------------------
# Buffers and tensors no file holds
# --------------------------------------------------------------------------
class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = nn.Module()
        self.scale.register_buffer("factor", torch.full((8,), 2.0), persistent=False)

    def forward(self, x):
        return self.lin(x) * self.scale.factor


def test_a_non_persistent_buffer_needs_checkpoint_init_outside_transformers(tmp_path):
    src = WithBuffer()
    path = save(tensors_of(src), str(tmp_path))
    with torch.device("meta"):
        m = WithBuffer()
    with pytest.raises(lwo.ArgumentError) as info:
        offload(m, checkpoint=path)
    assert "scale.factor is on the meta device and not in the checkpoint" in str(info.value)
    assert "checkpoint_init=" in str(info.value)
    with torch.device("meta"):
        m = WithBuffer()
    seen = []

    def init(name, module):
        seen.append(name)
        module.factor.fill_(2.0)

    h, _be = offload(m, checkpoint=path, checkpoint_init=init)
    assert seen == ["scale"] and h.checkpoint_info["initialized"] == ["scale.factor"]
    x = torch.randn(3, 8)
    with torch.no_grad():
        close(m(x), src(x), torch.float32)


def test_lora_made_on_the_meta_device_before_offload_with_checkpoint_init(tiny):
    peft = pytest.importorskip("peft")
    cfg, tensors, path = tiny
    lcfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                           target_modules=["q_proj", "v_proj"])
    m = peft.get_peft_model(llama(cfg, meta=True), lcfg)
    with pytest.raises(lwo.ArgumentError, match="lora_A.default.weight"):
        offload(m, checkpoint=path, filter=lambda n, mod: "lora_" not in n)

    def init(name, module):  # peft's own initialization of a new adapter
        if ".lora_A." in name:
            module.reset_parameters()
        elif ".lora_B." in name:
            nn.init.zeros_(module.weight)

    torch.manual_seed(4)
    h, _be = offload(m, checkpoint=path, filter=lambda n, mod: "lora_" not in n,
                     checkpoint_init=init)
    streamed = h.checkpoint_info["streamed"]
    assert "model.layers.0.self_attn.q_proj.weight" in streamed  # peft's names unwrapped
    assert any(".base_layer" in n for n in h.modules)
    ref = peft.get_peft_model(resident(lambda: llama(cfg), tensors), lcfg)
    ref.load_state_dict({k: v for k, v in m.state_dict().items()}, strict=True)
    train_lora(m, ref)


def train_lora(m, ref, steps=3):
    trained = [p for p in m.parameters() if p.requires_grad]
    trained_r = [p for p in ref.parameters() if p.requires_grad]
    assert trained and len(trained) == len(trained_r)
    # SGD: an update in proportion to the gradient (AdamW's first steps are
    # about lr x sign(g), which turns roundings of a gradient near 0 into
    # different adapters)
    opt = torch.optim.SGD(trained, lr=0.5)
    opt_r = torch.optim.SGD(trained_r, lr=0.5)

    def grads_agree():
        for p, q in zip(trained, trained_r):
            close(p.grad, q.grad, torch.bfloat16, "lora grad")

    train_both(m, ref, opt, opt_r, seed=2, steps=steps, tol=2e-2, tokens=10, each_step=grads_agree)


def test_lora_with_peft_after_offload_on_the_mapped_base(tiny):
    peft = pytest.importorskip("peft")
    cfg, tensors, path = tiny
    m = llama(cfg, meta=True)
    h, _be = offload(m, checkpoint=path)
    ref = resident(lambda: llama(cfg), tensors)
    for p in ref.parameters():
        p.requires_grad_(False)
    lcfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                           target_modules=["q_proj", "v_proj"])
    torch.manual_seed(5)
    m = peft.get_peft_model(m, lcfg)
    torch.manual_seed(5)
    ref = peft.get_peft_model(ref, lcfg)
    a = m.base_model.model.model.layers[0].self_attn.q_proj.lora_A.default.weight
    b = ref.base_model.model.model.layers[0].self_attn.q_proj.lora_A.default.weight
    assert a.dtype == b.dtype and a.device.type == "cpu"  # beside the streamed base
    train_lora(m, ref)


# --------------------------------------------------------------------------
# fp8 checkpoints, quant=
# --------------------------------------------------------------------------
@needs_proc
def test_an_fp8_checkpoint_streams_as_it_is(tmp_path):
    cfg = llama_config(hidden=64)
    fp8, dense = fp8_tensors(tensors_of(llama(cfg)))
    path = save(fp8, str(tmp_path))
    m = llama(cfg, meta=True)
    h, be = offload(m, checkpoint=path)
    info = h.checkpoint_info
    linears = sorted(n for n in h.modules if ".layers." in n)
    assert info["fp8"] == linears and len(linears) == 14
    assert h.quantized == {n: "fp8-block" for n in linears}
    assert "lm_head" not in h.quantized and info["unmatched"] == []
    assert all(n + ".weight" + SCALE in info["streamed"] for n in linears)
    pool = be.pools[0]
    for n in linears:
        mod = h.modules[n]
        w = mod.weight
        assert w.dtype == torch.float8_e4m3fn and not w.requires_grad
        assert torch.equal(w.view(torch.uint8), fp8[n + ".weight"].view(torch.uint8))
        assert os.path.realpath(file_mapping_of(w.data_ptr())) == os.path.realpath(path)
        assert mod.compute_dtype == torch.bfloat16
        rec = mod._lwo_state.record
        t = pool.tensors(rec.index)[mod._lwo_state.w_idx]
        assert (t.quant, t.dtype, t.name) == ("fp8-block", lwo.LWO_DTYPE_BF16, n + ".weight")
        assert rec.saved_bytes > 0
    with pytest.raises(lwo.ArgumentError, match="fp8 weight"):
        pool.tensor_host(0, pool.tensors(0)[0].name)
    ref = resident(lambda: llama(cfg), dense)
    compare_logits(m, ref)
    # close() puts the dequantized weights back
    h.close()
    w = m.model.layers[0].mlp.up_proj.weight
    assert w.dtype == torch.bfloat16 and torch.equal(w, dense["model.layers.0.mlp.up_proj.weight"])


def test_lora_on_an_fp8_base_after_offload(tmp_path):
    peft = pytest.importorskip("peft")
    cfg = llama_config(hidden=64)
    fp8, dense = fp8_tensors(tensors_of(llama(cfg)))
    path = save(fp8, str(tmp_path))
    m = llama(cfg, meta=True)
    offload(m, checkpoint=path)
    ref = resident(lambda: llama(cfg), dense)
    for p in ref.parameters():
        p.requires_grad_(False)
    lcfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                           target_modules=["q_proj", "v_proj", "down_proj"])
    torch.manual_seed(6)
    m = peft.get_peft_model(m, lcfg)
    torch.manual_seed(6)
    ref = peft.get_peft_model(ref, lcfg)
    # the adapters take the dtype lwo computes the base in (peft's cast of bf16
    # adapters to f32 included), not fp8
    assert m.base_model.model.model.layers[0].mlp.down_proj.lora_B.default.weight.dtype == \
        ref.base_model.model.model.layers[0].mlp.down_proj.lora_B.default.weight.dtype
    train_lora(m, ref)


def test_an_fp8_weight_left_resident_is_dequantized(tmp_path):
    cfg = llama_config(hidden=64)
    fp8, dense = fp8_tensors(tensors_of(llama(cfg)))
    path = save(fp8, str(tmp_path))
    m = llama(cfg, meta=True)
    h, _be = offload(m, checkpoint=path, filter=lambda n, mod: "mlp" not in n)
    w = m.model.layers[1].mlp.gate_proj.weight
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, dense["model.layers.1.mlp.gate_proj.weight"])
    assert sorted(h.checkpoint_info["fp8"]) == sorted(n for n in h.modules if ".layers." in n)
    compare_logits(m, resident(lambda: llama(cfg), dense))


def test_fp8_scales_of_the_wrong_shape_are_refused(tmp_path):
    cfg = llama_config(hidden=64)
    fp8, _dense = fp8_tensors(tensors_of(llama(cfg)))
    fp8["model.layers.0.mlp.up_proj.weight" + SCALE] = torch.ones(3, 3)
    path = save(fp8, str(tmp_path))
    with pytest.raises(lwo.ArgumentError) as info:
        offload(llama(cfg, meta=True), checkpoint=path)
    assert "scales 'model.layers.0.mlp.up_proj.weight_scale_inv' of fp8 tensor " \
        "'model.layers.0.mlp.up_proj.weight' [128, 64] must be [1, 1]" in str(info.value)
    with pytest.raises(lwo.ArgumentError, match="build the model in torch.bfloat16"):
        fp8["model.layers.0.mlp.up_proj.weight" + SCALE] = torch.ones(1, 1)
        offload(llama(cfg, dtype=torch.float32, meta=True),
                checkpoint=save(fp8, str(tmp_path / "b")))


@pytest.mark.parametrize("fmt", ["int8", "fp8-block"])
def test_quant_with_a_checkpoint_quantizes_from_the_mapped_bytes(tiny, fmt, capsys):
    from torch_quant_models import dequantized
    cfg, tensors, path = tiny
    m = llama(cfg, meta=True)
    for p in m.parameters():
        p.requires_grad_(False)
    h, be = offload(m, checkpoint=path, quant=fmt, progress=True)
    assert h.checkpoint_info["pool"] == "pinned"
    linears = [n for n in h.modules]
    assert h.quantized == {n: fmt for n in linears}
    assert be.calls["write_quantized"] == len(linears)
    assert "reading the checkpoint's weights into the pool" in capsys.readouterr().err
    q = {k: (dequantized(v, fmt) if k.endswith("proj.weight") or k == "lm_head.weight"
             else v) for k, v in tensors.items()}
    for n in linears:
        assert torch.equal(h.modules[n].weight, q[n + ".weight"]), n
    compare_logits(m, resident(lambda: llama(cfg), q))


@pytest.mark.parametrize("copy_", [False, True])
def test_an_fp8_checkpoint_into_the_pinned_pool(tmp_path, copy_):
    cfg = llama_config(hidden=64)
    fp8, dense = fp8_tensors(tensors_of(llama(cfg)))
    path = save(fp8, str(tmp_path))
    m = llama(cfg, meta=True)
    for p in m.parameters():
        p.requires_grad_(False)
    kw = {"checkpoint_copy": True} if copy_ else {"quant": "int8"}
    h, be = offload(m, checkpoint=path, plan=False, **kw)
    assert h.checkpoint_info["pool"] == "pinned"
    assert h.quantized["model.layers.0.mlp.up_proj"] == "fp8-block"
    assert h.quantized.get("lm_head") == (None if copy_ else "int8")
    # the codes and scales were copied as they are (nothing quantized again)
    pool = be.pools[0]
    mod = h.modules["model.layers.0.mlp.up_proj"]
    dst = pool.tensor_host(mod._lwo_state.record.index, "m0.weight")
    lay = lwo.quant_layout("fp8-block", (128, 64), "bf16")
    raw = torch.frombuffer((ctypes.c_char * dst.bytes).from_address(dst.address), dtype=torch.uint8)
    assert torch.equal(raw[:lay.data_bytes],
                       fp8["model.layers.0.mlp.up_proj.weight"].view(torch.uint8).reshape(-1))
    assert be.calls["write_quantized"] == (0 if copy_ else 1)
    if not copy_:
        from torch_quant_models import dequantized
        dense["lm_head.weight"] = dequantized(dense["lm_head.weight"], "int8")
    compare_logits(m, resident(lambda: llama(cfg), dense))


# --------------------------------------------------------------------------
# The mapped pool is read-only; the plan regroups it in place
# --------------------------------------------------------------------------
def test_a_write_to_a_mapped_weight_is_refused_and_never_reaches_the_file(tiny):
    cfg, tensors, path = tiny
    before = open(path, "rb").read()
    m = llama(cfg, meta=True)
    h, _be = offload(m, checkpoint=path)
    ids = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        m(input_ids=ids)
        m.model.layers[0].mlp.up_proj.weight.mul_(2)  # a private page of this process
        with pytest.raises(lwo.ArgumentError) as info:
            m(input_ids=ids)
    assert info.value.status == lwo.LWO_ERR_UNSUPPORTED
    assert "linear 'model.layers.0.mlp.up_proj' streams from the read-only mapping of %r" \
        % path in str(info.value)
    assert "checkpoint_copy=True" in str(info.value)
    assert open(path, "rb").read() == before
    with pytest.raises(lwo.ArgumentError, match="read-only mapping"):
        h.mark_changed("lm_head")


def test_a_mapped_weight_cannot_be_made_trainable(tiny):
    cfg, _tensors, path = tiny
    m = llama(cfg, meta=True)
    offload(m, checkpoint=path)
    m.model.layers[1].self_attn.o_proj.weight.requires_grad_(True)
    ids = torch.randint(0, 64, (1, 5))
    with pytest.raises(lwo.ArgumentError) as info:
        m(input_ids=ids, labels=ids).loss.backward()
    assert "linear 'model.layers.1.self_attn.o_proj' streams from the read-only mapping" \
        in str(info.value)
    assert "cannot require a gradient" in str(info.value)


def test_the_plan_regroups_a_mapped_pool_without_copying(tiny):
    cfg, tensors, path = tiny
    m = llama(cfg, meta=True)
    be = host_lwo.PlanningBackend(group_size=3)
    h, _be = offload(m, backend=be, checkpoint=path)
    ptrs = {n: mod.weight.data_ptr() for n, mod in h.modules.items()}
    ref = resident(lambda: llama(cfg), tensors)
    gen = torch.Generator().manual_seed(7)
    n_before = len(h.records)
    for _ in range(6):
        ids = torch.randint(0, 64, (2, 6), generator=gen)
        with torch.no_grad():
            close(m(input_ids=ids).logits, ref(input_ids=ids).logits, torch.bfloat16)
    assert h.plan_info is not None and "error" not in h.plan_info
    assert len(h.records) == (n_before + 2) // 3
    assert len(be.pools) == 2 and all(host_lwo.is_checkpoint_pool(p) for p in be.pools)
    assert h.pool is be.pools[1] and h.pool._lwo_first is be.pools[0]
    for rec in h.records:  # each record the same file tensors, grouped
        assert rec.names == [n for s in rec.modules for n in (s.name + ".weight",)]
    assert {n: mod.weight.data_ptr() for n, mod in h.modules.items()} == ptrs
    assert h.resident == (0,)
    h.close(device="cpu")  # the mapped pools go (the first one unregisters the files)
    assert all(p.closed for p in be.pools)
    compare_logits(m, ref)


def test_a_conv_model_from_a_checkpoint(tmp_path):
    def model():
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3),
                             nn.Flatten(), nn.Linear(4 * 6 * 6, 5))

    torch.manual_seed(9)
    src = model()
    path = save(tensors_of(src), str(tmp_path))
    with torch.device("meta"):
        m = model()
    h, _be = offload(m, checkpoint=path)
    assert set(h.modules) == {"0", "2", "4"}
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    close(m(x), src(x2), torch.float32)
    for p in src.parameters():
        p.requires_grad_(False)
    m(x).sum().backward()
    src(x2).sum().backward()
    close(x.grad, x2.grad, torch.float32, "dx")


def test_index_json_naming_a_missing_shard_is_lwos_error(tmp_path):
    cfg = llama_config()
    path = save(tensors_of(llama(cfg)), str(tmp_path), shards=2)
    with open(path) as f:
        index = json.load(f)
    os.remove(os.path.join(str(tmp_path), sorted(set(index["weight_map"].values()))[1]))
    with pytest.raises(lwo.ResourceError):
        offload(llama(cfg, meta=True), checkpoint=path)


@needs_proc
def test_two_processes_share_the_mapped_pages(tmp_path):
    """Another process that maps the same checkpoint finds its pages shared
    (the page cache's, mapped here too: Shared_Clean, or Shared_Dirty where
    the file was just written), none copied."""
    import subprocess
    import sys

    def model():
        return nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(8)])

    path = save(tensors_of(model()), str(tmp_path))
    with torch.device("meta"):
        m = model()
    h, _be = offload(m, checkpoint=path, plan=False)
    with torch.no_grad():
        m(torch.randn(2, 512))  # the ring copies every record from the mapped file
    child = r"""
import mmap, sys
path = sys.argv[1]
with open(path, "rb") as f:
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
touched = sum(mm[i] for i in range(0, len(mm), 4096))
fields, inside = {}, False
with open("/proc/self/smaps") as f:
    for line in f:
        head = line.split()
        if "-" in head[0] and len(head) >= 5:
            inside = len(head) > 5 and head[5] == path
            continue
        if inside and len(head) == 3 and head[2] == "kB":
            fields[head[0]] = fields.get(head[0], 0) + int(head[1]) * 1024
print(fields.get("Shared_Clean:", 0) + fields.get("Shared_Dirty:", 0),
      fields.get("Private_Dirty:", 0) + fields.get("Anonymous:", 0), len(mm))
"""
    out = subprocess.run([sys.executable, "-c", child, os.path.realpath(path)], check=True,
                         capture_output=True, text=True).stdout.split()
    shared, dirty, size = (int(v) for v in out)
    streamed = 8 * 512 * 512 * 4
    assert dirty == 0
    assert shared >= 0.9 * streamed, (shared, streamed, size)


@pytest.mark.parametrize("dtype", ["bf16", "fp8-e4m3"])
def test_make_llama_checkpoint_writes_what_offload_streams(tmp_path, dtype):
    """scripts/make-llama-checkpoint: HF's layout (config.json, shards and
    their index), readable by safetensors, lwo and transformers' config."""
    import subprocess
    import sys
    from safetensors.torch import load_file
    from checkpoint_models import fp8_dense
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts",
                          "make-llama-checkpoint")
    out = str(tmp_path / "ckpt")
    subprocess.run([sys.executable, script, "--out", out, "--preset", "tiny", "--dtype", dtype,
                    "--shard-size", "100KB", "--quiet"], check=True)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2
    tensors = {}
    for name in files:
        tensors.update(load_file(os.path.join(out, name)))
    assert set(tensors) == set(index["weight_map"])
    q = tensors["model.layers.1.mlp.down_proj.weight"]
    if dtype == "bf16":
        assert q.dtype == torch.bfloat16 and abs(q.float().std().item() - 0.02) < 2e-3
    else:
        s = tensors["model.layers.1.mlp.down_proj.weight" + SCALE]
        assert q.dtype == torch.float8_e4m3fn and q.shape == (64, 128) and s.shape == (1, 1)
        assert abs(fp8_dense(q, s).float().std().item() - 0.02) < 2e-3
        assert q.float().abs().max().item() == 448.0  # each block's largest maps to 448
    assert torch.equal(tensors["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    cfg = transformers.AutoConfig.from_pretrained(out)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == (64, 2, 2)
    m = llama(cfg, meta=True)
    h, _be = offload(m, checkpoint=out)
    assert h.checkpoint_info["unmatched"] == []
    assert len(h.checkpoint_info["fp8"]) == (14 if dtype == "fp8-e4m3" else 0)
    dense = {}
    for k, v in tensors.items():
        if k.endswith(SCALE):
            continue
        dense[k] = fp8_dense(v, tensors[k + SCALE]) if v.dtype == torch.float8_e4m3fn else v
    compare_logits(m, resident(lambda: llama(cfg), dense))


def test_a_refused_private_mapping_falls_back_to_a_read_only_one(tiny, monkeypatch):
    import mmap as mmap_module
    from lwo import _torch_checkpoint as tc
    cfg, tensors, path = tiny
    real = mmap_module.mmap

    def no_private(fd, length, access=None, **kw):
        if access == mmap_module.ACCESS_COPY:
            raise OSError(12, "Cannot allocate memory")
        return real(fd, length, access=access, **kw)

    monkeypatch.setattr(tc.mmap, "mmap", no_private)
    m = llama(cfg, meta=True)
    with pytest.warns(RuntimeWarning, match="mapped read-only, so writing a streamed parameter"):
        h, _be = offload(m, checkpoint=path)
    compare_logits(m, resident(lambda: llama(cfg), tensors))
    h.close(device="cpu")
    assert h._checkpoint.first_pool is None  # the pool that registered the files is gone
    assert not lt.is_offloaded(m)
    compare_logits(m, resident(lambda: llama(cfg), tensors))


def test_the_plan_regroups_a_pinned_pool_with_fp8_weights_of_the_file(tmp_path):
    cfg = llama_config(hidden=64)
    fp8, dense = fp8_tensors(tensors_of(llama(cfg)))
    path = save(fp8, str(tmp_path))
    m = llama(cfg, meta=True)
    ref = resident(lambda: llama(cfg), dense)
    for mod in (m, ref):
        for n, p in mod.named_parameters():
            p.requires_grad_("lm_head" in n)
    be = host_lwo.PlanningBackend(group_size=3)
    h, _be = offload(m, backend=be, checkpoint=path, checkpoint_copy=True)
    n_before = len(h.records)
    saved = h.stats()["quant"]["saved_bytes"]
    assert saved > 0
    opt = torch.optim.SGD([m.lm_head.weight], lr=0.1)
    opt_r = torch.optim.SGD([ref.lm_head.weight], lr=0.1)
    train_both(m, ref, opt, opt_r, seed=8, steps=6, tol=2e-2)
    assert h.plan_info is not None and "error" not in h.plan_info, h.plan_info
    assert len(h.records) < n_before and len(be.pools) == 2
    assert not host_lwo.is_checkpoint_pool(be.pools[1])
    w = m.model.layers[0].mlp.up_proj.weight  # still the file's codes
    assert w.dtype == torch.float8_e4m3fn
    assert h.stats()["quant"]["saved_bytes"] == saved


def test_lwo_torch_optim_over_a_checkpoint(tiny):
    """lwo.torch.optim: the streamed weights read into the pinned pool
    (checkpoint_copy=True) train with lwo's host AdamW as PyTorch's AdamW
    trains the resident model; over a mapped base only the adapters train."""
    from lwo.torch import optim as lopt
    cfg, tensors, path = tiny
    m = llama(cfg, dtype=torch.float32, meta=True)
    ref = resident(lambda: llama(cfg, dtype=torch.float32), tensors)
    h, _be = offload(m, checkpoint=path, checkpoint_copy=True, plan=False)
    opt = lopt.AdamW(m.parameters(), lr=1e-3)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    train_both(m, ref, opt, opt_r, seed=12, steps=3, tol=1e-3)
    opt.synchronize()  # the host reads a streamed weight: its last update must have run
    close(m.model.layers[1].mlp.down_proj.weight, ref.model.layers[1].mlp.down_proj.weight,
          torch.float32)

    peft = pytest.importorskip("peft")
    m2 = llama(cfg, meta=True)
    offload(m2, checkpoint=path)
    m2 = peft.get_peft_model(m2, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                 target_modules=["q_proj"]))
    opt2 = lopt.AdamW([p for p in m2.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, 64, (2, 8))
    m2(input_ids=ids, labels=ids).loss.backward()
    opt2.step()
