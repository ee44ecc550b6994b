"""A small seccomp filter for the box, handed to bubblewrap's `--seccomp`.

It denies (EPERM) what an unprivileged process would otherwise still reach in the kernel and
that no solution needs: creating a user namespace (`clone`/`unshare` with CLONE_NEWUSER: the
door to most namespace-related kernel bugs), the kernel keyrings, eBPF, perf events,
userfaultfd and io_uring, plus every syscall of another ABI (32-bit, x32). `clone3` answers
ENOSYS, so the C library falls back to `clone`, whose flags the filter can read. Everything
else is allowed: this narrows the kernel's surface, it is not an allow-list.

Flatpak filters the same way; the program is classic BPF over `struct seccomp_data`.
"""

from __future__ import annotations

import errno
import platform
import struct

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_SYSCALLS = {  # name: (x86_64, aarch64)
    "clone": (56, 220),
    "unshare": (272, 97),
    "clone3": (435, 435),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "keyctl": (250, 219),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
}
_DENIED = [n for n in _SYSCALLS if n not in ("clone", "unshare", "clone3")]
CLONE_NEWUSER = 0x10000000
_X32_BIT = 0x40000000

# classic BPF opcodes and seccomp return values
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW = 0x7FFF0000
_ERRNO = 0x00050000
# offsets in struct seccomp_data: nr (u32), arch (u32), ip (u64), args[6] (u64, little end.)
_NR, _ARCH_OFF, _ARG0 = 0, 4, 16


def machine_supported(machine: str | None = None) -> bool:
    return (machine or platform.machine()) in _AUDIT_ARCH


def build_filter(machine: str | None = None) -> bytes:
    """The filter for `machine` (this one by default), as bytes of `struct sock_filter`."""
    machine = machine or platform.machine()
    if machine not in _AUDIT_ARCH:
        raise ValueError(f"seccomp filter: expected one of {sorted(_AUDIT_ARCH)}, got {machine!r}")
    col = 0 if machine == "x86_64" else 1
    nr = {name: nums[col] for name, nums in _SYSCALLS.items()}
    # (opcode, jump-if-true label, jump-if-false label, k); labels resolve to offsets below
    prog: list[tuple[int, str | None, str | None, int] | str] = [
        (_LD_ABS, None, None, _ARCH_OFF),
        (_JEQ, None, "deny", _AUDIT_ARCH[machine]),
        (_LD_ABS, None, None, _NR),
    ]
    if machine == "x86_64":
        prog.append((_JGE, "deny", None, _X32_BIT))
    prog.append((_JEQ, "enosys", None, nr["clone3"]))
    prog.append((_JEQ, "flags", None, nr["clone"]))
    prog.append((_JEQ, "flags", None, nr["unshare"]))
    prog += [(_JEQ, "deny", None, nr[name]) for name in _DENIED]
    prog.append((_RET, None, None, _ALLOW))
    prog += ["flags", (_LD_ABS, None, None, _ARG0), (_JSET, "deny", None, CLONE_NEWUSER)]
    prog.append((_RET, None, None, _ALLOW))
    prog += ["deny", (_RET, None, None, _ERRNO | errno.EPERM)]
    prog += ["enosys", (_RET, None, None, _ERRNO | errno.ENOSYS)]
    return _assemble(prog)


def _assemble(prog: list) -> bytes:
    labels, index = {}, 0
    for item in prog:
        if isinstance(item, str):
            labels[item] = index
        else:
            index += 1
    out, i = [], 0
    for item in prog:
        if isinstance(item, str):
            continue
        code, jt, jf, k = item
        offsets = [labels[j] - i - 1 if j else 0 for j in (jt, jf)]
        assert all(0 <= o < 256 for o in offsets), f"jump out of range at {i}: {offsets}"
        out.append(struct.pack("=HBBI", code, offsets[0], offsets[1], k))
        i += 1
    return b"".join(out)
