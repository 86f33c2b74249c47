"""Pytest's fixtures and hooks: the backends every operator test runs on, and the slow tier
(tests marked slow in their modules) left out unless --run-slow or an explicit -m asks for it."""

from __future__ import annotations

import onnx
import pytest

from normgrad.graphs import examples
from normgrad.ops import harness

from _helpers import cpp_available


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true",
                     help="also run the slow tiers (model families, MPI, other runtimes, docs pages that train, "
                          "benchmark smoke tests): the tests marked slow, which a plain run leaves out")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow") or config.getoption("markexpr"):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


def pytest_report_header(config):
    if not (config.getoption("--run-slow") or config.getoption("markexpr")):
        return "slow tiers (tests marked slow) left out: --run-slow runs them"


@pytest.fixture(params=harness.BACKENDS)
def backend(request) -> str:
    if request.param == "cpp" and not cpp_available():
        pytest.skip("C++ library not built")
    return request.param


@pytest.fixture()
def forward_path(tmp_path):
    """A small MLP forward model saved as tmp_path/mlp.onnx."""
    path = tmp_path / "mlp.onnx"
    onnx.save(examples.mlp(), str(path))
    return path
