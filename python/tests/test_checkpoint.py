"""The checkpoint API on small safetensors files the tests write: no GPU."""

import os
import signal
import struct

import pytest

import lwo

from conftest import write_safetensors


def f32(*values):
    return struct.pack("<%df" % len(values), *values)


TENSORS = [  # (name, dtype, shape, bytes), in file order
    ("blocks.0.attn.weight", "F32", [2, 2], f32(1, 2, 3, 4)),
    ("blocks.0.mlp.weight", "BF16", [4], b"\x00\x3f" * 4),
    ("blocks.1.attn.weight", "F32", [2, 2], f32(5, 6, 7, 8)),
    ("blocks.1.mlp.weight", "BF16", [4], b"\x80\x3f" * 4),
    ("extra.0.w", "F16", [3], b"\x00\x3c" * 3),
    ("extra.1.w", "F16", [3], b"\x00\x40" * 3),
    ("head.weight", "F32", [], f32(9)),
    ("sparse.0.w", "I64", [1], struct.pack("<q", 7)),
    ("sparse.2.w", "U8", [0], b""),
]
METADATA = {"format": "pt", "author": "lwo tests"}


@pytest.fixture
def path(tmp_path):
    return str(write_safetensors(tmp_path / "model.safetensors", TENSORS, METADATA))


@pytest.fixture
def ckpt(path):
    with lwo.Checkpoint.open(path) as c:
        yield c


def test_tensors(ckpt):
    tensors = ckpt.tensors()
    assert [t.name for t in tensors] == [t[0] for t in TENSORS]
    by_name = {t.name: t for t in tensors}
    w = by_name["blocks.0.attn.weight"]
    assert (w.dtype, w.dtype_name, w.shape, w.bytes, w.file) == (lwo.LWO_DTYPE_F32, "F32",
                                                                  (2, 2), 16, 0)
    assert by_name["blocks.0.mlp.weight"].dtype == lwo.LWO_DTYPE_BF16
    assert by_name["head.weight"].shape == () and by_name["head.weight"].bytes == 4
    assert by_name["sparse.2.w"].bytes == 0 and by_name["sparse.2.w"].shape == (0,)
    with open(ckpt.path, "rb") as f:
        raw = f.read()
    for name, _dt, _shape, data in TENSORS:
        t = by_name[name]
        assert raw[t.file_offset:t.file_offset + t.bytes] == data, name
    assert ckpt.tensor_count() == len(TENSORS)
    with pytest.raises(lwo.ArgumentError) as info:
        ckpt.tensor(len(TENSORS))
    assert info.value.status == lwo.LWO_ERR_OUT_OF_RANGE
    assert info.value.message.startswith("lwo_checkpoint_tensor_info")


def test_files(ckpt, path):
    files = ckpt.files()
    assert len(files) == 1
    assert files[0].path == path
    assert files[0].bytes == os.path.getsize(path)
    assert files[0].n_tensors == len(TENSORS)


def test_metadata(ckpt):
    entries = ckpt.metadata()
    assert [(e.file, e.key, e.value) for e in entries] == sorted(
        (0, k, v) for k, v in METADATA.items())


def test_no_metadata(tmp_path):
    p = write_safetensors(tmp_path / "m.safetensors", TENSORS[:1])
    with lwo.Checkpoint(p) as c:
        assert c.metadata() == []


def test_map_tensors_with_a_pattern(ckpt):
    m = ckpt.map_tensors(pattern="blocks.{i}.")
    assert m.n_layers == 2
    assert m.layers() == [
        [("attn.weight", "blocks.0.attn.weight"), ("mlp.weight", "blocks.0.mlp.weight")],
        [("attn.weight", "blocks.1.attn.weight"), ("mlp.weight", "blocks.1.mlp.weight")],
    ]
    assert m.unmatched == ["extra.0.w", "extra.1.w", "head.weight", "sparse.0.w",
                           "sparse.2.w"]
    assert ckpt.unmatched(pattern="blocks.{i}.") == m.unmatched
    assert [e.layer for e in m.entries] == [0, 0, 1, 1] + [None] * 5
    assert all(e.layer_name is None for e in m.entries if e.layer is None)


def test_map_tensors_with_two_patterns(ckpt):
    m = ckpt.map_tensors(patterns=["blocks.{i}.", "extra.{i}."])
    assert m.n_layers == 4
    assert m.layer(2) == [("w", "extra.0.w")] and m.layer(3) == [("w", "extra.1.w")]
    assert m.unmatched == ["head.weight", "sparse.0.w", "sparse.2.w"]


def test_map_tensors_with_gaps(ckpt):
    with pytest.raises(lwo.ArgumentError) as info:
        ckpt.map_tensors(pattern="sparse.{i}.")
    assert info.value.status == lwo.LWO_ERR_NOT_FOUND
    assert info.value.message.startswith("lwo_checkpoint_map_tensors")
    m = ckpt.map_tensors(pattern="sparse.{i}.", allow_gaps=True)
    assert m.n_layers == 3
    assert m.layers() == [[("w", "sparse.0.w")], [], [("w", "sparse.2.w")]]


