import os
import shutil
import struct
import json
import pathlib
import sys

import pytest

# torch (where installed) before liblwo: both link libnccl.so.2, and torch's own
# copy, loaded first, serves liblwo too, while the system's older one, loaded
# first by liblwo, leaves torch without symbols it needs.
try:
    import torch  # noqa: F401
except Exception:  # not installed or not importable: its tests skip and say why
    pass

REPO = pathlib.Path(__file__).resolve().parents[2]
# Test the package of this source tree (python/lwo), installed or not.
sys.path.insert(0, str(REPO / "python"))
# An absolute LWO_LIBRARY, so that the tests' subprocesses (run elsewhere) load it too.
if os.environ.get("LWO_LIBRARY"):
    os.environ["LWO_LIBRARY"] = os.path.abspath(os.environ["LWO_LIBRARY"])
HEADER = REPO / "include" / "lwo.h"


def c_compiler():
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return shutil.which(cc)
    return None


@pytest.fixture
def cc():
    found = c_compiler()
    if found is None:
        pytest.skip("no C compiler (cc, gcc or clang) to check the mirrors against")
    return found


def write_safetensors(path, tensors, metadata=None):
    """Writes a safetensors file: tensors is a list of (name, dtype name,
    shape, bytes), laid out in the order given."""
    header = {}
    data = b""
    for name, dt, shape, raw in tensors:
        header[name] = {"dtype": dt, "shape": list(shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.write(data)
    return path
