"""Making a GPU current for the calling thread, in torch and in the driver alike.

torch sets the current device lazily: `torch.cuda.set_device` (and `torch.cuda.device`) may only note the
target and leave the driver's current context on another GPU until torch next needs it. Triton's launcher,
the loader's copies (cuda-bindings) and the native reader act on the driver's current context, so a thread
working for a second GPU must have that GPU's primary context current before they run."""

from __future__ import annotations

from runtime.cuda_driver import call


def use_device(device) -> None:
    """Make DEVICE (a torch.device naming a GPU index) current for the calling thread; no-op for the host or
    for plain `cuda` (the current GPU)."""
    if device.type != "cuda" or device.index is None:
        return
    import torch

    torch.cuda.set_device(device)
    _make_current(device.index)


def _make_current(index: int) -> None:
    from cuda.bindings import driver as d

    gpu = call(d.cuDeviceGet(index), "cuDeviceGet")
    # retained for the process's life: the primary context is torch's too and is never destroyed before exit
    context = call(d.cuDevicePrimaryCtxRetain(gpu), "cuDevicePrimaryCtxRetain")
    call(d.cuCtxSetCurrent(context), "cuCtxSetCurrent")


def init_driver() -> None:
    """`cuInit`, through ctypes with the GIL released; no context is made."""
    from runtime.cuda_driver.graphs import check, lib

    check(lib().cuInit(0), "cuInit")


def create_primary_context(index: int) -> None:
    """Create GPU INDEX's primary context (the one torch, Triton and the loader share) through the driver, with
    the GIL released for the whole call (ctypes). Made by torch's first allocation instead, the same work holds
    the GIL, and in a restored runtime, which makes its context on a thread while the bootstrap runs again, it
    held the bootstrap up for as long (0.19-0.21 s of the process restore on the H100)."""
    from ctypes import byref, c_int, c_void_p

    from runtime.cuda_driver.graphs import check, lib

    cu = lib()
    check(cu.cuInit(0), "cuInit")
    gpu, context = c_int(), c_void_p()
    check(cu.cuDeviceGet(byref(gpu), index), "cuDeviceGet")
    # retained for the process's life, as _make_current's: torch retains the same context when it starts
    check(cu.cuDevicePrimaryCtxRetain(byref(context), gpu), "cuDevicePrimaryCtxRetain")


def private_stream(device):
    """A stream of DEVICE's (a torch.device) that nothing else in the process is handed: made by the driver,
    not taken from torch's pool. torch hands its pooled streams out round robin (32 per device), so a pooled
    stream used for a capture is, a few weight loads later, also one of the loader's copy streams; a copy
    queued on it from a reader thread while the capture runs invalidates the capture. The stream lives as long
    as the process (a runner keeps its own for its captures)."""
    import torch
    from cuda.bindings import driver as d

    use_device(device)
    # the driver call needs a current context, which torch makes current in a new thread only when it first
    # calls CUDA there
    _make_current(device.index if device.index is not None else torch.cuda.current_device())
    handle = call(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
    return torch.cuda.ExternalStream(int(handle), device=device)
