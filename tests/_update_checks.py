"""Checks every update operator's C++ kernel passes alike (AdamUpdate, SGDUpdate)."""

from __future__ import annotations

from normgrad.ops import harness


def assert_thread_independent_and_in_place(op, inputs) -> None:
    """The kernel of ``op`` (an update operator's module) gives bitwise the same outputs at 1,
    2, 3 and 7 threads, and the same bits when each state output is bound to its input's
    buffer (the trainer's in-place update)."""
    model = harness.node_model(op.OP_TYPE, inputs)
    first = harness.run_model(model, inputs, "cpp", threads=1)
    for threads in (2, 3, 7):
        again = harness.run_model(model, inputs, "cpp", threads=threads)
        assert all(again[n].tobytes() == first[n].tobytes() for n in op.OUTPUTS), threads
    buffers = harness.run_in_place(op.OP_TYPE, inputs, op.SPEC.kept, threads=2)
    for output, state in op.SPEC.kept.items():
        assert buffers[state].tobytes() == first[output].tobytes(), output
