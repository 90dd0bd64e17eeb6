"""A project-level cap on the CPU's instruction sets: the `cpu_isa` setting (`BULKINFER_CPU_ISA`),
`avx2` | `avx512` | `avx512_bf16` | `amx`; unset, the machine's own.

Under a cap every choice that depends on the CPU's kind is made as on that smaller kind:
- the CPU flags the engine reads (`dtype` auto) lose every flag above it (`masked_flags`);
- the native kernels are compiled without the instructions above it (`compiler_flags`);
- oneDNN (`ONEDNN_MAX_CPU_ISA`) and ATen's vector code (`ATEN_CPU_CAPABILITY`) are capped
  (`torch_environment`). torch reads both once, at first use, so they are set before torch is
  imported: `import bulkinfer` applies `$BULKINFER_CPU_ISA`, and the commands that take the setting
  from a flag or the config file apply it again before they load the engine. A value the user gave
  these two variables is kept. Child processes (Celery workers, tensor-parallel ranks) inherit all.
A cap at or above the machine's own kind changes nothing (said in the engine's log).

Standard library only: every package imports it, `bulkinfer/__init__.py` before anything else.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Collection, MutableMapping
from pathlib import Path

logger = logging.getLogger(__name__)

CAP_ENV = "BULKINFER_CPU_ISA"
ONEDNN_ENV = "ONEDNN_MAX_CPU_ISA"
ATEN_ENV = "ATEN_CPU_CAPABILITY"
CPUINFO = Path("/proc/cpuinfo")
# The kinds, smallest first, with the /proc/cpuinfo flags each needs over the one before it.
KIND_FLAGS: dict[str, frozenset[str]] = {
    "avx2": frozenset({"avx2", "fma"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"}),  # oneDNN's and ATen's AVX-512
    "avx512_bf16": frozenset({"avx512_bf16"}),  # the bf16 dot product (vdpbf16ps): Cooper Lake, Zen 4+
    "amx": frozenset({"amx_tile", "amx_bf16"}),  # bf16 tiles: Sapphire Rapids and later
}
ISA_KINDS = tuple(KIND_FLAGS)
# Flags (by prefix) a kind does not have: masked under a cap at that kind.
_ABOVE: dict[str, tuple[str, ...]] = {
    "avx2": ("avx512", "amx", "avx10"),
    "avx512": ("avx512_bf16", "avx512_fp16", "amx", "avx10"),
    "avx512_bf16": ("avx512_fp16", "amx", "avx10"),
    "amx": (),
}
_NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
# What -march=native loses under a cap (GCC and Clang: -mno-avx512f drops every AVX-512 subset).
_COMPILER_FLAGS: dict[str, list[str]] = {
    "avx2": ["-mno-avx512f", *_NO_AMX],
    "avx512": ["-mno-avx512bf16", *_NO_AMX],
    "avx512_bf16": list(_NO_AMX),
    "amx": [],
}
# oneDNN's names for the kinds; ATen's vector code knows only AVX2 and AVX-512 (set only to go
# down to AVX2: ATen takes "avx512" on trust, and would fault on a CPU without it).
_ONEDNN_ISA = {"avx2": "AVX2", "avx512": "AVX512_CORE", "avx512_bf16": "AVX512_CORE_BF16",
               "amx": "AVX512_CORE_AMX"}
# The variables this process set (not the user), by environment, which a later cap may change.
_set_here: dict[int, dict[str, str]] = {}


def read_cpu_flags(cpuinfo: Path = CPUINFO) -> set[str]:
    """The CPU's own feature flags (Linux), uncapped; empty where /proc/cpuinfo is absent."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def machine_kind(flags: Collection[str]) -> str | None:
    """The largest kind whose flags (and those of every kind below it) are all present; None below
    AVX2 or off x86."""
    kind, needed = None, set[str]()
    for name, more in KIND_FLAGS.items():
        needed |= more
        if not needed <= set(flags):
            break
        kind = name
    return kind


