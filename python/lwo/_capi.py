"""The raw C ABI of include/lwo.h (0.5) through ctypes.

Everything in this module mirrors the header one to one: the constants
(enum values and macros), the structs (ctypes.Structure with the same fields
in the same order) and every function, with its argtypes and restype. The
tests compare each struct's size and field offsets, and each constant, with
what the C compiler makes of include/lwo.h, so a mirror cannot drift.

The library is found by :func:`load` (see its docstring); ``lib`` is the
loaded ``ctypes.CDLL`` once :func:`load` has run (``lwo/__init__`` runs it).
"""

import ctypes
import ctypes.util
import glob
import os

# --------------------------------------------------------------------------
# Version: the ABI this package was written for.
# --------------------------------------------------------------------------
LWO_VERSION_MAJOR = 0
LWO_VERSION_MINOR = 5
LWO_VERSION_PATCH = 2
LWO_VERSION = LWO_VERSION_MAJOR * 10000 + LWO_VERSION_MINOR * 100 + LWO_VERSION_PATCH

# --------------------------------------------------------------------------
# lwo_status_t
# --------------------------------------------------------------------------
LWO_OK = 0
LWO_END = 1
LWO_ERR_INVALID_ARGUMENT = 100
LWO_ERR_INVALID_HANDLE = 101
LWO_ERR_OUT_OF_RANGE = 102
LWO_ERR_NOT_FOUND = 103
LWO_ERR_SIZE_MISMATCH = 104
LWO_ERR_FOREIGN_TICKET = 105
LWO_ERR_FOREIGN_OBJECT = 106
LWO_ERR_UNSUPPORTED = 107
LWO_ERR_QUANTIZED_WEIGHT = 108  # since 0.4.0
LWO_ERR_RING_FULL = 200
LWO_ERR_LAYER_BUSY = 201
LWO_ERR_STALE_TICKET = 202
LWO_ERR_TICKET_STATE = 203
LWO_ERR_BUSY = 204
LWO_ERR_FILE_CHANGED = 205
LWO_ERR_CAPTURING = 206  # since 0.6.0
LWO_ERR_OUT_OF_MEMORY = 300
LWO_ERR_IO = 301
LWO_ERR_OVER_BUDGET = 302  # since 0.4.0
LWO_ERR_NO_DEVICE = 400
LWO_ERR_CUDA = 401
LWO_ERR_CUBLAS = 402
LWO_ERR_CUDNN = 403
LWO_ERR_NCCL = 404
LWO_ERR_TRUNCATED = 500
LWO_ERR_BAD_HEADER_SIZE = 501
LWO_ERR_BAD_JSON = 502
LWO_ERR_BAD_DTYPE = 503
LWO_ERR_SHAPE_MISMATCH = 504
LWO_ERR_SHAPE_OVERFLOW = 505
LWO_ERR_BAD_RANGE = 506
LWO_ERR_OVERLAP = 507
LWO_ERR_COLLECTIVE_MISMATCH = 600
LWO_ERR_INTERNAL = 900
LWO_STATUS_FORCE_32 = 0x7FFFFFFF

#: Every status value, by its C name (not the FORCE_32 sentinel).
STATUSES = {
    name: value
    for name, value in list(globals().items())
    if name in ("LWO_OK", "LWO_END") or name.startswith("LWO_ERR_")
}

# The status classes (since 0.2.0).
LWO_STATUS_CLASS_SUCCESS = 0
LWO_STATUS_CLASS_ARGUMENT = 1
LWO_STATUS_CLASS_STATE = 2
LWO_STATUS_CLASS_RESOURCE = 3
LWO_STATUS_CLASS_DEVICE = 4
LWO_STATUS_CLASS_FORMAT = 5
LWO_STATUS_CLASS_COLLECTIVE = 6
LWO_STATUS_CLASS_INTERNAL = 9


def LWO_STATUS_CLASS(status):
    """The class of a status, as the C macro computes it (value / 100; since 0.2.0)."""
    return int(status) // 100


# --------------------------------------------------------------------------
# lwo_dtype_t and record layout
# --------------------------------------------------------------------------
LWO_DTYPE_F32 = 0
LWO_DTYPE_BF16 = 1
LWO_DTYPE_F16 = 2
LWO_DTYPE_F8_E4M3 = 3
LWO_DTYPE_F8_E5M2 = 4
LWO_DTYPE_I8 = 5
LWO_DTYPE_U8 = 6
# since 0.2.0: the other element types of safetensors checkpoints
LWO_DTYPE_BOOL = 7
LWO_DTYPE_I16 = 8
LWO_DTYPE_U16 = 9
LWO_DTYPE_I32 = 10
LWO_DTYPE_U32 = 11
LWO_DTYPE_I64 = 12
LWO_DTYPE_U64 = 13
LWO_DTYPE_F64 = 14
LWO_DTYPE_F8_E8M0 = 15
LWO_DTYPE_C64 = 16
LWO_DTYPE_FORCE_32 = 0x7FFFFFFF

#: Every dtype value, by its C name (not the FORCE_32 sentinel).
DTYPES = {
    name: value
    for name, value in list(globals().items())
    if name.startswith("LWO_DTYPE_") and name != "LWO_DTYPE_FORCE_32"
}

LWO_MAX_DIMS = 8
LWO_RECORD_ALIGN = 256
LWO_MAX_STRUCT_SIZE = 4096  # since 0.6.0

