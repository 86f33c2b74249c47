"""Sequence values (SplitToSequence, SequenceConstruct, SequenceAt, ConcatFromSequence) in
the forms the exporters write, rewritten to tensor ops: float64 finite differences, and
torch autograd for torch's TorchScript export of ``torch.tensor_split`` (Mamba's form)."""

from __future__ import annotations

import numpy as np
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest

from normgrad.graphs import build_training_graph
from normgrad.graphs.examples import model
from normgrad.tools.check import check_gradients

SEQUENCE_OPS = {"SplitToSequence", "SequenceAt", "ConcatFromSequence", "SequenceConstruct"}


def _check(forward):
    training = build_training_graph(forward)
    assert not SEQUENCE_OPS & {node.op_type for node in training.model.graph.node}
    checks = check_gradients(training, directions=2)
    assert checks
    worst = max(checks, key=lambda c: c.error)
    assert worst.error < 1e-4, worst


def _const(name, value):
    return oh.make_node("Constant", [], [name], value=onh.from_array(np.asarray(value, np.int64)))


def _run_time_sizes():
    """split = [size(x, 1) - 2, 2], computed from x's shape at run time."""
    return [
        oh.make_node("Shape", ["x"], ["dim"], start=1, end=2),
        _const("two", [2]),
        oh.make_node("Sub", ["dim", "two"], ["head"]),
        oh.make_node("Concat", ["head", "two"], ["split"], axis=0),
    ]


@pytest.mark.parametrize("positions", [[0, 1], [-1, 0, -2]])
def test_split_sizes_computed_at_run_time(positions):
    nodes = _run_time_sizes() + [_const("one", [1]), oh.make_node("SplitToSequence", ["x", "split"], ["seq"], axis=1)]
    for k, p in enumerate(positions):
        nodes += [_const(f"p{k}", p), oh.make_node("SequenceAt", ["seq", f"p{k}"], [f"a{k}"]),
                  oh.make_node("ReduceSum", [f"a{k}", "one"], [f"s{k}"], keepdims=1)]
    nodes.append(oh.make_node("Concat", [f"s{k}" for k in range(len(positions))], ["y"], axis=1))
    _check(model(nodes, {"x": (2, 5, 3)}, ["y"]))


def test_scalar_split_computed_at_run_time_and_position_computed_at_run_time():
    """Pieces of size(x, 2) - 2 = 2 along the last axis (the last one shorter); the position
    size(x, 0) - 3 = -1 (the last piece) and a constant one."""
    nodes = [
        oh.make_node("Shape", ["x"], ["dims"]),
        _const("i2", 2), _const("i0", 0), _const("three", 3),
        oh.make_node("Gather", ["dims", "i2"], ["width"]),
        oh.make_node("Sub", ["width", "i2"], ["step"]),
        oh.make_node("Gather", ["dims", "i0"], ["batch"]),
        oh.make_node("Sub", ["batch", "three"], ["last"]),
        oh.make_node("SplitToSequence", ["x", "step"], ["seq"], axis=-1),
        oh.make_node("SequenceAt", ["seq", "last"], ["tail"]),
        oh.make_node("SequenceAt", ["seq", "i0"], ["head"]),
        oh.make_node("Mul", ["head", "head"], ["squared"]),
        oh.make_node("Concat", ["squared", "tail"], ["y"], axis=-1),
    ]
    forward = model(nodes, {"x": (2, 3, 5)}, ["y"])
    _check(forward)


@pytest.mark.parametrize("axis", [1, -2])
def test_unsplit_pieces_squeezed_at_a_symbolic_size(axis):
    """No split, keepdims=0: one squeezed piece per element of a dim of unknown size."""
    nodes = [oh.make_node("SplitToSequence", ["x"], ["seq"], axis=axis, keepdims=0),
             _const("last", -1), _const("first", 0),
             oh.make_node("SequenceAt", ["seq", "last"], ["a"]), oh.make_node("SequenceAt", ["seq", "first"], ["b"]),
             oh.make_node("Mul", ["a", "b"], ["y"])]
    _check(model(nodes, {"x": (2, "T", 3)}, ["y"]))


@pytest.mark.parametrize("keepdims, new_axis, axis", [(1, 0, 1), (0, 1, 1), (0, 1, -2)])
def test_concat_from_sequence_of_the_split_is_the_input(keepdims, new_axis, axis):
    nodes = [oh.make_node("SplitToSequence", ["x"], ["seq"], axis=1, keepdims=keepdims),
             _const("first", 0), oh.make_node("SequenceAt", ["seq", "first"], ["a"]),
             oh.make_node("ConcatFromSequence", ["seq"], ["joined"], axis=axis, new_axis=new_axis),
             oh.make_node("Mul", ["joined", "joined"], ["y"])]
    forward = model(nodes, {"x": (2, 4, 3)}, ["y", "a"])
    _check(forward)


@pytest.mark.parametrize("new_axis, axis", [(0, 1), (1, -1), (1, 0)])
def test_sequence_construct(new_axis, axis):
    nodes = [oh.make_node("Sigmoid", ["x"], ["s"]),
             oh.make_node("SequenceConstruct", ["x", "s", "x"], ["seq"]),
             oh.make_node("ConcatFromSequence", ["seq"], ["joined"], axis=axis, new_axis=new_axis),
             _const("last", -2), oh.make_node("SequenceAt", ["seq", "last"], ["picked"]),
             oh.make_node("Mul", ["picked", "picked"], ["z"])]
    _check(model(nodes, {"x": (2, 3)}, ["joined", "z"]))