def check_cap(value: str | None) -> str | None:
    """`value` as a cap (empty: none); raises ValueError naming the kinds for anything else."""
    if not value:
        return None
    if value not in ISA_KINDS:
        raise ValueError(f"{CAP_ENV} must be one of {', '.join(ISA_KINDS)}, got {value!r}")
    return value


def effective_cap(requested: str | None, machine: str | None) -> str | None:
    """The cap that changes something: None when none is asked, or it is at or above the machine's
    own kind (or the machine is below every kind)."""
    if requested is None or machine is None:
        return None
    return requested if ISA_KINDS.index(requested) < ISA_KINDS.index(machine) else None


def masked_flags(flags: Collection[str], cap: str | None) -> set[str]:
    """`flags` without those above `cap` (None: all kept)."""
    above = _ABOVE[cap] if cap else ()
    return {flag for flag in flags if not flag.startswith(above)} if above else set(flags)


def compiler_flags(cap: str | None) -> list[str]:
    """What to add to `-march=native` so that the kernels' `#if` paths take the capped kind's code."""
    return list(_COMPILER_FLAGS[cap]) if cap else []


def torch_environment(cap: str | None) -> dict[str, str]:
    """The variables that cap oneDNN and ATen at `cap` (an effective cap: below the machine's kind)."""
    if cap is None:
        return {}
    variables = {ONEDNN_ENV: _ONEDNN_ISA[cap]}
    if cap == "avx2":
        variables[ATEN_ENV] = "avx2"
    return variables


def active_cap(environ: MutableMapping[str, str] | None = None,
               flags: Collection[str] | None = None) -> str | None:
    """This process's effective cap: `$BULKINFER_CPU_ISA` against the machine's kind (an invalid
    value: none, as `apply_cpu_isa_cap` warned)."""
    environ = os.environ if environ is None else environ
    try:
        requested = check_cap(environ.get(CAP_ENV))
    except ValueError:
        return None
    return effective_cap(requested, machine_kind(read_cpu_flags() if flags is None else flags))


def describe_cap(environ: MutableMapping[str, str] | None = None,
                 flags: Collection[str] | None = None) -> str | None:
    """A line for the log: the cap and what it does here; None without one."""
    environ = os.environ if environ is None else environ
    try:
        requested = check_cap(environ.get(CAP_ENV))
    except ValueError:
        return f"{CAP_ENV}={environ.get(CAP_ENV)!r} is not one of {', '.join(ISA_KINDS)}: ignored"
    if requested is None:
        return None
    machine = machine_kind(read_cpu_flags() if flags is None else flags)
    if effective_cap(requested, machine) is None:
        return f"{CAP_ENV}={requested} is not below this CPU's own kind ({machine or 'below avx2'}): no cap"
    return f"CPU capped at {requested} by {CAP_ENV} (this CPU: {machine})"


def apply_cpu_isa_cap(requested: str | None = None, environ: MutableMapping[str, str] | None = None,
                      flags: Collection[str] | None = None) -> str | None:
    """Make `requested` (else `$BULKINFER_CPU_ISA`) this process's cap, and its children's: the
    variable itself, and oneDNN's and ATen's where the cap is below the machine's kind (a value the
    user set is kept). Returns the effective cap. Raises ValueError for an unknown kind."""
    environ = os.environ if environ is None else environ
    requested = check_cap(requested or environ.get(CAP_ENV))
    if requested is None:
        return None
    environ[CAP_ENV] = requested
    cap = effective_cap(requested, machine_kind(read_cpu_flags() if flags is None else flags))
    wanted = torch_environment(cap)
    ours = _set_here.setdefault(id(environ), {})
    changed = False
    for name in [*ours]:  # an earlier cap's values (the variable gave one, then a flag another)
        if name not in wanted and environ.get(name) == ours.pop(name):
            del environ[name]
            changed = True
    for name, value in wanted.items():
        if name in environ and environ[name] != ours.get(name):
            continue  # the user's own value
        changed |= environ.get(name) != value
        environ[name] = ours[name] = value
    if changed and "torch" in sys.modules:
        logger.warning("%s=%s set after torch was imported: oneDNN and ATen may not honour it (set the "
                       "variable before starting the process)", CAP_ENV, requested)
    return cap
