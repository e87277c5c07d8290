#!/usr/bin/env python3
"""Writes the seed corpus of safetensors_fuzz into fuzz/corpus/, that of
checkpoint_fuzz into fuzz/corpus_checkpoint/ and that of info_fuzz into
fuzz/corpus_info/ (all committed; rerun after changing the seeds). Each
safetensors seed is a tiny whole file: the 8-byte little-endian header
length, the header text, then the data section. Each checkpoint seed is an
index folder: the index text, then each shard (a.safetensors,
b.safetensors, ...), cut by "@@@@" (fuzz.h, write_checkpoint_input), or one
safetensors file. The info seeds are some of both, and files whose names,
metadata and shard paths hold control characters; info_fuzz reads its flags
from an input's last byte (info_fuzz.cc)."""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus")
OUT_CHECKPOINT = os.path.join(HERE, "corpus_checkpoint")
OUT_INFO = os.path.join(HERE, "corpus_info")


def st(header, data=b"", length=None):
    h = header.encode() if isinstance(header, str) else header
    n = len(h) if length is None else length
    return struct.pack("<Q", n) + h + data


def t(dtype, shape, begin, end):
    return ('{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}'
            % (dtype, ",".join(str(d) for d in shape), begin, end))


SEEDS = {
    # Valid files.
    "valid_blocks": st('{"__metadata__":{"format":"pt"},'
                       '"blocks.0.w":' + t("BF16", [2, 2], 0, 8) + ','
                       '"blocks.0.b":' + t("F32", [2], 8, 16) + ','
                       '"blocks.1.w":' + t("BF16", [2, 2], 16, 24) + ','
                       '"head":' + t("I64", [], 24, 32) + '}   ', bytes(range(32))),
    "valid_dtypes": st('{"a":' + t("F8_E4M3", [3], 0, 3) + ',"b":' + t("F8_E5M2", [1], 3, 4) +
                       ',"c":' + t("U8", [2], 4, 6) + ',"d":' + t("I8", [2], 6, 8) +
                       ',"e":' + t("F16", [1], 8, 10) + ',"f":' + t("BOOL", [1], 10, 11) +
                       ',"g":' + t("U16", [1], 12, 14) + ',"h":' + t("F64", [1], 16, 24) + '}',
                       bytes(24)),
    "valid_empty_header": st("{}"),
    "valid_zero_size": st('{"h.0":' + t("F32", [0, 5], 4, 4) + ',"h.1":' + t("U8", [4], 0, 4) +
                          ',"h.2":' + t("U8", [0], 4, 4) + '}', bytes(6)),
    "valid_layers_numeric": st('{"0":' + t("U8", [1], 0, 1) + ',"1":' + t("U8", [1], 1, 2) +
                               ',"layers.0.w":' + t("U8", [1], 2, 3) + '}', bytes(3)),
    # Index files (the header text is also fed to parse_index).
    "index": st('{"metadata":{"total_size":8},"weight_map":{"blocks.0.w":"model-00001.safetensors",'
                '"blocks.1.w":"shards/model-00002.safetensors"}}'),
    "index_bad_path": st('{"weight_map":{"a":"../x.safetensors"}}'),
    # Broken files, one per status.
    "short": b"\x05\x00\x00",
    "header_zero": st("", length=0),
    "header_too_long": st("{}", length=64),
    "header_huge": st("{}", length=(1 << 64) - 1),
    "bad_json": st('{"w":{"dtype":"F32",'),
    "bad_utf8": st(b'{"\xff":1}'),
    "bad_shape_float": st('{"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}}', bytes(4)),
    "bad_dtype": st('{"w":' + t("Q8", [1], 0, 1) + '}', bytes(1)),
    "shape_overflow": st('{"w":' + t("F32", [4611686018427387904, 8], 0, 8) + '}', bytes(8)),
    "bad_range": st('{"w":' + t("U8", [4], 8, 4) + '}', bytes(8)),
    "truncated_data": st('{"w":' + t("F32", [4], 0, 16) + '}', bytes(9)),
    "shape_mismatch": st('{"w":' + t("F32", [3], 0, 8) + '}', bytes(8)),
    "overlap": st('{"a":' + t("U8", [8], 0, 8) + ',"b":' + t("U8", [8], 4, 12) + '}', bytes(12)),
    "duplicate": st('{"a":' + t("U8", [1], 0, 1) + ',"a":' + t("U8", [1], 1, 2) + '}', bytes(2)),
    # Every dtype, in layers with gaps between their indices, and metadata.
    "every_dtype_metadata": st(
        '{"__metadata__":{"format":"pt","b":"2"},'
        + ",".join('"blocks.%d.w%d":%s' % (idx, k, t(dt, [2], off, off + 2 * size))
                   for k, (idx, dt, size, off) in enumerate([
                       (0, "BOOL", 1, 0), (2, "I16", 2, 2), (5, "U16", 2, 6), (3, "I32", 4, 10),
                       (9, "U32", 4, 18), (1, "I64", 8, 26), (4, "U64", 8, 42),
                       (6, "F64", 8, 58), (7, "F8_E8M0", 1, 74), (8, "C64", 8, 76)]))
        + '}', bytes(92)),
    "gaps": st('{"h.0.w":' + t("F32", [1], 0, 4) + ',"h.7.w":' + t("F32", [1], 4, 8) + '}', bytes(8)),
    # Quantized fp8 weights with their block scales beside them (since 0.4.0;
    # zero data, so the last byte picks the pattern "blocks.{i}.").
    "fp8_block_scales": st('{"blocks.0.w":' + t("F8_E4M3", [130, 4], 0, 520) +
                           ',"blocks.0.w_scale_inv":' + t("F32", [2, 1], 520, 528) +
                           ',"blocks.1.w_scale_inv":' + t("F32", [1, 1], 528, 532) +
                           ',"blocks.1.w":' + t("F8_E4M3", [2, 2], 532, 536) + '}', bytes(536)),
    "fp8_bad_scale_shape": st('{"blocks.0.w":' + t("F8_E4M3", [2, 2], 0, 4) +
                              ',"blocks.0.w_scale_inv":' + t("F32", [2, 1], 4, 12) + '}', bytes(12)),
    "fp8_bad_scale_dtype": st('{"blocks.0.w":' + t("F8_E4M3", [2, 2], 0, 4) +
                              ',"blocks.0.w_scale_inv":' + t("BF16", [1, 1], 4, 6) + '}', bytes(6)),
    "fp8_scales_of_3d": st('{"blocks.0.w":' + t("F8_E4M3", [2, 2, 2], 0, 8) +
                           ',"blocks.0.w_scale_inv":' + t("F32", [1, 1], 8, 12) + '}', bytes(12)),
}


