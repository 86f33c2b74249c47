"""Session options the training benchmarks share: fixed threads, no spinning, quiet, optional profile."""

from __future__ import annotations

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
