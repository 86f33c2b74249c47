"""Session options the training benchmarks share: fixed threads, no spinning, quiet, optional profile."""

from __future__ import annotations

import os
import platform
from typing import Optional

import onnxruntime


def bench_session_options(
    threads: int, profile_prefix: Optional[str] = None, options: Optional[onnxruntime.SessionOptions] = None
) -> onnxruntime.SessionOptions:
    """``options`` (new if None) set for timing: ``threads`` intra-op threads that do not spin
    (the machine is shared; spinning threads steal the other variants' cores), warnings off,
    and profiling to ``profile_prefix`` when given."""
    options = options or onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    if profile_prefix:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    return options


def cpu_description(cpuinfo_path: str = "/proc/cpuinfo") -> str:
    """The CPU the numbers come from, for a bench's header: its model name, its widest x86
    vector extension (AVX-512 and AVX2 change both sides' kernels) and the cores this process
    may use, e.g. "AMD EPYC, avx512f, 2 cores"."""
    name, flags = platform.processor() or platform.machine() or "unknown CPU", set()
    try:
        with open(cpuinfo_path) as cpuinfo:
            first_cpu = cpuinfo.read().split("\n\n", 1)[0]
    except OSError:  # not Linux: the platform's name alone
        first_cpu = ""
    for line in first_cpu.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "model name" and value:
            name = value
        elif key == "flags":
            flags = set(value.split())
    vector = next((flag for flag in ("avx512f", "avx2") if flag in flags), None)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return ", ".join(part for part in (name, vector, f"{cores} cores") if part)