def folder(weight_map, *shards):
    idx = '{"metadata":{"total_size":0},"weight_map":{%s}}' % ",".join(
        '"%s":"%s"' % kv for kv in weight_map)
    return b"@@@@".join([idx.encode()] + list(shards))


SHARD_A = st('{"layers.0.w":' + t("BF16", [2, 2], 0, 8) + ',"layers.0.b":' + t("F32", [2], 8, 16) +
             '}', bytes(16))
SHARD_B = st('{"__metadata__":{"format":"pt"},"layers.1.w":' + t("BF16", [2, 2], 0, 8) + '}', bytes(8))
CHECKPOINT_SEEDS = {
    "two_shards": folder([("layers.0.w", "a.safetensors"), ("layers.0.b", "a.safetensors"),
                          ("layers.1.w", "b.safetensors")], SHARD_A, SHARD_B),
    "one_of_two_tensors": folder([("layers.0.w", "a.safetensors")], SHARD_A),
    "symlink_inside": folder([("layers.0.w", "in.safetensors")], SHARD_A),
    "symlink_outside": folder([("x", "out.safetensors")], SHARD_A),
    "shard_missing": folder([("layers.0.w", "c.safetensors")], SHARD_A),
    "tensor_not_in_shard": folder([("layers.9.w", "a.safetensors")], SHARD_A),
    "shard_in_subfolder": folder([("layers.0.w", "sub/a.safetensors")], SHARD_A),
    "shard_dotdot": folder([("layers.0.w", "..")], SHARD_A),
    "no_tensor": folder([], SHARD_A),
    "bad_shard": folder([("layers.0.w", "a.safetensors")], b"\x05\x00"),
    "four_shards": folder([("w%d" % k, "abcd"[k] + ".safetensors") for k in range(4)],
                          *[st('{"w%d":' % k + t("U8", [1], 0, 1) + '}', b"x") for k in range(4)]),
    "single_file": SHARD_A,
}