def test_map_tensors_with_names(ckpt):
    m = ckpt.map_tensors(names=[["head.weight"], ["extra.1.w", "extra.0.w"]])
    assert m.n_layers == 2
    assert m.layer(0) == [("head.weight", "head.weight")]
    assert sorted(m.layer(1)) == [("extra.0.w", "extra.0.w"), ("extra.1.w", "extra.1.w")]
    with pytest.raises(lwo.ArgumentError) as info:
        ckpt.map_tensors(names=[["no.such.tensor"]])
    assert info.value.status == lwo.LWO_ERR_NOT_FOUND


def test_map_tensors_needs_exactly_one_mapping(ckpt):
    with pytest.raises(TypeError):
        ckpt.map_tensors()
    with pytest.raises(TypeError):
        ckpt.map_tensors(pattern="blocks.{i}.", names=[["head.weight"]])


def test_close_is_idempotent_and_use_after_close_raises(path):
    c = lwo.Checkpoint(path)
    assert not c.closed
    c.close()
    c.close()
    assert c.closed
    with pytest.raises(ValueError):
        c.tensors()
    with lwo.Checkpoint(path) as c2:
        pass
    assert c2.closed
    c3 = lwo.Checkpoint(path)
    del c3  # __del__ destroys it without raising


def test_missing_file_is_a_resource_error(tmp_path):
    with pytest.raises(lwo.ResourceError) as info:
        lwo.Checkpoint(tmp_path / "missing.safetensors")
    assert info.value.status == lwo.LWO_ERR_IO
    assert info.value.message.startswith("lwo_checkpoint_open")


def test_folder_is_refused(tmp_path):
    with pytest.raises(lwo.ResourceError) as info:
        lwo.Checkpoint(tmp_path)
    assert info.value.status == lwo.LWO_ERR_IO


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes on this system")
def test_named_pipe_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)

    def hung(*_):
        raise AssertionError("lwo_checkpoint_open blocked on a named pipe")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    try:
        with pytest.raises(lwo.ResourceError) as info:
            lwo.Checkpoint(fifo)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert info.value.status == lwo.LWO_ERR_IO
    assert info.value.message.startswith("lwo_checkpoint_open")


def test_malformed_files_are_format_errors(tmp_path):
    cut = tmp_path / "cut.safetensors"
    write_safetensors(cut, TENSORS)
    data = cut.read_bytes()
    cut.write_bytes(data[:-8])
    with pytest.raises(lwo.FormatError) as info:
        lwo.Checkpoint(cut)
    assert info.value.message.startswith("lwo_checkpoint_open")

    bad = tmp_path / "bad.safetensors"
    text = b"{not json}    "
    bad.write_bytes(struct.pack("<Q", len(text)) + text)
    with pytest.raises(lwo.FormatError) as info:
        lwo.Checkpoint(bad)
    assert info.value.status == lwo.LWO_ERR_BAD_JSON

    dt = tmp_path / "dtype.safetensors"
    write_safetensors(dt, [("x", "Q7", [1], b"\x00")])
    with pytest.raises(lwo.FormatError) as info:
        lwo.Checkpoint(dt)
    assert info.value.status == lwo.LWO_ERR_BAD_DTYPE


def test_integers_that_do_not_fit_and_nul_characters_are_refused(tmp_path):
    # ctypes wraps an int to the C type silently: 2**32 was tensor 0, device
    # 2**32 + 1 device 1, status 2**40 "LWO_OK"; C strings end at a NUL
    c = lwo.Checkpoint(write_safetensors(tmp_path / "m.safetensors", TENSORS[:1]))
    assert c.tensor(0).name == TENSORS[0][0]
    with pytest.raises(lwo.ArgumentError, match="tensor index 4294967296 is outside"):
        c.tensor(2**32)
    with pytest.raises(lwo.ArgumentError, match="tensor index -1"):
        c.tensor(-1)
    with pytest.raises(lwo.ArgumentError, match="device 4294967297 is outside"):
        lwo.Engine(device=2**32 + 1)
    assert lwo.status_string(2**40) == "unknown status"
    assert lwo.status_string(0) == "LWO_OK"
    with pytest.raises(lwo.ArgumentError, match="NUL"):
        lwo.Checkpoint(str(tmp_path / "m.safetensors") + "\0ignored")
    with pytest.raises(lwo.ArgumentError, match="NUL"):
        c.map_tensors(pattern="blocks.{i}.\0")
    c.close()


def test_a_library_lacking_a_symbol_names_it():
    from lwo import _capi as C

    class Lacking:
        def __getattr__(self, name):
            if name == "lwo_optim_step_groups":
                raise AttributeError(name)
            return getattr(C.lib, name)
    with pytest.raises(C.VersionMismatch, match="lacks lwo_optim_step_groups"):
        C._declare(Lacking(), "a test library")
