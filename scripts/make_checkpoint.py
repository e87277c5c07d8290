#!/usr/bin/env python3
"""Writes a safetensors checkpoint of random weights, for lwo info / lwo stream.

Every layer i gets two tensors, named by the pattern with {i} replaced:
  <prefix>weight  [rows, cols]
  <prefix>norm    [cols]
and with --extras also two tensors outside every layer ("embed.weight" [cols]
and "final_norm.weight" [cols]) that lwo reports as unmatched. Tensors are
written in layer order, each right after the previous one (an odd --cols with
a 2-byte dtype leaves later tensors only 2-byte aligned in the file).

The format is written by hand: an 8-byte little-endian header length N, N
bytes of JSON padded with spaces to a multiple of 8, then the data. Values are
random bits with the top exponent bit cleared, so no value is NaN or Inf
(|x| < 2). Needs only the standard library; with numpy it is much faster.

  scripts/make_checkpoint.py --layers 32 --rows 8192 --cols 8192 --out model.safetensors
"""
import argparse
import json
import os
import struct
import sys
import time

try:
    import numpy as np
except ImportError:  # the standard library alone (slower)
    np = None

# dtype -> (bytes per element, byte index within an element whose bit 6 is
# the exponent's top bit, little-endian)
DTYPES = {"BF16": (2, 1), "F16": (2, 1), "F32": (4, 3)}
CHUNK = 64 << 20  # bytes generated and written at a time


class Random:
    """Random bytes with bit 6 of every element's top byte cleared."""

    def __init__(self, seed, dtype):
        self.elem, self.top = DTYPES[dtype]
        if np is not None:
            self.gen = np.random.SFC64(seed)
            mask = bytearray(b"\xff" * 8)
            for i in range(self.top, 8, self.elem):
                mask[i] = 0xBF
            self.mask = np.frombuffer(bytes(mask), dtype="<u8")[0]
        else:
            self.table = bytes(b & 0xBF for b in range(256))

    def bytes(self, n):
        """n random bytes (n a multiple of the element size) as a buffer."""
        if np is not None:
            words = self.gen.random_raw((n + 7) // 8)
            words &= self.mask
            return memoryview(words.view(np.uint8)[:n])
        buf = bytearray(os.urandom(n))
        buf[self.top :: self.elem] = buf[self.top :: self.elem].translate(self.table)
        return buf


def tensors(args):
    """(name, shape) of every tensor, in file order."""
    out = []
    if args.extras:
        out.append(("embed.weight", [args.cols]))
    for i in range(args.layers):
        prefix = args.pattern.replace("{i}", str(i))
        out.append((prefix + "weight", [args.rows, args.cols]))
        out.append((prefix + "norm", [args.cols]))
    if args.extras:
        out.append(("final_norm.weight", [args.cols]))
    return out


def fmt_bytes(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return "%.2f %s" % (n / (1 << shift), unit)
    return "%d B" % n


def main():
    p = argparse.ArgumentParser(
        description="Write a safetensors checkpoint of random weights.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--layers", type=int, default=32, help="layers")
    p.add_argument("--rows", type=int, default=8192, help="rows of each layer's weight")
    p.add_argument("--cols", type=int, default=8192, help="columns of each weight (and norm size)")
    p.add_argument("--dtype", default="BF16", choices=sorted(DTYPES), help="dtype of every tensor")
    p.add_argument("--pattern", default="blocks.{i}.", help="layer name prefix with one {i}")
    p.add_argument("--extras", action="store_true",
                   help='also write "embed.weight" and "final_norm.weight" (outside the layers)')
    p.add_argument("--seed", type=int, default=1, help="seed of the random data (numpy only)")
    p.add_argument("--quiet", action="store_true", help="no summary line on stderr")
    p.add_argument("--out", required=True, help="the .safetensors file to write")
    args = p.parse_args()
    if args.layers < 1 or args.rows < 1 or args.cols < 1:
        p.error("--layers, --rows and --cols must be at least 1")
    if args.pattern.count("{i}") != 1:
        p.error("--pattern must contain {i} exactly once")

    elem = DTYPES[args.dtype][0]
    header = {"__metadata__": {"format": "pt", "generator": "lwo make_checkpoint.py"}}
    offset = 0
    layout = []
    for name, shape in tensors(args):
        n = elem
        for d in shape:
            n *= d
        header[name] = {"dtype": args.dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        layout.append(n)
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)

    rnd = Random(args.seed, args.dtype)
    start = time.monotonic()
    tmp = args.out + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for n in layout:
            left = n
            while left:
                k = min(left, CHUNK)
                f.write(rnd.bytes(k))
                left -= k
    os.replace(tmp, args.out)
    seconds = time.monotonic() - start
    total = 8 + len(text) + offset
    if not args.quiet:
        print(
            "make_checkpoint: wrote %s: %d tensors (%d layers of %s [%d, %d] + [%d]%s), %s "
            "in %.1f s (%.2f GB/s)%s"
            % (args.out, len(layout), args.layers, args.dtype, args.rows, args.cols, args.cols,
               ", 2 extras" if args.extras else "", fmt_bytes(total), seconds,
               total / max(seconds, 1e-9) / 1e9, "" if np is not None else ", without numpy"),
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