def test_torchscript_tensor_split_at_a_run_time_index_matches_torch(tmp_path):
    """Mamba's ``torch.tensor_split(x, [length], dim)`` and ``tensor_split(x, sections)``
    through torch.onnx.export(dynamo=False): SplitToSequence with sizes computed from a Tile
    (whose repeats the exporter writes as [1, 1], which onnxruntime refuses), read by SequenceAt."""
    torch = pytest.importorskip("torch")
    import onnx
    import onnxruntime as ort

    import normgrad.torch

    class Mixer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(6, 6)

        def forward(self, x):
            h = self.linear(x)
            chunked, sequential = torch.tensor_split(h, [h.shape[1] - 1], dim=1)
            c, d, e = torch.tensor_split(h, 3, dim=-1)
            return torch.cat([chunked.sum(1, keepdim=True) * sequential, (c * d + e).sum(1, keepdim=True)], -1)

    torch.manual_seed(0)
    module = Mixer()
    x = torch.randn(2, 3, 6)
    normgrad.torch.export(module, (x,), tmp_path / "mixer.onnx", input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "batch"}})
    forward = onnx.load(str(tmp_path / "mixer.onnx"))
    assert {"SplitToSequence", "SequenceAt"} <= {node.op_type for node in forward.graph.node}
    training, weights = build_training_graph(forward)
    session = ort.InferenceSession(training.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    # (only the batch varies: torch's exporter traces tensor_split at a run-time index as a
    # number of sections, which agrees with torch at the traced length only)
    for shape in ((2, 3, 6), (4, 3, 6)):
        x = torch.randn(shape, dtype=torch.float64).float().requires_grad_()
        module.zero_grad()
        y = module(x)
        dy = torch.randn_like(y)
        (y * dy).sum().backward()
        got = dict(zip(names, session.run(None, {**weights, "x": x.detach().numpy(), "y_grad": dy.numpy()})))
        np.testing.assert_allclose(got["x_grad"], x.grad.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["linear.weight_grad"], module.linear.weight.grad.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("image, block, options", [
    ((5, 6), (2, 3), {}),
    ((6, 7), (3, 2), {"strides": [2, 1], "pads": [1, 0, 1, 2], "dilations": [1, 2]}),
    ((7,), (3,), {"strides": [2], "pads": [1, 1]}),
])
def test_col2im_matches_torch_fold(image, block, options):
    """Col2Im (torch's F.fold): the gradient to the columns against torch autograd, and
    float64 finite differences through onnxruntime's Col2Im."""
    rank = len(image)
    channels = 2
    strides = options.get("strides", [1] * rank)
    dilations = options.get("dilations", [1] * rank)
    pads = options.get("pads", [0] * 2 * rank)
    padded = [image[i] + pads[i] + pads[rank + i] for i in range(rank)]
    blocks = int(np.prod([(padded[i] - dilations[i] * (block[i] - 1) - 1) // strides[i] + 1 for i in range(rank)]))
    nodes = [_const("image", list(image)), _const("block", list(block)),
             oh.make_node("Col2Im", ["x", "image", "block"], ["y"], **options)]
    forward = model(nodes, {"x": (2, channels * int(np.prod(block)), blocks)}, ["y"])
    _check(forward)
    torch = pytest.importorskip("torch")
    if rank != 2 or pads[:2] != pads[2:]:
        return  # F.fold: 2-D images, symmetric padding
    import onnxruntime as ort

    training, weights = build_training_graph(forward)
    session = ort.InferenceSession(training.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.standard_normal((2, channels * int(np.prod(block)), blocks)), requires_grad=True)
    y = torch.nn.functional.fold(x, image, block, dilation=dilations, padding=pads[:2], stride=strides)
    dy = torch.tensor(rng.standard_normal(y.shape))
    (y * dy).sum().backward()
    got = dict(zip([o.name for o in session.get_outputs()],
                   session.run(None, {**weights, "x": x.detach().numpy().astype(np.float32), "y_grad": dy.numpy().astype(np.float32)})))
    np.testing.assert_allclose(got["y"], y.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["x_grad"], x.grad.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_fold_through_both_exporters_matches_torch(exporter, tmp_path):
    """F.unfold, a Linear over the columns, F.fold (timm's VOLO): Col2Im as each exporter writes it."""
    torch = pytest.importorskip("torch")
    import onnx
    import onnxruntime as ort

    import normgrad.torch

    class Outlook(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(12, 12)

        def forward(self, x):
            columns = torch.nn.functional.unfold(x, 2, stride=2)
            columns = self.linear(columns.transpose(1, 2)).transpose(1, 2)
            return torch.nn.functional.fold(columns, (5, 5), 2, padding=1, stride=2)

    torch.manual_seed(0)
    module = Outlook()
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    normgrad.torch.export(module, (x.detach(),), tmp_path / "fold.onnx", exporter=exporter, input_names=["x"],
                          output_names=["y"], opset=18)
    forward = onnx.load(str(tmp_path / "fold.onnx"))
    assert "Col2Im" in {node.op_type for node in forward.graph.node}
    training, weights = build_training_graph(forward)
    y = module(x)
    dy = torch.randn_like(y)
    (y * dy).sum().backward()
    session = ort.InferenceSession(training.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in session.get_outputs()],
                   session.run(None, {**weights, "x": x.detach().numpy(), "y_grad": dy.numpy()})))
    np.testing.assert_allclose(got["x_grad"], x.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["linear.weight_grad"], module.linear.weight.grad.numpy(), rtol=1e-5, atol=1e-5)
