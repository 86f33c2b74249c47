"""ScatterND and ScatterElements against torch autograd, as torch's exporters write them:
slice assignment, index_put_ (with and without accumulate), index_add_, select_scatter,
scatter and scatter_reduce, through both exporters."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from normgrad.graphs import UnsupportedOperatorError  # noqa: E402
from _torch_rule_checks import _compare, _Lambda  # noqa: E402

ROWS = torch.tensor([3, 0, 3, 1])  # row 3 twice
COLUMNS = torch.tensor([[2, 0, 4], [1, 1, 3], [0, 4, 2], [3, 2, 2], [4, 0, 1]])


def _slice_assignment(h, g):
    out = h.clone()
    out[:, 1] = g[:, 0] * 2
    out[..., 2:4, :] *= g[:, 1:2, :1]
    return out


def _index_put(h, g, rows, accumulate):
    """h[:, rows] = g[:, :len(rows)] (or +=), as pairs of indices."""
    return h.clone().index_put_((torch.arange(2)[:, None], rows[None]), g[:, :len(rows)], accumulate=accumulate)


def _scatter_reduce(h, g, reduce):
    return h.scatter_reduce(2, COLUMNS.expand(2, 5, 3), g[..., :3], reduce, include_self=True)


def _scatter_distinct(h, g):
    return h.scatter(2, torch.tensor([[4, 0, 2], [1, 3, 0], [2, 4, 3], [0, 1, 4], [3, 2, 1]]).expand(2, 5, 3), g[..., :3])


CASES = {
    "slice_assignment": _slice_assignment,
    "index_put": lambda h, g: _index_put(h, g, torch.tensor([3, 0, 1]), False),
    "index_put_accumulate": lambda h, g: _index_put(h, g, torch.tensor([4, 1, 2]), True),
    "index_put_accumulate_repeated": lambda h, g: _index_put(h, g, ROWS, True),
    # distinct: torch's TorchScript exporter writes index_add_ as a ScatterElements without reduction
    "index_add": lambda h, g: h.index_add(1, torch.tensor([3, 0, 1]), g[:, :3] * 0.5),
    "select_scatter": lambda h, g: torch.select_scatter(h, g[:, 2], 1, 3),
    "scatter": _scatter_distinct,
    "scatter_add": lambda h, g: h.scatter_add(2, COLUMNS.expand(2, 5, 3), g[..., :3]),
    "scatter_reduce_prod": lambda h, g: _scatter_reduce(h, g, "prod"),
    "scatter_reduce_amax": lambda h, g: _scatter_reduce(h, g, "amax"),
    "scatter_reduce_amin": lambda h, g: _scatter_reduce(h, g, "amin"),
}


TORCHSCRIPT_GAPS = {
    "index_put_accumulate_repeated": pytest.mark.skip(
        reason="TorchScript writes index_put_(accumulate=True) as a ScatterND without reduction plus an Add: "
               "its forward is wrong for repeated indices"),
    **{name: pytest.mark.xfail(strict=True, raises=UnsupportedOperatorError,
                               reason="TorchScript writes scatter_reduce under an If, which has no rule")
       for name in CASES if name.startswith("scatter_reduce")},
}


DYNAMO_GAPS = {}


def _cases():
    for name in sorted(CASES):
        for exporter, gaps in (("torchscript", TORCHSCRIPT_GAPS), ("dynamo", DYNAMO_GAPS)):
            marks = [gaps[name]] if name in gaps else []
            yield pytest.param(name, exporter, marks=marks, id=f"{name}-{exporter}")


@pytest.mark.parametrize("name, exporter", list(_cases()))
def test_scatter_matches_torch(name, exporter):
    """h and g two linear maps of x [2, 5, 3] to [2, 5, 5]: the write's gradients reach both."""
    write = CASES[name]
    module = _Lambda(lambda x, a, b: write(a(x), b(x)), nn.Linear(3, 5), nn.Linear(3, 5))
    _compare(module, (2, 5, 3), exporter)
