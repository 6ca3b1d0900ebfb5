"""The idle I/O class for the threads that read the weights from disk during a start (the entry point's
prefetch, the weights' helper): the disk's scheduler, where it has classes (mq-deadline, BFQ), serves every
other read first (CRIU's image and the files it opens, the bootstrap's imports, the restored runtime's
libraries: small reads that a start waits for), and the weights have the disk whenever those leave it. A
thread made by a thread in the class is in it too."""

from __future__ import annotations

import os

#: ioprio_set(2) by machine
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}
_IOPRIO_WHO_PROCESS = 1  # with 0: the calling thread
IOPRIO_CLASS_IDLE = 3
IOPRIO_CLASS_SHIFT = 13


def idle_io() -> bool:
    """Put the calling thread's disk reads in the idle I/O class; False where the kernel refused or the machine
    is not known. Needs no privilege."""
    machine = os.uname().machine
    if machine not in _IOPRIO_SET:
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(_IOPRIO_SET[machine], _IOPRIO_WHO_PROCESS, 0, IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT) == 0
