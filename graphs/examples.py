"""Small forward models built in code: the blocks the training-graph tests and the
interoperability corpus (``normgrad corpus``) export.

Every builder is deterministic (fixed seeds) and returns a float32 forward model with IR
version 10 whose output shapes are inferred.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Union

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from normgrad.ops import IR_VERSION

__all__ = [
    "model",
    "weights",
    "resnet_block",
    "group_norm_block",
    "instance_norm_block",
    "mlp",
    "unet_block",
    "unet_block_torchscript",
    "style_transfer_block",
    "resnet18",
    "digits_cnn",
    "mlp_with_loss",
]

FLOAT = onnx.TensorProto.FLOAT


def model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Dict[str, Sequence],
    outputs: Sequence[str],
    initializers: Optional[Dict[str, np.ndarray]] = None,
    opset: int = 18,
    elem_type: int = FLOAT,
    name: str = "test",
) -> onnx.ModelProto:
    """A model of ``nodes``; ``inputs`` maps names to shapes; output shapes are inferred."""
    graph = oh.make_graph(
        list(nodes),
        name,
        [oh.make_tensor_value_info(name, elem_type, list(shape)) for name, shape in inputs.items()],
        [oh.make_tensor_value_info(name, elem_type, None) for name in outputs],
        initializer=[onh.from_array(value, name) for name, value in (initializers or {}).items()],
    )
    result = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    result.ir_version = IR_VERSION
    inferred = onnx.shape_inference.infer_shapes(result)
    del result.graph.output[:]
    result.graph.output.extend(inferred.graph.output)
    return result


def weights(seed: int, **shapes: Sequence[int]) -> Dict[str, np.ndarray]:
    """Random float32 arrays by name."""
    rng = np.random.default_rng(seed)
    return {name: (rng.standard_normal(shape) * 0.5).astype(np.float32) for name, shape in shapes.items()}


def resnet_block(
    channels: int = 4, training: int = 1, opset: int = 15, batch: Union[int, str] = 2, size: int = 5
) -> onnx.ModelProto:
    """ResNet basic block: Conv-BN-ReLU-Conv-BN + skip, ReLU, on x [batch, channels, size, size]
    (``batch`` a name for a dynamic batch dimension)."""
    params = weights(1, w1=(channels, channels, 3, 3), w2=(channels, channels, 3, 3), b1=(channels,))
    for i in (1, 2):
        rng = np.random.default_rng(10 + i)
        params[f"s{i}"] = rng.uniform(0.5, 1.5, channels).astype(np.float32)
        params[f"t{i}"] = rng.standard_normal(channels).astype(np.float32)
        params[f"m{i}"] = rng.standard_normal(channels).astype(np.float32) * 0.1
        params[f"v{i}"] = rng.uniform(0.5, 1.5, channels).astype(np.float32)
    bn = dict(training_mode=training) if opset >= 14 else {}
    stats = lambda i: [f"n{i}", f"rm{i}", f"rv{i}"] if training else [f"n{i}"]  # noqa: E731
    nodes = [
        oh.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        oh.make_node("BatchNormalization", ["c1", "s1", "t1", "m1", "v1"], stats(1), **bn),
        oh.make_node("Relu", ["n1"], ["r1"]),
        oh.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        oh.make_node("BatchNormalization", ["c2", "s2", "t2", "m2", "v2"], stats(2), **bn),
        oh.make_node("Add", ["n2", "x"], ["sum"]),
        oh.make_node("Relu", ["sum"], ["y"]),
    ]
    return model(nodes, {"x": (batch, channels, size, size)}, ["y"], params, opset=opset)


def group_norm_block(channels: int = 4, groups: int = 2, opset: int = 21) -> onnx.ModelProto:
    """Conv-GroupNormalization-SiLU (Sigmoid * x)."""
    scale_len = channels if opset >= 21 else groups
    params = weights(2, w=(channels, 3, 3, 3), b=(channels,))
    params["gamma"] = np.random.default_rng(3).uniform(0.5, 1.5, scale_len).astype(np.float32)
    params["beta"] = np.random.default_rng(4).standard_normal(scale_len).astype(np.float32)
    nodes = [
        oh.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        oh.make_node("GroupNormalization", ["c", "gamma", "beta"], ["n"], num_groups=groups, epsilon=1e-5),
        oh.make_node("Sigmoid", ["n"], ["s"]),
        oh.make_node("Mul", ["n", "s"], ["y"]),
    ]
    return model(nodes, {"x": (2, 3, 4, 4)}, ["y"], params, opset=opset)


def instance_norm_block(channels: int = 3) -> onnx.ModelProto:
    """Conv-InstanceNormalization-LeakyRelu."""
    params = weights(5, w=(channels, 2, 3, 3))
    params["gamma"] = np.random.default_rng(6).uniform(0.5, 1.5, channels).astype(np.float32)
    params["beta"] = np.random.default_rng(7).standard_normal(channels).astype(np.float32)
    nodes = [
        oh.make_node("Conv", ["x", "w"], ["c"], strides=[2, 2], pads=[1, 1, 1, 1]),
        oh.make_node("InstanceNormalization", ["c", "gamma", "beta"], ["n"], epsilon=1e-5),
        oh.make_node("LeakyRelu", ["n"], ["y"], alpha=0.1),
    ]
    return model(nodes, {"x": (2, 2, 7, 7)}, ["y"], params, opset=17)


def mlp(classes: int = 3) -> onnx.ModelProto:
    """Gemm-Tanh-MatMul-Add; the batch dimension is symbolic ("N")."""
    params = weights(8, w1=(5, 6), b1=(6,), w2=(6, classes), b2=(classes,))
    nodes = [
        oh.make_node("Gemm", ["x", "w1", "b1"], ["h"]),
        oh.make_node("Tanh", ["h"], ["a"]),
        oh.make_node("MatMul", ["a", "w2"], ["z"]),
        oh.make_node("Add", ["z", "b2"], ["y"]),
    ]
    return model(nodes, {"x": ("N", 5)}, ["y"], params)


def transformer_block(dropout: float = 0.1, width: int = 8, hidden: int = 16) -> onnx.ModelProto:
    """A post-norm transformer encoder layer over x [N, T, width]: one-head self-attention
    (softmax(q k^T / sqrt(width)), training-mode Dropout on the attention weights and on the
    feed-forward output when ``dropout`` > 0), residual + LayerNormalization, a Gelu-as-Erf
    feed-forward, residual + LayerNormalization (opset 17)."""
    params = weights(11, wq=(width, width), wk=(width, width), wv=(width, width), wo=(width, width),
                     w1=(width, hidden), b1=(hidden,), w2=(hidden, width), b2=(width,))
    params.update(g1=np.ones(width, np.float32), n1=np.zeros(width, np.float32),
                  g2=np.full(width, 1.1, np.float32), n2=np.full(width, 0.1, np.float32))
    constants = dict(scale=np.asarray(1 / np.sqrt(width), np.float32), half=np.asarray(0.5, np.float32),
                     one=np.asarray(1.0, np.float32), root_half=np.asarray(np.sqrt(0.5), np.float32),
                     ratio=np.asarray(dropout, np.float32), training=np.asarray(True))
    dropped = lambda value, out: ([oh.make_node("Dropout", [value, "ratio", "training"], [out])]  # noqa: E731
                                  if dropout else [oh.make_node("Identity", [value], [out])])
    nodes = [oh.make_node("Constant", [], [name], value=onh.from_array(value)) for name, value in constants.items()]
    nodes += [
        oh.make_node("MatMul", ["x", "wq"], ["q"]),
        oh.make_node("MatMul", ["x", "wk"], ["k"]),
        oh.make_node("MatMul", ["x", "wv"], ["v"]),
        oh.make_node("Transpose", ["k"], ["k_t"], perm=[0, 2, 1]),
        oh.make_node("MatMul", ["q", "k_t"], ["scores_raw"]),
        oh.make_node("Mul", ["scores_raw", "scale"], ["scores"]),
        oh.make_node("Softmax", ["scores"], ["attention_full"], axis=-1),
        *dropped("attention_full", "attention"),
        oh.make_node("MatMul", ["attention", "v"], ["mixed"]),
        oh.make_node("MatMul", ["mixed", "wo"], ["attended"]),
        oh.make_node("Add", ["x", "attended"], ["r1"]),
        oh.make_node("LayerNormalization", ["r1", "g1", "n1"], ["h1"], axis=-1),
        oh.make_node("MatMul", ["h1", "w1"], ["f0"]),
        oh.make_node("Add", ["f0", "b1"], ["f1"]),
        oh.make_node("Mul", ["f1", "root_half"], ["f2"]),
        oh.make_node("Erf", ["f2"], ["f3"]),
        oh.make_node("Add", ["f3", "one"], ["f4"]),
        oh.make_node("Mul", ["f1", "f4"], ["f5"]),
        oh.make_node("Mul", ["f5", "half"], ["f6"]),
        oh.make_node("MatMul", ["f6", "w2"], ["f7"]),
        oh.make_node("Add", ["f7", "b2"], ["f8"]),
        *dropped("f8", "f9"),
        oh.make_node("Add", ["h1", "f9"], ["r2"]),
        oh.make_node("LayerNormalization", ["r2", "g2", "n2"], ["y"], axis=-1),
    ]
    return model(nodes, {"x": ("N", 4, width)}, ["y"], params, opset=17)


def mlp_with_loss(loss_name: str = "total") -> onnx.ModelProto:
    """:func:`mlp` (batch 4) computing its own loss: outputs ``y`` and the scalar
    ``loss_name`` = mean((y - target)^2) against a ``target`` input [4, 3]."""
    forward = mlp()
    nodes = list(forward.graph.node) + [
        oh.make_node("Sub", ["y", "target"], ["d"]),
        oh.make_node("Mul", ["d", "d"], ["d2"]),
        oh.make_node("ReduceMean", ["d2"], [loss_name], keepdims=0),
    ]
    params = {t.name: onh.to_array(t) for t in forward.graph.initializer}
    return model(nodes, {"x": (4, 5), "target": (4, 3)}, ["y", loss_name], params)


def _affine(seed: int, channels: int, name: str) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        f"{name}_scale": rng.uniform(0.5, 1.5, channels).astype(np.float32),
        f"{name}_bias": (rng.standard_normal(channels) * 0.5).astype(np.float32),
    }


def unet_block(channels: int = 4, hidden: int = 8, groups: int = 4) -> onnx.ModelProto:
    """Diffusion-UNet residual block: Conv -> GroupNormalization-21 -> SiLU (x * Sigmoid(x))
    -> Conv, plus the skip connection."""
    params = weights(21, w1=(hidden, channels, 3, 3), b1=(hidden,), w2=(channels, hidden, 3, 3), b2=(channels,))
    params.update(_affine(22, hidden, "gn"))
    nodes = [
        oh.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        oh.make_node("GroupNormalization", ["c1", "gn_scale", "gn_bias"], ["n"], num_groups=groups, epsilon=1e-5),
        oh.make_node("Sigmoid", ["n"], ["sig"]),
        oh.make_node("Mul", ["n", "sig"], ["silu"]),
        oh.make_node("Conv", ["silu", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        oh.make_node("Add", ["c2", "x"], ["y"]),
    ]
    return model(nodes, {"x": (2, channels, 6, 6)}, ["y"], params, opset=21, name="unet_block")


def unet_block_torchscript(channels: int = 4, hidden: int = 8, groups: int = 4) -> onnx.ModelProto:
    """:func:`unet_block` with GroupNorm as torch's TorchScript exporter writes it: Reshape to
    [N, G, -1] -> InstanceNormalization (ones/zeros of length G as Constant nodes) ->
    Reshape back -> Mul(weight[C, 1, 1]) -> Add(bias[C, 1, 1])."""
    params = weights(21, w1=(hidden, channels, 3, 3), b1=(hidden,), w2=(channels, hidden, 3, 3), b2=(channels,))
    affine = _affine(22, hidden, "gn")
    params["gn_weight"] = affine["gn_scale"].reshape(hidden, 1, 1)
    params["gn_bias"] = affine["gn_bias"].reshape(hidden, 1, 1)
    nodes = [
        oh.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        oh.make_node("Constant", [], ["grouped_shape"], value=onh.from_array(np.array([0, groups, -1], np.int64))),
        oh.make_node("Reshape", ["c1", "grouped_shape"], ["grouped"]),
        oh.make_node("Constant", [], ["in_scale"], value=onh.from_array(np.ones(groups, np.float32))),
        oh.make_node("Constant", [], ["in_bias"], value=onh.from_array(np.zeros(groups, np.float32))),
        oh.make_node("InstanceNormalization", ["grouped", "in_scale", "in_bias"], ["normed"], epsilon=1e-5),
        oh.make_node("Shape", ["c1"], ["c1_shape"]),
        oh.make_node("Reshape", ["normed", "c1_shape"], ["n0"]),
        oh.make_node("Mul", ["n0", "gn_weight"], ["n1"]),
        oh.make_node("Add", ["n1", "gn_bias"], ["n"]),
        oh.make_node("Sigmoid", ["n"], ["sig"]),
        oh.make_node("Mul", ["n", "sig"], ["silu"]),
        oh.make_node("Conv", ["silu", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        oh.make_node("Add", ["c2", "x"], ["y"]),
    ]
    return model(nodes, {"x": (2, channels, 6, 6)}, ["y"], params, opset=17, name="unet_block_torchscript")


def style_transfer_block(channels: int = 4) -> onnx.ModelProto:
    """Style-transfer residual block: Conv -> InstanceNormalization -> Relu -> Conv ->
    InstanceNormalization, plus the skip connection."""
    params = weights(31, w1=(channels, channels, 3, 3), b1=(channels,), w2=(channels, channels, 3, 3), b2=(channels,))
    params.update(_affine(32, channels, "in1"))
    params.update(_affine(33, channels, "in2"))
    nodes = [
        oh.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        oh.make_node("InstanceNormalization", ["c1", "in1_scale", "in1_bias"], ["n1"], epsilon=1e-5),
        oh.make_node("Relu", ["n1"], ["r1"]),
        oh.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        oh.make_node("InstanceNormalization", ["c2", "in2_scale", "in2_bias"], ["n2"], epsilon=1e-5),
        oh.make_node("Add", ["n2", "x"], ["y"]),
    ]
    return model(nodes, {"x": (2, channels, 6, 6)}, ["y"], params, opset=17, name="style_transfer_block")


def resnet18(batch: int = 2, size: int = 32, classes: int = 10, widths: Sequence[int] = (64, 128, 256, 512)) -> onnx.ModelProto:
    """torchvision's resnet18 layout, torch-free: Conv 7x7/2-BN-ReLU-MaxPool 3x3/2, four
    stages of two basic blocks (Conv-BN-ReLU-Conv-BN + skip, ReLU; a 1x1/2 Conv-BN on the
    skip where the stage halves the size), GlobalAveragePool, Flatten, Gemm. Kaiming-normal
    convolution weights, BatchNorm in training mode (opset 15); input [batch, 3, size, size]."""
    rng = np.random.default_rng(18)
    nodes: list = []
    params: Dict[str, np.ndarray] = {}

    def conv_bn(x: str, name: str, c_in: int, c_out: int, kernel: int, stride: int, relu: bool) -> str:
        fan_in = c_in * kernel * kernel
        params[f"{name}.weight"] = (rng.standard_normal((c_out, c_in, kernel, kernel)) * np.sqrt(2 / fan_in)).astype(np.float32)
        for stat, value in (("scale", rng.uniform(0.5, 1.5, c_out)), ("bias", rng.standard_normal(c_out) * 0.1),
                            ("mean", np.zeros(c_out)), ("var", np.ones(c_out))):
            params[f"{name}.bn.{stat}"] = value.astype(np.float32)
        pad = kernel // 2
        nodes.append(oh.make_node("Conv", [x, f"{name}.weight"], [f"{name}.conv"], strides=[stride] * 2, pads=[pad] * 4))
        nodes.append(oh.make_node(
            "BatchNormalization", [f"{name}.conv"] + [f"{name}.bn.{s}" for s in ("scale", "bias", "mean", "var")],
            [f"{name}.out", f"{name}.running_mean", f"{name}.running_var"], training_mode=1))
        if not relu:
            return f"{name}.out"
        nodes.append(oh.make_node("Relu", [f"{name}.out"], [f"{name}.relu"]))
        return f"{name}.relu"

    x = conv_bn("x", "conv1", 3, widths[0], 7, 2, relu=True)
    nodes.append(oh.make_node("MaxPool", [x], ["pool"], kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4))
    x, c_in = "pool", widths[0]
    for stage, width in enumerate(widths, start=1):
        for block in range(2):
            name, stride = f"layer{stage}.{block}", 2 if stage > 1 and block == 0 else 1
            h = conv_bn(x, f"{name}.conv1", c_in, width, 3, stride, relu=True)
            h = conv_bn(h, f"{name}.conv2", width, width, 3, 1, relu=False)
            skip = conv_bn(x, f"{name}.downsample", c_in, width, 1, stride, relu=False) if stride != 1 or c_in != width else x
            nodes.append(oh.make_node("Add", [h, skip], [f"{name}.sum"]))
            nodes.append(oh.make_node("Relu", [f"{name}.sum"], [f"{name}.out"]))
            x, c_in = f"{name}.out", width
    params["fc.weight"] = (rng.standard_normal((classes, c_in)) / np.sqrt(c_in)).astype(np.float32)
    params["fc.bias"] = np.zeros(classes, np.float32)
    nodes += [
        oh.make_node("GlobalAveragePool", [x], ["gap"]),
        oh.make_node("Flatten", ["gap"], ["flat"]),
        oh.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], ["y"], transB=1),
    ]
    return model(nodes, {"x": (batch, 3, size, size)}, ["y"], params, opset=15, name="resnet18")


def digits_cnn(classes: int = 10, width: int = 16, seed: int = 0) -> onnx.ModelProto:
    """A small CNN for 8x8 one-channel images (scikit-learn's digits): two blocks of
    Conv 3x3 -> BatchNormalization (training mode) -> Relu -> MaxPool 2x2, then Flatten ->
    Gemm to ``classes`` logits. Input ``x`` [N, 1, 8, 8], output ``logits`` [N, classes];
    weights drawn as torch's defaults (uniform, bound 1/sqrt(fan_in)); BatchNorm scale 1,
    bias 0, running mean 0, running var 1, torch's momentum 0.1 (ONNX momentum 0.9)."""
    rng = np.random.default_rng(seed)
    uniform = lambda fan_in, *shape: rng.uniform(-1, 1, shape).astype(np.float32) / np.float32(np.sqrt(fan_in))  # noqa: E731
    params: Dict[str, np.ndarray] = {}
    nodes = []
    source, channels = "x", 1
    for block, out_channels in ((1, width), (2, 2 * width)):
        fan_in = channels * 9
        params[f"conv{block}.weight"] = uniform(fan_in, out_channels, channels, 3, 3)
        params[f"conv{block}.bias"] = uniform(fan_in, out_channels)
        params[f"bn{block}.weight"] = np.ones(out_channels, np.float32)
        params[f"bn{block}.bias"] = np.zeros(out_channels, np.float32)
        params[f"bn{block}.running_mean"] = np.zeros(out_channels, np.float32)
        params[f"bn{block}.running_var"] = np.ones(out_channels, np.float32)
        names = [f"bn{block}.{n}" for n in ("weight", "bias", "running_mean", "running_var")]
        nodes += [
            oh.make_node("Conv", [source, f"conv{block}.weight", f"conv{block}.bias"], [f"conv{block}"], pads=[1, 1, 1, 1]),
            oh.make_node("BatchNormalization", [f"conv{block}"] + names, [f"bn{block}", f"bn{block}.mean_update", f"bn{block}.var_update"],
                         epsilon=1e-5, momentum=0.9, training_mode=1),
            oh.make_node("Relu", [f"bn{block}"], [f"relu{block}"]),
            oh.make_node("MaxPool", [f"relu{block}"], [f"pool{block}"], kernel_shape=[2, 2], strides=[2, 2]),
        ]
        source, channels = f"pool{block}", out_channels
    features = channels * 2 * 2
    params["fc.weight"] = uniform(features, classes, features)
    params["fc.bias"] = uniform(features, classes)
    nodes += [
        oh.make_node("Flatten", [source], ["features"], axis=1),
        oh.make_node("Gemm", ["features", "fc.weight", "fc.bias"], ["logits"], transB=1),
    ]
    return model(nodes, {"x": ("N", 1, 8, 8)}, ["logits"], params, opset=17, name="digits_cnn")