# --------------------------------------------------------------------------
# Flags and other enums
# --------------------------------------------------------------------------
LWO_ENGINE_CHECK_COLLECTIVES = 0x1
LWO_ENGINE_HEURISTIC_GEMM = 0x2  # since 0.3.0
LWO_ENGINE_CHECKING = 0x4
LWO_CHECKING_BYTE = 0xFF
LWO_HOST_LIMIT_NONE = 0xFFFFFFFFFFFFFFFF  # since 0.6.0

# lwo_pool_kind_t (since 0.2.0)
LWO_POOL_PINNED = 0
LWO_POOL_REGISTERED = 1
LWO_POOL_CHECKPOINT_MAPPED = 2
LWO_POOL_CHECKPOINT_STAGED = 3
LWO_POOL_SHARDED = 4
LWO_POOL_KIND_FORCE_32 = 0x7FFFFFFF

LWO_RING_TIMING = 0x1
LWO_RING_CAPTURE_WARM = 0x2
LWO_MAX_RING_DEPTH = 4096  # since 0.6.0
LWO_PLAN_TRAIN = 0x1  # since 0.4.0
LWO_PLAN_CALIBRATE_LINK = 0x2  # since 0.4.0
LWO_PLAN_GROUP = 0x4  # since 0.4.0

# lwo_ticket_state_t (since 0.2.0)
LWO_TICKET_STAGED = 1
LWO_TICKET_ACQUIRED = 2
LWO_TICKET_ENDED = 3
LWO_TICKET_STATE_FORCE_32 = 0x7FFFFFFF

LWO_LINEAR_BIAS = 0x1
LWO_LINEAR_TF32 = 0x2
LWO_LINEAR_ACCUMULATE = 0x4  # since 0.3.0

LWO_GRADS_NATIVE_WIRE = 0x1
LWO_GRADS_F32 = 0x2  # since 0.3.0

LWO_LAYOUT_NCHW = 0
LWO_LAYOUT_NHWC = 1
LWO_LAYOUT_FORCE_32 = 0x7FFFFFFF

LWO_CONV_BIAS = 0x1
LWO_CONV_TF32 = 0x2
LWO_CONV_ACCUMULATE = 0x4  # since 0.3.0

LWO_CHECKPOINT_STAGED = 0x1
LWO_CHECKPOINT_ALLOW_GAPS = 0x2  # since 0.2.0

LWO_NO_LAYER = 0xFFFFFFFF  # since 0.2.0

# lwo_quant_format_t (since 0.3.0)
LWO_QUANT_NONE = 0
LWO_QUANT_FP8_E4M3_CHANNEL = 1
LWO_QUANT_FP8_E4M3_BLOCK128 = 2
LWO_QUANT_INT8_CHANNEL = 3
LWO_QUANT_INT4_GROUP128 = 4
LWO_QUANT_FORMAT_FORCE_32 = 0x7FFFFFFF

# The optimizer (since 0.4.0)
LWO_OPTIM_ADAMW = 0
LWO_OPTIM_SGD = 1
LWO_OPTIM_KIND_FORCE_32 = 0x7FFFFFFF
LWO_OPTIM_STOCHASTIC_ROUNDING = 0x1
LWO_OPTIM_CLIPPING = 0x2
LWO_OPTIM_DELAYED = 0x4
LWO_OPTIM_MASTER = 0
LWO_OPTIM_M = 1
LWO_OPTIM_V = 2
LWO_OPTIM_STATE_FORCE_32 = 0x7FFFFFFF

# --------------------------------------------------------------------------
# Types
# --------------------------------------------------------------------------
# C enums of these ranges are int (the FORCE_32 members keep them 32-bit).
lwo_status_t = ctypes.c_int
lwo_dtype_t = ctypes.c_int
lwo_pool_kind_t = ctypes.c_int  # since 0.2.0
lwo_ticket_state_t = ctypes.c_int  # since 0.2.0
lwo_layout_t = ctypes.c_int
lwo_quant_format_t = ctypes.c_int  # since 0.3.0
# Opaque pointers: cudaStream_t, ncclComm_t and every lwo handle.
lwo_stream_t = ctypes.c_void_p
lwo_nccl_comm_t = ctypes.c_void_p
lwo_engine_p = ctypes.c_void_p
lwo_pool_p = ctypes.c_void_p
lwo_ring_p = ctypes.c_void_p
lwo_schedule_p = ctypes.c_void_p
lwo_grads_p = ctypes.c_void_p
lwo_checkpoint_p = ctypes.c_void_p
lwo_plan_p = ctypes.c_void_p  # since 0.4.0
lwo_optim_p = ctypes.c_void_p  # since 0.4.0
lwo_graph_p = ctypes.c_void_p  # since 0.6.0
lwo_optim_kind_t = ctypes.c_int
lwo_optim_state_t = ctypes.c_int

_size_t = ctypes.c_size_t
_i32 = ctypes.c_int32
_u32 = ctypes.c_uint32
_i64 = ctypes.c_int64
_u64 = ctypes.c_uint64
_vp = ctypes.c_void_p
_cp = ctypes.c_char_p
_shape = _i64 * LWO_MAX_DIMS


