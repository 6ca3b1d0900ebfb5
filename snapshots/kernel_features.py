"""criu's record of the kernel's features, taken by faas-build and handed to each restore.

Every criu run begins by probing what the kernel can do (netlink, iptables, userfaultfd, the vDSO...: 20-25 ms
of a restore's criu on the CPU machine, 25-68 ms on an H200 machine) unless it finds its record of them,
`/run/criu.kdat`. criu keeps
that record only where /run is a tmpfs, so that a reboot, perhaps into another kernel, takes it away. In a
container /run is a directory of the image, and a serverless start is its container's first criu run anyway:
every restore probed. So faas-build has criu probe once, in a mount namespace of its own whose /run is a tmpfs,
and writes the record into each CRIU snapshot's manifest with the machine it describes (`machine()`: the
kernel's release and build, the CPU's model and flags) and its CRC-32.

Before a restore starts criu, `offer` writes the record to /dev/shm (a tmpfs: gone after a reboot, as criu
wants) and links /run/criu.kdat to it, where this machine is the one the record describes, the record is
intact and /run/criu.kdat is not criu's own; `withdraw` takes the link away once criu has restored, so no other
criu run finds it later (a dump reads fields of the record that hold for one boot only). A record written by
another build of criu is refused by criu itself, which then probes as it always did. Imports os and zlib: it is
on the way to the early restore's criu.
"""

from __future__ import annotations

import os
import zlib

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Mapping

#: where criu looks for its record (fixed when criu is built), and where `offer` writes it
RUN_RECORD = "/run/criu.kdat"
SHM_RECORD = "/dev/shm/thawllm-criu.kdat"
#: the lines of a CPU's /proc/cpuinfo entry the record depends on (x86, then arm64 names)
CPU_FIELDS = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags",
              "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "CPU revision", "Features")


def machine() -> dict[str, str]:
    """What a record of kernel features holds for: this kernel's build and the first CPU's model and flags."""
    uname = os.uname()
    with open("/proc/cpuinfo", "rb") as f:
        first = f.read(1 << 16).split(b"\n\n", 1)[0].decode(errors="replace")
    fields = {name.strip(): value.strip() for name, _, value in (line.partition(":") for line in first.splitlines())}
    cpu = "; ".join(f"{name}: {fields[name]}" for name in CPU_FIELDS if name in fields)
    return {"kernel": f"{uname.release} {uname.version} {uname.machine}", "cpu": cpu}


def probe(criu_path: str, timeout: float = 60.0) -> tuple[dict, None] | tuple[None, str]:
    """(criu's record of this machine's kernel features, None), taken by `criu check` in a mount namespace of
    its own with a tmpfs at /run (util-linux's `unshare` and `mount`); or (None, why not)."""
    import shlex
    import subprocess

    script = (f"mount -n -t tmpfs -o size=1m thawllm-kdat /run || exit 3; "
              f"{shlex.quote(criu_path)} check -o /dev/null -v0 >/dev/null 2>&1; exec cat {RUN_RECORD}")
    try:
        result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                                capture_output=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"unshare: {exc}"
    if result.returncode != 0 or not result.stdout:
        why = result.stderr.decode(errors="replace").strip().splitlines()
        return None, f"exit {result.returncode}: {why[-1] if why else 'criu wrote no record'}"
    record = result.stdout
    try:
        described = machine()
    except OSError as exc:
        return None, f"cannot say which machine it describes: {exc}"
    return {"machine": described, "record": record.hex(), "crc32": zlib.crc32(record)}, None


def offer(features: Mapping | None) -> bool:
    """Link /run/criu.kdat to FEATURES' record (a manifest's `kernel_features`, written to SHM_RECORD) where they
    describe this machine and are intact, and /run/criu.kdat is absent or our link; True if it is linked.
    Never raises: without the record criu probes."""
    try:
        if not features or features.get("machine") != machine():
            return False
        record = bytes.fromhex(features["record"])
        if zlib.crc32(record) != features["crc32"]:
            return False
        if os.path.lexists(RUN_RECORD) and not _ours():
            return False  # criu's own record (a tmpfs /run), or someone else's
        partial = f"{SHM_RECORD}.{os.getpid()}"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, record)
        finally:
            os.close(fd)
        os.rename(partial, SHM_RECORD)
        if not _ours():
            os.symlink(SHM_RECORD, RUN_RECORD)
        return True
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def withdraw() -> None:
    """Take /run/criu.kdat away if it is the link `offer` made."""
    try:
        if _ours():
            os.unlink(RUN_RECORD)
    except OSError:
        pass


def _ours() -> bool:
    try:
        return os.readlink(RUN_RECORD) == SHM_RECORD
    except OSError:
        return False
