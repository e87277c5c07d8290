"""Statuses as exceptions: lwo.Error and one subclass per status class."""

from . import _capi


class Error(Exception):
    """A call of liblwo failed.

    ``status`` is the lwo_status_t value, ``status_name`` its C name
    (lwo_status_string), ``message`` the text of lwo_last_error_message(),
    which starts with the name of the C function that failed.
    """

    status_class = None

    def __init__(self, status, message="", status_name=None):
        self.status = int(status)
        self.status_name = status_name or _status_name(self.status)
        self.message = message
        super().__init__("%s: %s" % (self.status_name, message) if message else self.status_name)


class ArgumentError(Error, ValueError):
    """1xx: the call was given something wrong."""
    status_class = _capi.LWO_STATUS_CLASS_ARGUMENT


class StateError(Error):
    """2xx: the objects are not in a state that allows the call now."""
    status_class = _capi.LWO_STATUS_CLASS_STATE


class ResourceError(Error, OSError):
    """3xx: host or device memory, files."""
    status_class = _capi.LWO_STATUS_CLASS_RESOURCE

    def __init__(self, status, message="", status_name=None):
        Error.__init__(self, status, message, status_name)

    def __str__(self):
        return Error.__str__(self)


class OverBudgetError(ResourceError, MemoryError):
    """LWO_ERR_OVER_BUDGET: the engine's device budget or host memory limit
    has too little left; the message names the call and the bytes."""


class DeviceError(Error):
    """4xx: no device, or CUDA / cuBLAS / cuDNN / NCCL failed."""
    status_class = _capi.LWO_STATUS_CLASS_DEVICE


class FormatError(Error):
    """5xx: a checkpoint file is malformed."""
    status_class = _capi.LWO_STATUS_CLASS_FORMAT


class CollectiveError(Error):
    """6xx: the ranks of a communicator disagree."""
    status_class = _capi.LWO_STATUS_CLASS_COLLECTIVE


class InternalError(Error):
    """9xx: a bug in lwo (please report the message)."""
    status_class = _capi.LWO_STATUS_CLASS_INTERNAL


_BY_CLASS = {
    cls.status_class: cls
    for cls in (ArgumentError, StateError, ResourceError, DeviceError, FormatError,
                CollectiveError, InternalError)
}


_BY_STATUS = {_capi.LWO_ERR_OVER_BUDGET: OverBudgetError}


def error_class(status):
    """The exception class for a failing status (Error for an unknown class)."""
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    return _BY_CLASS.get(_capi.LWO_STATUS_CLASS(status), Error)


def _status_name(status):
    if _capi.lib is None:
        for name, value in _capi.STATUSES.items():
            if value == status:
                return name
        return "unknown status"
    return _capi.lib.lwo_status_string(status).decode()


def status_string(status):
    """lwo_status_string: the C name of a status ("unknown status" if none)."""
    status = int(status)
    if not -(1 << 31) <= status < (1 << 31):  # no lwo_status_t (ctypes would wrap it)
        return "unknown status"
    return _capi.lib.lwo_status_string(status).decode()


def last_error_message():
    """lwo_last_error_message of the calling thread ("" after a success)."""
    return _capi.lib.lwo_last_error_message().decode(errors="replace")


def check(status):
    """Raises the Error for a failing status; returns LWO_OK or LWO_END."""
    if status == _capi.LWO_OK or status == _capi.LWO_END:
        return status
    message = last_error_message()  # read first: the next lwo call may clear it
    raise error_class(status)(status, message)
