"""The seccomp filter of every sandboxed program: the system calls a desktop never needs fail.

A classic-BPF program (the format `bwrap --seccomp FD` reads: an array of struct sock_filter)
built here in pure Python, so no libseccomp binding is needed. Denied with EPERM: namespace
creation and entry (unshare, setns, clone with a CLONE_NEW* flag), mounts (mount, umount2,
pivot_root, chroot and the new mount API), ptrace and cross-process memory access, the key
ring, bpf, perf events, io_uring, kernel modules, kexec, file handles, userfaultfd, and the
administration calls. clone3 answers ENOSYS, as Docker's default profile does: its flags sit
in a struct seccomp cannot read, and glibc falls back to clone, whose flags it can. Other
architectures and the x32 ABI are refused whole: the numbers below are x86_64's.

    python -c "from envmanager.seccomp import filter_bytes; print(len(filter_bytes()))"
"""

from __future__ import annotations

import errno
import platform
import struct

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000

# x86_64 numbers (arch/x86/entry/syscalls/syscall_64.tbl).
DENIED: dict[str, int] = {
    "ptrace": 101,
    "syslog": 103,
    "chroot": 161,
    "acct": 163,
    "mount": 165,
    "umount2": 166,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "iopl": 172,
    "ioperm": 173,
    "init_module": 175,
    "delete_module": 176,
    "quotactl": 179,
    "pivot_root": 155,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "unshare": 272,
    "perf_event_open": 298,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "setns": 308,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
}
CLONE = 56
CLONE3 = 435
CLONE_NEW_FLAGS = (
    0x00000080  # CLONE_NEWTIME
    | 0x00020000  # CLONE_NEWNS
    | 0x02000000  # CLONE_NEWCGROUP
    | 0x04000000  # CLONE_NEWUTS
    | 0x08000000  # CLONE_NEWIPC
    | 0x10000000  # CLONE_NEWUSER
    | 0x20000000  # CLONE_NEWPID
    | 0x40000000  # CLONE_NEWNET
)

# BPF opcodes (linux/filter.h, linux/seccomp.h).
_LD_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JSET = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET = 0x06  # BPF_RET | BPF_K
_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_RET_ALLOW = 0x7FFF0000
_OFF_NR, _OFF_ARCH, _OFF_ARG0_LOW = 0, 4, 16  # struct seccomp_data (little-endian)


class SeccompUnsupported(RuntimeError):
    """The filter's system call numbers are x86_64's; this machine is another architecture."""


def filter_bytes() -> bytes:
    """The filter as bwrap reads it from `--seccomp FD` (8 bytes an instruction)."""
    if platform.machine() != "x86_64":
        raise SeccompUnsupported(
            f"the sandbox's seccomp filter knows x86_64's system call numbers only; this "
            f"machine is {platform.machine()}"
        )
    # Labels: ("allow", "eperm", "enosys") are resolved to relative jumps at the end.
    code: list[tuple[int, int | str, int | str, int]] = [
        (_LD_ABS, 0, 0, _OFF_ARCH),
        (_JEQ, 1, 0, AUDIT_ARCH_X86_64),
        (_RET, 0, 0, _RET_KILL_PROCESS),
        (_LD_ABS, 0, 0, _OFF_NR),
        (_JGE, "eperm", 0, X32_SYSCALL_BIT),
        *[(_JEQ, "eperm", 0, number) for number in sorted(DENIED.values())],
        (_JEQ, "enosys", 0, CLONE3),
        (_JEQ, 0, "allow", CLONE),
        (_LD_ABS, 0, 0, _OFF_ARG0_LOW),
        (_JSET, "eperm", "allow", CLONE_NEW_FLAGS),
    ]
    labels = {"allow": len(code), "eperm": len(code) + 1, "enosys": len(code) + 2}
    code += [
        (_RET, 0, 0, _RET_ALLOW),
        (_RET, 0, 0, _RET_ERRNO | errno.EPERM),
        (_RET, 0, 0, _RET_ERRNO | errno.ENOSYS),
    ]
    out = b""
    for index, (op, jt, jf, k) in enumerate(code):
        out += struct.pack("<HBBI", op, _jump(jt, labels, index), _jump(jf, labels, index), k)
    return out


def _jump(target: int | str, labels: dict[str, int], index: int) -> int:
    """A jump offset: a label becomes the distance from the next instruction."""
    if isinstance(target, int):
        return target
    offset = labels[target] - index - 1
    assert 0 <= offset < 256, f"seccomp jump to {target} out of range ({offset})"
    return offset
