"""lwo: layer-wise weight offload, from Python.

A pure-Python package over liblwo's C ABI (include/lwo.h, version 0.5)
through ctypes. Importing it loads liblwo (see lwo._capi.load for where it
looks: $LWO_LIBRARY, next to this package, the repository's build folder,
the system loader) and checks that it is a 0.5.x library.

The objects (Engine, Pool, Ring, Schedule, Grads, Checkpoint, NcclComm) are
context managers whose close() destroys the C object; a failing call raises
an lwo.Error subclass by status class. The raw C API, with every struct,
constant and function, is lwo.capi (lwo.capi.lib is the ctypes library).
"""

from . import _capi as capi

capi.load()

from ._capi import *  # noqa: E402,F401,F403  (the constants: LWO_OK, LWO_DTYPE_BF16, ...)
from ._capi import LibraryNotFound, VersionMismatch  # noqa: E402,F401
from ._errors import (  # noqa: E402,F401
    ArgumentError, CollectiveError, DeviceError, Error, FormatError, InternalError,
    OverBudgetError, ResourceError, StateError, check, error_class, last_error_message, status_string,
)
from ._core import (  # noqa: E402,F401
    Checkpoint, CheckpointFile, CheckpointTensor, Engine, GradTensor, Grads, GradsStats, HostMemory,
    LayerView, MappedTensor, MetadataEntry, NcclComm, OptimInfo, Optimizer, OptimStats, Pool,
    PoolInfo, QUANT_FORMATS, QuantLayout, QuantizedTensor, Ring, RingInfo,
    RingStats, Schedule, ShardMemory, TensorInfo, TensorMap, TensorShard, TensorSpec,
    TensorView, Ticket, conv2d_desc, conv2d_output_size, device_pointer, dtype, dtype_name,
    dtype_size, linear_desc, nccl_get_unique_id, record_layout, stream_handle, version,
    quant_format, quant_format_name, quant_layout, quant_spelling, quantize, dequantize,
)

__version__ = "0.5.2"