def with_flags(seed, pick):
    """The seed with one byte more at its end (data past the last tensor, or
    in the last shard), which info_fuzz reads as its flags: pick % 4 the
    mapping (0: the default patterns, 1: "{i}", 2: "layers.{i}.", 3:
    "h.{i}."), pick & 4 --json."""
    return seed + bytes([pick])


CONTROL = "\\u001b[31m\\r\\u0007\\u009b\\u007f"  # ESC, CR, BEL, C1 CSI, DEL (JSON escapes)
INFO_SEEDS = {
    # Valid checkpoints, listed by each mapping, with and without --json.
    "valid_blocks": with_flags(SEEDS["valid_blocks"], 4),
    "valid_dtypes": with_flags(SEEDS["valid_dtypes"], 0),
    "every_dtype_metadata_json": with_flags(SEEDS["every_dtype_metadata"], 4),
    "gaps_h": with_flags(SEEDS["gaps"], 3),
    "fp8_block_scales": with_flags(SEEDS["fp8_block_scales"], 4),
    "valid_layers_numeric": with_flags(SEEDS["valid_layers_numeric"], 5),
    "two_shards": with_flags(CHECKPOINT_SEEDS["two_shards"], 6),
    "four_shards_json": with_flags(CHECKPOINT_SEEDS["four_shards"], 4),
    # Malformed ones: exit 1, or 2 for a pattern that does not fit.
    "bad_json": SEEDS["bad_json"],
    "truncated_data": SEEDS["truncated_data"],
    "header_huge": SEEDS["header_huge"],
    "shape_overflow": SEEDS["shape_overflow"],
    "overlap": SEEDS["overlap"],
    "pattern_misses": with_flags(SEEDS["valid_blocks"], 2),
    "shard_missing": CHECKPOINT_SEEDS["shard_missing"],
    "symlink_outside": CHECKPOINT_SEEDS["symlink_outside"],
    "tensor_not_in_shard": CHECKPOINT_SEEDS["tensor_not_in_shard"],
    "bad_shard": CHECKPOINT_SEEDS["bad_shard"],
    "shard_dotdot": CHECKPOINT_SEEDS["shard_dotdot"],
    # The file's own text in a message: not the program's "internal:" error.
    "internal_in_name": st('{"internal: x":"pt"}'),
    # Control characters from the file: escaped wherever they are shown.
    "control_names": with_flags(st(
        '{"__metadata__":{"k%s":"v%s"},"blocks.0.%sw":%s,"blocks.1.w%s":%s,"x%s":%s}'
        % (CONTROL, CONTROL, CONTROL, t("BF16", [2], 0, 4), CONTROL, t("C64", [1], 4, 12),
           CONTROL, t("U8", [1], 12, 13)), bytes(13)), 4),
    "control_pattern_misses": with_flags(st('{"w%s":%s}' % (CONTROL, t("U8", [1], 0, 1)),
                                            bytes(1)), 1),
    "control_shard_path": folder([("layers.0.w", CONTROL + ".safetensors")], SHARD_A),
    "control_not_in_shard": folder([("layers.0." + CONTROL, "a.safetensors")], SHARD_A),
    "control_index_metadata": folder([("layers.0.w", "a.safetensors")], SHARD_A).replace(
        b'"total_size":0', ('"total_size":0,"note":"%s"' % CONTROL).encode()),
}


def write_seeds(out, seeds):
    """Empties the folder out and writes each seed into it."""
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(out):
        os.remove(os.path.join(out, name))
    for name, data in sorted(seeds.items()):
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
    print("wrote %d seeds to %s" % (len(seeds), out))


def main():
    write_seeds(OUT, SEEDS)
    write_seeds(OUT_CHECKPOINT, CHECKPOINT_SEEDS)
    write_seeds(OUT_INFO, INFO_SEEDS)


if __name__ == "__main__":
    main()