class _Struct(ctypes.Structure):
    """A struct of lwo.h; those with a leading ``size`` field get it set."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self._fields_[0][0] == "size" and "size" not in kwargs and not args:
            self.size = ctypes.sizeof(self)

    def __repr__(self):
        parts = ", ".join("%s=%r" % (f[0], getattr(self, f[0])) for f in self._fields_)
        return "%s(%s)" % (type(self).__name__, parts)


# since 0.2.0
class lwo_ext(_Struct):
    _fields_ = [("type", _i32), ("reserved", _u32), ("next", _vp)]


class lwo_tensor_desc(_Struct):
    _fields_ = [
        ("name", _cp),
        ("dtype", lwo_dtype_t),
        ("n_dims", _i32),
        ("shape", _shape),
        ("host_data", _vp),
        ("next", _vp),  # since 0.2.0
    ]


class lwo_layer_desc(_Struct):
    _fields_ = [
        ("tensors", ctypes.POINTER(lwo_tensor_desc)),
        ("n_tensors", _u32),
        ("next", _vp),  # since 0.2.0
    ]


class lwo_engine_config(_Struct):
    _fields_ = [
        ("size", _size_t),
        ("device", _i32),
        ("flags", _u32),
        # since 0.4.0: the device memory budget
        ("budget_bytes", _u64),
        ("budget_share", ctypes.c_double),
        ("budget_headroom", _u64),
        ("host_limit_bytes", _u64),  # since 0.6.0
    ]


# since 0.4.0
class lwo_engine_memory(_Struct):
    _fields_ = [
        ("size", _size_t),
        ("budget", _u64),
        ("used", _u64),
        ("left", _u64),
        ("ring_slots", _u64),
        ("resident", _u64),
        ("grads", _u64),
        ("workspaces", _u64),
        ("device_free", _u64),
        ("device_total", _u64),
    ]


class lwo_pool_config(_Struct):
    _fields_ = [("size", _size_t), ("flags", _u32), ("n_threads", _u32)]


class lwo_host_region(_Struct):
    _fields_ = [("data", _vp), ("bytes", _u64), ("next", _vp)]  # next: since 0.2.0


class lwo_pool_info(_Struct):
    _fields_ = [
        ("size", _size_t),
        ("n_layers", _u32),
        ("kind", lwo_pool_kind_t),  # since 0.2.0
        ("total_bytes", _u64),
        ("max_record_bytes", _u64),
        ("rank", _i32),  # since 0.2.0
        ("n_ranks", _i32),  # since 0.2.0
    ]


class lwo_tensor_info(_Struct):
    _fields_ = [
        ("size", _size_t),  # since 0.2.0
        ("name", _cp),
        ("dtype", lwo_dtype_t),
        ("n_dims", _i32),
        ("shape", _shape),
        ("offset", _u64),
        ("bytes", _u64),
        ("quant_format", _i32),  # since 0.4.0
    ]


class lwo_ticket(_Struct):
    _fields_ = [("id", _u64)]


class lwo_ring_config(_Struct):
    _fields_ = [
        ("size", _size_t),
        ("depth", _u32),
        ("flags", _u32),
        # since 0.4.0: resident layers
        ("resident_layers", ctypes.POINTER(_u32)),
        ("n_resident", _u32),
    ]


class lwo_layer_view(_Struct):
    _fields_ = [
        ("size", _size_t),  # since 0.2.0
        ("layer", _u32),
        ("n_tensors", _u32),
        ("base", _vp),
        ("record_bytes", _u64),
        ("tensors", ctypes.POINTER(_vp)),
        ("tensor_bytes", ctypes.POINTER(_u64)),  # since 0.2.0
        ("tensor_dtypes", ctypes.POINTER(lwo_dtype_t)),  # since 0.2.0
    ]


class lwo_ring_info(_Struct):
    _fields_ = [
        ("size", _size_t),
        ("depth", _u32),
        ("n_free", _u32),
        ("slot_bytes", _u64),
        ("n_resident", _u32),  # since 0.4.0
        ("resident_bytes", _u64),  # since 0.4.0
    ]


class lwo_ring_stats(_Struct):
    _fields_ = [
        ("size", _size_t),
        ("n_stages", _u64),
        ("n_hits", _u64),
        ("n_copies", _u64),
        ("bytes_copied", _u64),
        ("copy_ms", ctypes.c_double),
        ("wait_ms", ctypes.c_double),
        ("bandwidth_gbps", ctypes.c_double),
        # since 0.4.0: resident layers
        ("n_resident_hits", _u64),
        ("n_resident_uploads", _u64),
        ("resident_bytes_uploaded", _u64),
    ]


class lwo_linear_desc(_Struct):
    _fields_ = [
        ("size", _size_t),
        ("dtype", lwo_dtype_t),
        ("flags", _u32),
        ("in_features", _i64),
        ("out_features", _i64),
        ("weight_format", _i32),  # since 0.4.0
    ]


class lwo_grads_config(_Struct):
    _fields_ = [("size", _size_t), ("depth", _u32), ("flags", _u32), ("n_threads", _u32),
                ("replica_comm", lwo_nccl_comm_t)]  # since 0.6.0


class lwo_grads_stats(_Struct):
    _fields_ = [
        ("size", _size_t),
        ("n_transfers", _u64),
        ("bytes", _u64),
        ("n_accumulated", _u64),
        ("accumulated_bytes", _u64),  # since 0.3.0
        ("accumulate_ns", _u64),  # since 0.3.0
    ]


# The optimizer (since 0.4.0)
class lwo_optim_config(_Struct):
    _fields_ = [
        ("size", _size_t),
        ("kind", lwo_optim_kind_t),
        ("state_dtype", lwo_dtype_t),
        ("flags", _u32),
        ("n_threads", _u32),
        ("seed", _u64),
    ]


class lwo_optim_step_params(_Struct):
    _fields_ = [
        ("size", _size_t),
        ("step", _u64),
        ("lr", ctypes.c_double),
        ("beta1", ctypes.c_double),
        ("beta2", ctypes.c_double),
        ("eps", ctypes.c_double),
        ("weight_decay", ctypes.c_double),
        ("momentum", ctypes.c_double),
        ("dampening", ctypes.c_double),
        ("max_norm", ctypes.c_double),
        ("extra_sumsq", ctypes.c_double),  # since 0.6.0
    ]


class lwo_optim_info(_Struct):
    _fields_ = [
        ("size", _size_t),
        ("kind", lwo_optim_kind_t),
        ("state_dtype", lwo_dtype_t),
        ("flags", _u32),
        ("n_threads", _u32),
        ("n_numa_nodes", _u32),
        ("n_params", _u64),
        ("state_bytes", _u64),
        ("last_step", _u64),
        ("vector_level", _cp),
    ]


class lwo_optim_stats(_Struct):
    _fields_ = [
        ("size", _size_t),
        ("n_steps", _u64),
        ("n_layer_updates", _u64),
        ("n_params_updated", _u64),
        ("update_ns", _u64),
        ("landing_wait_ns", _u64),
        ("last_step_ns", _u64),
        ("last_tail_ns", _u64),
        ("n_clipped", _u64),
        ("n_redone", _u64),
        ("last_norm", ctypes.c_double),
    ]


# since 0.3.0
class lwo_grad_tensor(_Struct):
    _fields_ = [
        ("size", _size_t),
        ("data", ctypes.c_void_p),
        ("dtype", lwo_dtype_t),
        ("first_element", _u64),
        ("n_elements", _u64),
    ]


class lwo_conv2d_desc(_Struct):
    _fields_ = [
        ("size", _size_t),
        ("dtype", lwo_dtype_t),
        ("flags", _u32),
        ("layout", lwo_layout_t),
        ("in_channels", _i32),
        ("out_channels", _i32),
        ("kernel_h", _i32),
        ("kernel_w", _i32),
        ("stride_h", _i32),
        ("stride_w", _i32),
        ("pad_h", _i32),
        ("pad_w", _i32),
        ("dilation_h", _i32),
        ("dilation_w", _i32),
        ("groups", _i32),
        ("weight_format", _i32),  # since 0.5.0
    ]


# since 0.2.0
class lwo_checkpoint_file(_Struct):
    _fields_ = [("size", _size_t), ("path", _cp), ("bytes", _u64), ("n_tensors", _u32)]


class lwo_checkpoint_tensor(_Struct):
    _fields_ = [
        ("size", _size_t),
        ("name", _cp),
        ("dtype_name", _cp),
        ("dtype", _i32),
        ("n_dims", _i32),
        ("shape", _shape),
        ("bytes", _u64),
        ("file_offset", _u64),
        ("file", _u32),
        ("quant_format", _i32),  # since 0.4.0
        ("quant_partner", _u32),  # since 0.4.0
    ]


class lwo_checkpoint_pool_config(_Struct):
    _fields_ = [
        ("size", _size_t),
        ("pattern", _cp),
        ("names", ctypes.POINTER(_cp)),
        ("n_names", ctypes.POINTER(_u32)),
        ("n_layers", _u32),
        ("flags", _u32),
        ("patterns", ctypes.POINTER(_cp)),  # since 0.2.0
        ("n_patterns", _u32),  # since 0.2.0
    ]


class lwo_nccl_unique_id(_Struct):
    _fields_ = [("internal", ctypes.c_char * 128)]


# since 0.3.0
class lwo_quant_desc(_Struct):
    _fields_ = [
        ("size", _size_t),
        ("format", lwo_quant_format_t),
        ("dtype", lwo_dtype_t),
        ("rows", _i64),
        ("cols", _i64),
    ]


# since 0.3.0
class lwo_quant_layout_info(_Struct):
    _fields_ = [
        ("size", _size_t),
        ("data_offset", _u64),
        ("data_bytes", _u64),
        ("scale_offset", _u64),
        ("scale_bytes", _u64),
        ("scale_rows", _i64),
        ("scale_cols", _i64),
        ("total_bytes", _u64),
    ]


# -- quantized records (since 0.4.0) --
LWO_EXT_TENSOR_QUANT = 1


class lwo_tensor_quant_ext(_Struct):
    _fields_ = [("header", lwo_ext), ("format", lwo_quant_format_t), ("reserved", _u32)]


# since 0.4.0: the planner
class lwo_plan_config(_Struct):
    _fields_ = [
        ("size", _size_t),
        ("flags", _u32),
        ("grad_depth", _u32),
        ("budget_bytes", _u64),
        ("fwd_ms", ctypes.POINTER(ctypes.c_double)),
        ("bwd_ms", ctypes.POINTER(ctypes.c_double)),
        ("trainable", ctypes.POINTER(ctypes.c_uint8)),
        ("grad_bytes", ctypes.POINTER(_u64)),
        ("h2d_gbps", ctypes.c_double),
        ("d2h_gbps", ctypes.c_double),
        ("duplex_h2d_gbps", ctypes.c_double),
        ("duplex_d2h_gbps", ctypes.c_double),
        ("calibrate_bytes", _u64),
        ("depths", ctypes.POINTER(_u32)),
        ("n_depths", _u32),
        ("copy_overhead_ms", ctypes.c_double),
    ]


class lwo_plan_info(_Struct):
    _fields_ = [
        ("size", _size_t),
        ("depth", _u32),
        ("n_resident", _u32),
        ("n_positions", _u32),
        ("train", _u32),
        ("device_bytes", _u64),
        ("budget_bytes", _u64),
        ("predicted_ms", ctypes.c_double),
        ("predicted_stall_ms", ctypes.c_double),
        ("h2d_bytes", _u64),
        ("d2h_bytes", _u64),
        ("h2d_gbps", ctypes.c_double),
        ("d2h_gbps", ctypes.c_double),
        ("duplex_h2d_gbps", ctypes.c_double),
        ("duplex_d2h_gbps", ctypes.c_double),
        ("first_k_ms", ctypes.c_double),
        ("n_groups", _u32),
        ("reserved", _u32),
        ("ungrouped_ms", ctypes.c_double),
        ("copy_overhead_ms", ctypes.c_double),
    ]


class lwo_plan_position(_Struct):
    _fields_ = [
        ("size", _size_t),
        ("layer", _u32),
        ("backward", _u32),
        ("resident", _u32),
        ("hit", _u32),
        ("copy_ms", ctypes.c_double),
        ("start_ms", ctypes.c_double),
        ("stall_ms", ctypes.c_double),
    ]


class lwo_plan_group(_Struct):
    _fields_ = [
        ("size", _size_t),
        ("first_layer", _u32),
        ("n_layers", _u32),
        ("resident", _u32),
        ("reserved", _u32),
        ("bytes", _u64),
    ]


#: Every struct of lwo.h, by its C name.
STRUCTS = {
    cls.__name__: cls
    for cls in [
        lwo_ext, lwo_tensor_desc, lwo_layer_desc, lwo_engine_config, lwo_engine_memory,
        lwo_pool_config,
        lwo_host_region, lwo_pool_info, lwo_tensor_info, lwo_ticket, lwo_ring_config,
        lwo_layer_view, lwo_ring_info, lwo_ring_stats, lwo_linear_desc, lwo_grads_config,
        lwo_grad_tensor, lwo_grads_stats, lwo_conv2d_desc, lwo_checkpoint_file, lwo_checkpoint_tensor,
        lwo_checkpoint_pool_config, lwo_nccl_unique_id, lwo_quant_desc, lwo_quant_layout_info,
        lwo_tensor_quant_ext,
        lwo_plan_config, lwo_plan_info, lwo_plan_position, lwo_plan_group,
        lwo_optim_config, lwo_optim_step_params, lwo_optim_info, lwo_optim_stats,
    ]
}

# --------------------------------------------------------------------------
# Functions: name -> (restype, argtypes), in the header's order.
# --------------------------------------------------------------------------
_P = ctypes.POINTER
_S = lwo_status_t
FUNCTIONS = {
    "lwo_version": (ctypes.c_uint, []),
    "lwo_status_string": (_cp, [lwo_status_t]),
    "lwo_last_error_message": (_cp, []),
    "lwo_dtype_size": (_size_t, [lwo_dtype_t]),
    "lwo_dtype_name": (_cp, [lwo_dtype_t]),
    "lwo_record_layout": (_S, [_P(lwo_layer_desc), _P(_u64), _P(_u64)]),
    # engine
    "lwo_engine_config_init": (None, [_P(lwo_engine_config)]),
    "lwo_engine_create": (_S, [_P(lwo_engine_config), _P(lwo_engine_p)]),
    "lwo_engine_destroy": (_S, [lwo_engine_p]),
    "lwo_engine_device": (_S, [lwo_engine_p, _P(_i32)]),
    # since 0.4.0: the device memory budget
    "lwo_engine_set_budget": (_S, [lwo_engine_p, _u64, ctypes.c_double, _u64]),
    "lwo_engine_get_memory": (_S, [lwo_engine_p, _P(lwo_engine_memory)]),
    "lwo_engine_set_host_limit": (_S, [lwo_engine_p, _u64]),  # since 0.6.0
    "lwo_engine_host_usage": (_S, [lwo_engine_p, _P(_u64), _P(_u64)]),
    "lwo_engine_transfer_stream": (_S, [lwo_engine_p, _P(lwo_stream_t)]),
    "lwo_engine_check": (_S, [lwo_engine_p]),
    "lwo_engine_synchronize": (_S, [lwo_engine_p]),
    # pools
    "lwo_pool_config_init": (None, [_P(lwo_pool_config)]),
    "lwo_pool_create_pinned": (
        _S, [lwo_engine_p, _P(lwo_layer_desc), _u32, _P(lwo_pool_config), _P(lwo_pool_p)]),
    "lwo_pool_create_registered": (
        _S, [lwo_engine_p, _P(lwo_layer_desc), _u32, _P(lwo_host_region), _u32,
             _P(lwo_pool_config), _P(lwo_pool_p)]),
    "lwo_pool_destroy": (_S, [lwo_pool_p]),
    "lwo_pool_get_info": (_S, [lwo_pool_p, _P(lwo_pool_info)]),
    "lwo_pool_layer_tensor_count": (_S, [lwo_pool_p, _u32, _P(_u32)]),
    "lwo_pool_tensor_info": (_S, [lwo_pool_p, _u32, _u32, _P(lwo_tensor_info)]),
    "lwo_pool_find_tensor": (_S, [lwo_pool_p, _u32, _cp, _P(_u32)]),
    "lwo_pool_record_bytes": (_S, [lwo_pool_p, _u32, _P(_u64)]),
    "lwo_pool_write": (_S, [lwo_pool_p, _u32, _cp, _vp, _u64]),
    "lwo_pool_write_range": (_S, [lwo_pool_p, _u32, _cp, _u64, _vp, _u64]),  # since 0.2.0
    "lwo_pool_layer_host": (_S, [lwo_pool_p, _u32, _P(_vp), _P(_u64)]),
    "lwo_pool_layer_changed": (_S, [lwo_pool_p, _u32]),
    "lwo_pool_tensor_host": (_S, [lwo_pool_p, _u32, _cp, _P(_vp), _P(_u64)]),
    # rings
    "lwo_ring_config_init": (None, [_P(lwo_ring_config)]),
    "lwo_ring_create": (_S, [lwo_pool_p, _P(lwo_ring_config), _P(lwo_ring_p)]),
    "lwo_ring_destroy": (_S, [lwo_ring_p]),
    "lwo_ring_stage": (_S, [lwo_ring_p, _u32, _P(lwo_ticket)]),
    "lwo_ring_acquire": (_S, [lwo_ring_p, lwo_ticket, lwo_stream_t, _P(lwo_layer_view)]),
    "lwo_ring_tensor": (_S, [lwo_ring_p, lwo_ticket, _cp, _P(_vp)]),
    "lwo_ring_query": (_S, [lwo_ring_p, lwo_ticket, _P(_u32)]),  # since 0.2.0
    "lwo_ring_ticket_state": (_S, [lwo_ring_p, lwo_ticket, _P(lwo_ticket_state_t)]),  # since 0.2.0
    "lwo_ring_release": (_S, [lwo_ring_p, lwo_ticket, lwo_stream_t]),
    "lwo_ring_release_all": (_S, [lwo_ring_p, lwo_stream_t, _P(_u32)]),  # since 0.2.0
    "lwo_ring_get_info": (_S, [lwo_ring_p, _P(lwo_ring_info)]),
    "lwo_ring_get_stats": (_S, [lwo_ring_p, _P(lwo_ring_stats)]),
    "lwo_ring_reset_stats": (_S, [lwo_ring_p]),
    # CUDA graphs of a ring's passes (since 0.6.0)
    "lwo_ring_capture_begin": (_S, [lwo_ring_p, lwo_stream_t]),
    "lwo_ring_capture_end": (_S, [lwo_ring_p, lwo_stream_t, _P(lwo_graph_p)]),
    "lwo_graph_launch": (_S, [lwo_graph_p, lwo_stream_t]),
    "lwo_graph_destroy": (_S, [lwo_graph_p]),
    "lwo_ring_capture_join": (_S, [lwo_ring_p, lwo_stream_t]),
    "lwo_ring_capture_leave": (_S, [lwo_ring_p, lwo_stream_t]),
    "lwo_ring_capture_replay": (_S, [lwo_ring_p, lwo_stream_t]),
    "lwo_ring_capture_release": (_S, [lwo_ring_p, lwo_stream_t]),
    # schedules
    "lwo_schedule_create": (_S, [lwo_ring_p, _P(_u32), _u32, _P(lwo_schedule_p)]),
    "lwo_schedule_destroy": (_S, [lwo_schedule_p]),
    "lwo_schedule_next": (_S, [lwo_schedule_p, lwo_stream_t, _P(lwo_layer_view)]),
    "lwo_schedule_position": (_S, [lwo_schedule_p, _P(_u32)]),
    "lwo_schedule_reset": (_S, [lwo_schedule_p, lwo_stream_t]),
    # since 0.4.0: the planner
    "lwo_plan_config_init": (None, [_P(lwo_plan_config)]),
    "lwo_plan_create": (_S, [lwo_pool_p, _P(lwo_plan_config), _P(lwo_plan_p)]),
    "lwo_plan_destroy": (_S, [lwo_plan_p]),
    "lwo_plan_get_info": (_S, [lwo_plan_p, _P(lwo_plan_info)]),
    "lwo_plan_get_position": (_S, [lwo_plan_p, _u32, _P(lwo_plan_position)]),
    "lwo_plan_ring_config": (_S, [lwo_plan_p, _P(lwo_ring_config)]),
    "lwo_plan_get_group": (_S, [lwo_plan_p, _u32, _P(lwo_plan_group)]),
    # linear
    "lwo_linear_desc_init": (None, [_P(lwo_linear_desc)]),
    "lwo_linear_forward": (
        _S, [lwo_engine_p, _P(lwo_linear_desc), _i64, _vp, _vp, _vp, _vp, lwo_stream_t]),
    "lwo_linear_backward": (
        _S, [lwo_engine_p, _P(lwo_linear_desc), _i64, _vp, _vp, _vp, _vp, _vp, _vp,
             lwo_dtype_t, lwo_stream_t]),
    # grads
    "lwo_grads_config_init": (None, [_P(lwo_grads_config)]),
    "lwo_grads_create": (
        _S, [lwo_pool_p, _P(ctypes.c_uint8), _P(lwo_grads_config), _P(lwo_grads_p)]),
    "lwo_grads_destroy": (_S, [lwo_grads_p]),
    "lwo_grads_begin": (_S, [lwo_grads_p, _u32, lwo_stream_t, _P(lwo_layer_view)]),
    "lwo_grads_end": (_S, [lwo_grads_p, _u32, lwo_stream_t]),
    "lwo_grads_wait": (_S, [lwo_grads_p]),
    "lwo_grads_zero": (_S, [lwo_grads_p]),
    "lwo_grads_query": (_S, [lwo_grads_p, _P(_u32)]),  # since 0.2.0
    "lwo_grads_tensor": (_S, [lwo_grads_p, _u32, _cp, _P(lwo_grad_tensor)]),  # since 0.3.0
    "lwo_grads_shard": (
        _S, [lwo_grads_p, _u32, _cp, _P(_P(ctypes.c_float)), _P(_u64), _P(_u64)]),
    "lwo_grads_get_stats": (_S, [lwo_grads_p, _P(lwo_grads_stats)]),
    # the optimizer (since 0.4.0)
    "lwo_optim_config_init": (None, [_P(lwo_optim_config)]),
    "lwo_optim_create": (_S, [lwo_grads_p, _P(lwo_optim_config), _P(lwo_optim_p)]),
    "lwo_optim_destroy": (_S, [lwo_optim_p]),
    "lwo_optim_step_params_init": (None, [_P(lwo_optim_step_params)]),
    "lwo_optim_step": (_S, [lwo_optim_p, _P(lwo_optim_step_params)]),
    "lwo_optim_set_group": (_S, [lwo_optim_p, _u32, _cp, _u32]),  # since 0.6.0
    "lwo_optim_step_groups": (_S, [lwo_optim_p, _P(lwo_optim_step_params), _u32]),  # since 0.6.0
    "lwo_optim_step_open": (_S, [lwo_optim_p, _P(lwo_optim_step_params), _u32]),  # since 0.6.0
    "lwo_optim_step_add": (_S, [lwo_optim_p, _u32]),  # since 0.6.0
    "lwo_optim_step_close": (_S, [lwo_optim_p]),  # since 0.6.0
    "lwo_optim_wait": (_S, [lwo_optim_p]),
    "lwo_optim_query": (_S, [lwo_optim_p, _P(_u32)]),
    "lwo_optim_read": (_S, [lwo_optim_p, _u32, _cp, lwo_optim_state_t, _vp, _u64]),
    "lwo_optim_write": (_S, [lwo_optim_p, _u32, _cp, lwo_optim_state_t, _vp, _u64]),
    "lwo_optim_get_info": (_S, [lwo_optim_p, _P(lwo_optim_info)]),
    "lwo_optim_get_stats": (_S, [lwo_optim_p, _P(lwo_optim_stats)]),
    # conv2d
    "lwo_conv2d_desc_init": (None, [_P(lwo_conv2d_desc)]),
    "lwo_conv2d_output_size": (_S, [_P(lwo_conv2d_desc), _i32, _i32, _P(_i32), _P(_i32)]),
    "lwo_conv2d_forward": (
        _S, [lwo_engine_p, _P(lwo_conv2d_desc), _i32, _i32, _i32, _vp, _vp, _vp, _vp,
             lwo_stream_t]),
    "lwo_conv2d_backward": (
        _S, [lwo_engine_p, _P(lwo_conv2d_desc), _i32, _i32, _i32, _vp, _vp, _vp, _vp, _vp,
             _vp, lwo_dtype_t, lwo_stream_t]),
    # checkpoints
    "lwo_checkpoint_open": (_S, [_cp, _P(lwo_checkpoint_p)]),
    "lwo_checkpoint_destroy": (_S, [lwo_checkpoint_p]),  # since 0.2.0 (was _close)
    "lwo_checkpoint_file_count": (_S, [lwo_checkpoint_p, _P(_u32)]),  # since 0.2.0
    "lwo_checkpoint_file_info":  # since 0.2.0
        (_S, [lwo_checkpoint_p, _u32, _P(lwo_checkpoint_file)]),
    "lwo_checkpoint_metadata_count": (_S, [lwo_checkpoint_p, _P(_u32)]),  # since 0.2.0
    "lwo_checkpoint_metadata":  # since 0.2.0
        (_S, [lwo_checkpoint_p, _u32, _P(_u32), _P(_cp), _P(_cp)]),
    "lwo_checkpoint_tensor_count": (_S, [lwo_checkpoint_p, _P(_u32)]),
    "lwo_checkpoint_tensor_info": (_S, [lwo_checkpoint_p, _u32, _P(lwo_checkpoint_tensor)]),
    "lwo_checkpoint_pool_config_init": (None, [_P(lwo_checkpoint_pool_config)]),
    "lwo_pool_create_from_checkpoint": (
        _S, [lwo_engine_p, lwo_checkpoint_p, _P(lwo_checkpoint_pool_config), _P(lwo_pool_p)]),
    "lwo_checkpoint_unmatched_count": (
        _S, [lwo_checkpoint_p, _P(lwo_checkpoint_pool_config), _P(_u32)]),
    "lwo_checkpoint_unmatched_name": (
        _S, [lwo_checkpoint_p, _P(lwo_checkpoint_pool_config), _u32, _P(_cp)]),
    "lwo_checkpoint_map_tensors": (  # since 0.2.0
        _S, [lwo_checkpoint_p, _P(lwo_checkpoint_pool_config), _u32, _P(_u32), _P(_cp),
             _P(_u32)]),
    # nccl
    "lwo_nccl_get_unique_id": (_S, [_P(lwo_nccl_unique_id)]),
    "lwo_nccl_comm_create": (
        _S, [lwo_engine_p, _P(lwo_nccl_unique_id), _i32, _i32, _P(lwo_nccl_comm_t)]),
    "lwo_nccl_comm_split": (  # since 0.6.0
        _S, [lwo_engine_p, lwo_nccl_comm_t, _i32, _i32, _P(lwo_nccl_comm_t)]),
    "lwo_nccl_comm_destroy": (_S, [lwo_nccl_comm_t]),
    "lwo_pool_create_sharded": (
        _S, [lwo_engine_p, _P(lwo_layer_desc), _u32, lwo_nccl_comm_t, _P(lwo_pool_config),
             _P(lwo_pool_p)]),
    "lwo_pool_shard_host": (_S, [lwo_pool_p, _u32, _P(_vp), _P(_u64), _P(_u64)]),
    "lwo_pool_shard_tensor": (_S, [lwo_pool_p, _u32, _cp, _P(_vp), _P(_u64), _P(_u64)]),
    # quantized weights (since 0.3.0)
    "lwo_quant_desc_init": (None, [_P(lwo_quant_desc)]),
    "lwo_quant_layout": (_S, [_P(lwo_quant_desc), _P(lwo_quant_layout_info)]),
    "lwo_quant_format_name": (_cp, [lwo_quant_format_t]),
    "lwo_quantize": (_S, [_P(lwo_quant_desc), _vp, _u64, _vp, _u64, _u32]),
    "lwo_dequantize_host": (_S, [_P(lwo_quant_desc), _vp, _u64, _vp, _u64, _u32]),
    "lwo_dequantize": (_S, [lwo_engine_p, _P(lwo_quant_desc), _vp, _vp, lwo_stream_t]),
    # quantized records (since 0.4.0)
    "lwo_pool_write_quantized": (_S, [lwo_pool_p, _u32, _cp, _vp, lwo_dtype_t, _u64, _u32]),
}

# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------
lib = None
path = None  #: the file the library was loaded from (or the loader's name)

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_PACKAGE_DIR))
# The source tree's build folder: only when the package is the one in the
# repository (python/lwo beside include/lwo.h), not an installed copy.
_REPO_BUILD = os.path.join(_REPO, "build", "liblwo.so") \
    if os.path.isfile(os.path.join(_REPO, "include", "lwo.h")) else None


class LibraryNotFound(ImportError):
    """liblwo could not be loaded from any of the places looked at."""


class VersionMismatch(ImportError):
    """The loaded liblwo is not the ABI version this package was written for."""


def candidates():
    """The places :func:`load` tries, in order, as (description, path-or-name)."""
    out = []
    env = os.environ.get("LWO_LIBRARY")
    if env:
        return [("the LWO_LIBRARY environment variable", env)]
    for f in sorted(glob.glob(os.path.join(_PACKAGE_DIR, "liblwo.so*"))):
        out.append(("next to the package", f))
    if not out:
        out.append(("next to the package", os.path.join(_PACKAGE_DIR, "liblwo.so*")))
    if _REPO_BUILD is not None:
        out.append(("the repository's build folder", _REPO_BUILD))
    found = ctypes.util.find_library("lwo")
    if found:
        out.append(("the system loader (ctypes.util.find_library)", found))
    out.append(("the system loader", "liblwo.so.%d.%d" % (LWO_VERSION_MAJOR, LWO_VERSION_MINOR)))
    return out


def _declare(library, where="liblwo"):
    for name, (restype, argtypes) in FUNCTIONS.items():
        try:
            fn = getattr(library, name)
        except AttributeError:
            raise VersionMismatch(
                "lwo: %s lacks %s, which this package calls: it is an older build of the "
                "same ABI version; build liblwo from the same source as the package"
                % (where, name)) from None
        fn.restype = restype
        fn.argtypes = argtypes


def load(force=False):
    """Loads liblwo and declares every function; returns the ctypes.CDLL.

    Looks, in order: the file named by the environment variable LWO_LIBRARY
    (only there, when it is set); liblwo.so* next to this package; the
    repository's build folder (build/liblwo.so beside python/); the system
    loader (ctypes.util.find_library("lwo"), then "liblwo.so.0.5"). Raises
    LibraryNotFound naming every place looked at and why each failed, and
    VersionMismatch when the library is not lwo 0.5.x.
    """
    global lib, path
    if lib is not None and not force:
        return lib
    tried = []
    for where, cand in candidates():
        is_file = os.sep in cand
        if is_file and "*" in cand:
            tried.append("%s: %s (no such file)" % (where, cand))
            continue
        if is_file and not os.path.exists(cand):
            tried.append("%s: %s (no such file)" % (where, cand))
            continue
        try:
            library = ctypes.CDLL(cand)
        except OSError as e:
            why = str(e)
            if not is_file and os.path.exists(cand):
                why += ("; a name without a folder is looked up by the system loader "
                        "(LD_LIBRARY_PATH, ldconfig's paths), not in the current folder: "
                        "give ./%s for that file" % cand)
            tried.append("%s: %s (%s)" % (where, cand, why))
            continue
        try:
            library.lwo_version.restype = ctypes.c_uint
            library.lwo_version.argtypes = []
            version = library.lwo_version()
        except AttributeError:
            tried.append("%s: %s (not liblwo: no lwo_version)" % (where, cand))
            continue
        major, minor, patch = version // 10000, version // 100 % 100, version % 100
        if (major, minor) != (LWO_VERSION_MAJOR, LWO_VERSION_MINOR):
            raise VersionMismatch(
                "lwo: %s (%s) is liblwo %d.%d.%d, but this package binds the %d.%d ABI: "
                "install or build liblwo %d.%d.x, or the lwo Python package of %d.%d"
                % (cand, where, major, minor, patch, LWO_VERSION_MAJOR, LWO_VERSION_MINOR,
                   LWO_VERSION_MAJOR, LWO_VERSION_MINOR, major, minor))
        _declare(library, "%s (%s, liblwo %d.%d.%d)" % (cand, where, major, minor, patch))
        lib, path = library, cand
        return lib
    raise LibraryNotFound(
        "lwo: cannot load liblwo; looked at:\n  " + "\n  ".join(tried) +
        "\nBuild it (cmake -S . -B build && cmake --build build) or set LWO_LIBRARY "
        "to the path of liblwo.so")

#: What ``from lwo._capi import *`` gives: the constants, types and structs.
__all__ = sorted(n for n in list(globals()) if n.startswith(("LWO_", "lwo_")))
