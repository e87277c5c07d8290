"""Checkpoints for the offload(checkpoint=) tests: a tiny Llama from
transformers (or any module), saved with safetensors as one file or as the
shards of an index, fp8 block-quantized copies of its linear weights (F8_E4M3
codes and "<name>_scale_inv" f32 scales of 128 x 128 blocks, as fp8 models
ship them), and the resident references the tests compare against."""

import json
import math
import os

import torch

SCALE = "_scale_inv"


def llama_config(tied=False, layers=2, hidden=32, vocab=64):
    import transformers
    return transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden,
                                    num_hidden_layers=layers, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=vocab,
                                    max_position_embeddings=64, tie_word_embeddings=tied)


def llama(cfg, dtype=torch.bfloat16, seed=0, meta=False):
    import transformers
    if meta:
        with torch.device("meta"):
            m = transformers.LlamaForCausalLM(cfg)
    else:
        torch.manual_seed(seed)
        m = transformers.LlamaForCausalLM(cfg)
    return m.to(dtype)


def tensors_of(model):
    """The model's state_dict as contiguous tensors (each tied tensor once,
    under its first name, as save_pretrained writes them)."""
    out, seen = {}, set()
    for k, v in model.state_dict(keep_vars=True).items():
        if id(v) in seen:
            continue
        seen.add(id(v))
        out[k] = v.detach().contiguous().clone()
    return out


def save(tensors, folder, shards=1, name="model"):
    """One file (shards=1: folder/model.safetensors) or `shards` files with an
    index (folder/model.safetensors.index.json). Returns the path to open."""
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    names = list(tensors)
    if shards == 1:
        path = os.path.join(folder, name + ".safetensors")
        save_file(tensors, path)
        return path
    per = math.ceil(len(names) / shards)
    weight_map = {}
    total = 0
    for i in range(shards):
        part = names[i * per:(i + 1) * per]
        fname = "%s-%05d-of-%05d.safetensors" % (name, i + 1, shards)
        save_file({k: tensors[k] for k in part}, os.path.join(folder, fname))
        for k in part:
            weight_map[k] = fname
            total += tensors[k].numel() * tensors[k].element_size()
    path = os.path.join(folder, name + ".safetensors.index.json")
    with open(path, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return path


def fp8_block(w):
    """(codes float8_e4m3fn [rows, cols], scales f32 [ceil(rows/128),
    ceil(cols/128)]): each 128 x 128 block's largest magnitude maps to 448,
    codes x scale = the weight."""
    rows, cols = w.shape
    R, K = (rows + 127) // 128, (cols + 127) // 128
    pad = torch.zeros(R * 128, K * 128)
    pad[:rows, :cols] = w.float()
    blocks = pad.view(R, 128, K, 128)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(R * 128, K * 128)[:rows, :cols].contiguous(), scale.float().contiguous()


def fp8_dense(codes, scale, dtype=torch.bfloat16):
    """codes x scale, per block, rounded once to dtype (lwo_dequantize_host)."""
    rows, cols = codes.shape
    s = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    return (codes.float() * s).to(dtype)


def fp8_tensors(tensors, which=lambda name: ".layers." in name and name.endswith("proj.weight")):
    """The checkpoint with the weights `which` picks block-quantized, and
    the dense tensors those stand for (the reference's)."""
    out, dense = {}, {}
    for k, v in tensors.items():
        if which(k) and v.dim() == 2:
            codes, scale = fp8_block(v)
            out[k], out[k + SCALE] = codes, scale
            dense[k] = fp8_dense(codes, scale, v.dtype)
        else:
            out[k] = v
            dense[k] = v
    return out, dense


def resident(model_fn, tensors, device="cpu"):
    """A reference: the model built as usual, its state loaded from
    `tensors` (load_state_dict), on `device`."""
    m = model_fn()
    missing, unexpected = m.load_state_dict(tensors, strict=False)
    assert not unexpected, unexpected
    assert all(k.endswith("lm_head.weight") for k in missing), missing
    return m.to(device)


def trim_heap():
    """glibc's malloc_trim(0), where there is one: freed heap memory goes
    back to the system, so that RssAnon shows new allocations."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_anon():
    """RssAnon of /proc/self/status in bytes, or None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
