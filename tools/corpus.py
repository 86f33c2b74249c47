"""``normgrad corpus``: the interoperability corpus, in the ONNX backend-test layout.

Writes one folder per case::

    CASE/model.onnx
    CASE/test_data_set_0/input_0.pb ...    one per graph input, in graph-input order
    CASE/test_data_set_0/output_0.pb ...   one per graph output, in graph-output order

plus ``manifest.json`` (every case: kind, dtype, op types, description), ``README.md`` and
``written-by-normgrad.json``, the list of every file written. Rewriting a folder removes
only files listed there; a non-empty folder without that list is refused.
Every ``.pb`` is an ``onnx.TensorProto`` carrying the input's or output's name.

Cases:

* ``node_*``: one normgrad node per operator and dtype (float32, float16, bfloat16), with
  broadcast gamma, optional inputs/outputs omitted and flag variety. Each model carries
  the operator's function body (so it runs without kernels; a registered kernel wins).
  Expected outputs: the operator's float64 NumPy reference (``normgrad.ops.*.reference``),
  rounded to the output dtype.
* ``train_*``: training graphs (``normgrad.graphs.build_training_graph``) of small blocks
  built in code (:mod:`normgrad.graphs.examples`): a ResNet block with BatchNorm, a
  diffusion-UNet block with GroupNormalization-21 and the same block as torch's
  TorchScript exporter writes GroupNorm, a style-transfer block with InstanceNorm, an MLP
  with a cross-entropy loss; each (but the MLP, which has no normalization) also as the
  ``_inline`` variant (standard ops only). The cases are written as ``normgrad export``
  writes them (weights pure inputs, :data:`normgrad.graphs.portable.COSTLY_REWRITES` not
  made); each fed weight differs from the forward model's value (:func:`fed_weights`), and a
  ``_stored_weights`` variant keeps the weights as initializers too
  (:func:`normgrad.graphs.builder.training_graph_with_stored_weights`) with the same feeds and expected outputs: a runtime that uses the stored value
  instead of the fed one fails it. Expected outputs: a float64 copy of the
  training graph (every float tensor, constant and Cast target turned into float64) run by
  ``onnx.reference.ReferenceEvaluator`` with the normgrad nodes evaluated by the float64
  NumPy references (not by the function bodies, which compute in float32). An ``_inline``
  case stores the same expected outputs as its non-inline twin.

Deterministic: fixed seeds, every model's producer fields set explicitly, deterministic
protobuf serialization; regenerating on the same machine gives byte-identical files. On
another CPU the float64 references can round differently (BLAS and NumPy's SIMD loops pick
other kernels there), so :func:`compare` holds the stored tensors to :data:`TOLERANCE`
relative to their scale, and everything else (models, manifest, README) byte for byte.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pathlib
import sys
import zlib
from typing import Callable, Dict, List, Optional, Sequence

import ml_dtypes
import numpy as np
import onnx
import onnx.numpy_helper as onh

from normgrad.ops import api
from normgrad.util.version import __version__
from normgrad.util.files import PathOutsideFolderError, path_inside, remove_inside, write_inside

__all__ = ["Case", "cases", "generate", "write", "compare", "default_out", "float64_outputs", "main", "CorpusFolderError",
           "TOLERANCE", "tensor_difference"]

PRODUCER_NAME = "normgrad.tools.corpus"
DATA_SET = "test_data_set_0"
MANIFEST = "manifest.json"
WRITTEN = "written-by-normgrad.json"
"""The list of files the generator wrote into a folder: the only ones it ever removes."""
_BF16 = np.dtype(ml_dtypes.bfloat16)

TOLERANCE = {
    ("node", "float32"): 2e-5,
    ("node", "float16"): 2e-3,
    ("node", "bfloat16"): 1.6e-2,
    ("training", "float32"): 1e-4,
}
"""Largest error relative to max(1, max |expected|), by the case's kind and the data's dtype
(docs/reference/corpus.md): what a runtime's outputs must meet, and how far a
regenerated tensor may be from the stored one. float32 training graphs chain several
convolutions and normalizations: a little looser."""


@dataclasses.dataclass
class Case:
    """One corpus case.

    Attributes:
        name: the folder name.
        kind: ``"node"`` (single normgrad node) or ``"training"``.
        dtype: the element type of the graph's float inputs (``"float32"``, ...).
        description: one line.
        model: the model written to ``model.onnx``.
        inputs: every graph input by name, in graph-input order.
        outputs: every graph output's expected value by name, in graph-output order.
        inline: a training graph with the normgrad function bodies inlined.
        omits_optional: some normgrad node leaves an optional input or output out (the
            Python-kernel bridge rejects such nodes).
    """

    name: str
    kind: str
    dtype: str
    description: str
    model: onnx.ModelProto
    inputs: Dict[str, np.ndarray]
    outputs: Dict[str, np.ndarray]
    inline: bool = False
    omits_optional: bool = False

    def manifest(self) -> dict:
        from normgrad.ops import DOMAIN

        op_types = sorted({n.op_type for n in self.model.graph.node if n.domain == DOMAIN})
        return {
            "kind": self.kind,
            "dtype": self.dtype,
            "inline": self.inline,
            "omits_optional": self.omits_optional,
            "normgrad_ops": op_types,
            "ir_version": self.model.ir_version,
            "opset_import": {o.domain or "ai.onnx": o.version for o in self.model.opset_import},
            "description": self.description,
        }


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


def _finish(model: onnx.ModelProto, description: str) -> onnx.ModelProto:
    from normgrad.ops import IR_VERSION

    model = copy.deepcopy(model)
    model.ir_version = IR_VERSION
    model.producer_name = PRODUCER_NAME
    model.producer_version = __version__
    model.domain = ""
    model.model_version = 1
    model.doc_string = description
    return model


def _omits_optional(model: onnx.ModelProto) -> bool:
    from normgrad.ops import DOMAIN, OPERATORS

    for node in model.graph.node:
        if node.domain == DOMAIN:
            module = OPERATORS[node.op_type]
            names = list(node.input) + list(node.output)
            if len(node.input) < len(module.INPUTS) or len(node.output) < len(module.OUTPUTS) or "" in names:
                return True
    return False


# ----------------------------------------------------------------------------- single nodes


def _node_case(
    name: str,
    op_type: str,
    inputs: Dict[str, Optional[np.ndarray]],
    description: str,
    outputs: Optional[Sequence[str]] = None,
    attributes: Optional[Dict[str, int]] = None,
) -> Case:
    from normgrad.ops import harness, operator

    module = operator(op_type)
    model = harness.node_model(op_type, inputs, outputs, attributes)
    omits = _omits_optional(model)
    model = _finish(api.add_functions(model), description)
    args = {key: inputs.get(key) for key in module.INPUTS}
    result = module.reference(**args, **dict(attributes or {}))
    by_name = dict(zip(module.OUTPUTS, result))
    expected = {o.name: np.asarray(by_name[o.name]) for o in model.graph.output}
    feeds = {key: value for key, value in inputs.items() if value is not None}
    return Case(name, "node", _dtype_name(next(iter(feeds.values())).dtype), description, model, feeds, expected,
                omits_optional=omits)


def _dtype_name(dtype) -> str:
    return "bfloat16" if np.dtype(dtype) == _BF16 else np.dtype(dtype).name


def _bn_inputs(rng, shape, t, u, weight=True, elemt=False, relu=False) -> Dict[str, Optional[np.ndarray]]:
    """``relu``: with relu_output (a ReLU output, exact zeros included) and grad_out NaN
    wherever it is 0 (the fused ReLU backward must give exactly 0 there)."""
    channels = shape[1]
    x = rng.standard_normal(shape) * 1.5 + 0.7
    axes = (0,) + tuple(range(2, len(shape)))
    mean = x.mean(axis=axes)
    invstd = 1.0 / np.sqrt(x.var(axis=axes) + 1e-5)
    values = {
        "grad_out": rng.standard_normal(shape).astype(t),
        "input": x.astype(t),
        "mean": mean.astype(u),
        "invstd": invstd.astype(u),
        "weight": rng.uniform(0.5, 1.5, channels).astype(u) if weight else None,
    }
    if relu:
        y = np.maximum(rng.standard_normal(shape) - 0.3, 0.0)
        values["relu_output"] = y.astype(t)
        values["grad_out"] = np.where(y > 0, values["grad_out"], np.nan).astype(t)
    if elemt:
        from normgrad.ops import batch_norm_reduce_backward

        sums = batch_norm_reduce_backward.reference(
            values["grad_out"], values["input"], values["mean"], values["invstd"], relu_output=values.get("relu_output")
        )
        values["sum_dy"] = np.asarray(sums.sum_dy).astype(u)
        values["sum_dy_xmu"] = np.asarray(sums.sum_dy_xmu).astype(u)
    return values


def _gn_inputs(rng, shape, gamma_shape, t, u) -> Dict[str, np.ndarray]:
    x = rng.standard_normal(shape) * 2.0 - 0.5
    grouped = x.reshape(shape[0], shape[1], -1)
    return {
        "x": x.astype(t),
        "dy": rng.standard_normal(shape).astype(t),
        "gamma": rng.uniform(0.5, 1.5, gamma_shape).astype(t),
        "mean": grouped.mean(-1).astype(u),
        "rstd": (1.0 / np.sqrt(grouped.var(-1) + 1e-5)).astype(u),
    }


def _row_norm_inputs(rng, layer_norm, shape, axis, scale_shape, t, u) -> Dict[str, np.ndarray]:
    """LayerNormalizationGrad (``layer_norm``) or RMSNormalizationGrad inputs, statistics of x."""
    x = rng.standard_normal(shape) * 2.0 + 0.3
    axes = tuple(range(axis % len(shape), len(shape)))
    values = {"dy": rng.standard_normal(shape).astype(t), "x": x.astype(t), "scale": rng.uniform(0.5, 1.5, scale_shape).astype(t)}
    if layer_norm:
        values["mean"] = x.mean(axes, keepdims=True).astype(u)
        values["inv_std_dev"] = (1.0 / np.sqrt(x.var(axes, keepdims=True) + 1e-5)).astype(u)
    else:
        values["inv_rms"] = (1.0 / np.sqrt((x**2).mean(axes, keepdims=True) + 1e-5)).astype(u)
    return values


F32, F16, BF16 = np.dtype(np.float32), np.dtype(np.float16), _BF16


def _node_cases() -> List[Callable[[], Case]]:
    reduce_, elemt, gn = "BatchNormReduceBackward", "BatchNormElemtBackward", "GroupNormalizationGrad"
    ln, rms = "LayerNormalizationGrad", "RMSNormalizationGrad"

    def make(name, op_type, make_inputs, description, **kwargs):
        return lambda: _node_case(name, op_type, make_inputs(_rng(name)), description, **kwargs)

    return [
        make("node_BatchNormReduceBackward_float32", reduce_, lambda r: _bn_inputs(r, (4, 3, 5, 6), F32, F32),
             "BatchNormReduceBackward, float32, rank 4, weight given, every output"),
        make("node_BatchNormReduceBackward_float32_flags", reduce_,
             lambda r: _bn_inputs(r, (6, 5, 7), F32, F32, weight=False),
             "BatchNormReduceBackward, float32, rank 3, weight omitted, input_g=0: only grad_weight and grad_bias",
             outputs=["grad_weight", "grad_bias"], attributes={"input_g": 0}),
        make("node_BatchNormReduceBackward_float16", reduce_, lambda r: _bn_inputs(r, (4, 3, 5, 6), F16, F32),
             "BatchNormReduceBackward, float16 data with float32 statistics (T != U), every output"),
        make("node_BatchNormReduceBackward_bfloat16", reduce_,
             lambda r: _bn_inputs(r, (3, 4, 2, 3, 4), BF16, BF16, weight=False),
             "BatchNormReduceBackward, bfloat16, rank 5, weight omitted, weight_g=0: sum_dy, sum_dy_xmu, grad_bias",
             outputs=["sum_dy", "sum_dy_xmu", "grad_bias"], attributes={"weight_g": 0}),
        make("node_BatchNormReduceBackward_float32_relu", reduce_,
             lambda r: _bn_inputs(r, (4, 3, 5, 6), F32, F32, relu=True),
             "BatchNormReduceBackward, float32, rank 4, fused ReLU backward: relu_output given, grad_out NaN where "
             "it is 0; every output"),
        make("node_BatchNormElemtBackward_float32", elemt, lambda r: _bn_inputs(r, (4, 3, 5, 6), F32, F32, elemt=True),
             "BatchNormElemtBackward, float32, rank 4"),
        make("node_BatchNormElemtBackward_float32_relu", elemt,
             lambda r: _bn_inputs(r, (4, 3, 5, 6), F32, F32, elemt=True, relu=True),
             "BatchNormElemtBackward, float32, rank 4, fused ReLU backward: relu_output given, grad_out NaN where "
             "it is 0"),
        make("node_BatchNormElemtBackward_float16", elemt, lambda r: _bn_inputs(r, (4, 3, 7), F16, F32, elemt=True),
             "BatchNormElemtBackward, float16 data with float32 statistics, rank 3"),
        make("node_BatchNormElemtBackward_bfloat16", elemt,
             lambda r: _bn_inputs(r, (2, 4, 3, 5), BF16, BF16, elemt=True),
             "BatchNormElemtBackward, bfloat16, rank 4"),
        make("node_GroupNormalizationGrad_float32", gn, lambda r: _gn_inputs(r, (2, 4, 3, 10), (1, 4, 3, 1), F32, F32),
             "GroupNormalizationGrad, float32, x [N, G, C/G, HW] with per-channel gamma [1, G, C/G, 1] "
             "broadcast; dx, dgamma, dbeta"),
        make("node_GroupNormalizationGrad_float32_full_gamma_dx_only", gn,
             lambda r: _gn_inputs(r, (2, 3, 4, 5), (2, 3, 4, 5), F32, F32),
             "GroupNormalizationGrad, float32, gamma of x's full shape (CANN's layout), dx only",
             outputs=["dx"]),
        make("node_GroupNormalizationGrad_float16", gn, lambda r: _gn_inputs(r, (2, 4, 2, 12), (1, 4, 2, 1), F16, F32),
             "GroupNormalizationGrad, float16 with float32 mean/rstd, broadcast gamma; dx and dgamma",
             outputs=["dx", "dgamma"]),
        make("node_GroupNormalizationGrad_bfloat16", gn,
             lambda r: _gn_inputs(r, (2, 2, 3, 4, 4), (1, 2, 3, 1, 1), BF16, BF16),
             "GroupNormalizationGrad, bfloat16, rank 5, broadcast gamma; dx, dgamma, dbeta"),
        make("node_LayerNormalizationGrad_float32", ln, lambda r: _row_norm_inputs(r, True, (3, 5, 40), -1, (40,), F32, F32),
             "LayerNormalizationGrad, float32, [tokens, hidden] rows at axis -1; dx, dscale, dbias"),
        make("node_LayerNormalizationGrad_float16", ln,
             lambda r: _row_norm_inputs(r, True, (2, 6, 3, 7), 2, (3, 7), F16, F32),
             "LayerNormalizationGrad, float16 with float32 mean/inv_std_dev (stash_type 1), axis 2; dx and dscale",
             outputs=["dx", "dscale"], attributes={"axis": 2}),
        make("node_LayerNormalizationGrad_bfloat16", ln,
             lambda r: _row_norm_inputs(r, True, (4, 3, 9), -2, (1, 9), BF16, BF16),
             "LayerNormalizationGrad, bfloat16, axis -2 with scale [1, 9] broadcast over the normalised axes; "
             "dx and dbias", outputs=["dx", "dbias"], attributes={"axis": -2}),
        make("node_RMSNormalizationGrad_float32", rms, lambda r: _row_norm_inputs(r, False, (3, 5, 40), -1, (40,), F32, F32),
             "RMSNormalizationGrad, float32, [tokens, hidden] rows at axis -1; dx and dscale"),
        make("node_RMSNormalizationGrad_float16_dx_only", rms,
             lambda r: _row_norm_inputs(r, False, (4, 2, 11), -2, (2, 11), F16, F16),
             "RMSNormalizationGrad, float16, axis -2; dx only", outputs=["dx"], attributes={"axis": -2}),
        make("node_RMSNormalizationGrad_bfloat16", rms,
             lambda r: _row_norm_inputs(r, False, (2, 7, 24), -1, (24,), BF16, F32),
             "RMSNormalizationGrad, bfloat16 with float32 inv_rms (Llama's float32 statistics); dx and dscale"),
    ]


# ----------------------------------------------------------------------------- training graphs


def float64_outputs(model: onnx.ModelProto, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Every output of ``model`` evaluated in float64: a float64 copy of the graph run by
    ``onnx.reference.ReferenceEvaluator``, normgrad nodes by the NumPy references."""
    from onnx.reference import ReferenceEvaluator

    from normgrad.ops import OPERATORS
    from normgrad.tools.check import _to_double, reference_op

    double = copy.deepcopy(model)
    del double.functions[:]
    _to_double(double.graph)
    evaluator = ReferenceEvaluator(
        double, new_ops=[reference_op(module) for module in OPERATORS.values()]
    )
    names = [o.name for o in model.graph.output]
    doubles = {k: v.astype(np.float64) if v.dtype.kind == "f" or v.dtype == _BF16 else v for k, v in feeds.items()}
    return dict(zip(names, evaluator.run(names, doubles)))


def fed_weights(initial: Dict[str, np.ndarray], name: str) -> Dict[str, np.ndarray]:
    """The weights a training case feeds: the initial values moved by a seeded 10-30 % per
    element (sign kept), so no fed weight equals the value a graph might store for it."""
    rng = _rng(name + "/weights")
    return {key: (value * rng.uniform(1.1, 1.3, value.shape) + 0.05 * np.sign(value)).astype(value.dtype)
            for key, value in initial.items()}


def _training_feeds(model: onnx.ModelProto, name: str, weights: Dict[str, np.ndarray],
                    batch: int = 4) -> Dict[str, np.ndarray]:
    rng = _rng(name)
    feeds = {}
    for info in model.graph.input:
        if info.name in weights:
            feeds[info.name] = weights[info.name]
            continue
        tensor_type = info.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else batch for d in tensor_type.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        if info.name == "labels" and dtype == np.int64:
            feeds[info.name] = rng.integers(0, 3, dims).astype(np.int64)
        else:
            feeds[info.name] = rng.standard_normal(dims).astype(dtype)
    return feeds


def _training_cases() -> List[Callable[[], List[Case]]]:
    from normgrad.graphs import examples

    blocks = [
        ("resnet_block", examples.resnet_block, None, True,
         "ResNet basic block: Conv-BatchNormalization(training_mode=1)-Relu-Conv-BatchNormalization + skip, Relu"),
        ("unet_block", examples.unet_block, None, True,
         "diffusion-UNet block: Conv-GroupNormalization-21-SiLU(x*Sigmoid(x))-Conv + skip"),
        ("unet_block_torchscript", examples.unet_block_torchscript, None, True,
         "UNet block with GroupNorm as torch's TorchScript exporter writes it "
         "(Reshape-InstanceNormalization-Reshape-Mul-Add)"),
        ("style_transfer_block", examples.style_transfer_block, None, True,
         "style-transfer residual block: Conv-InstanceNormalization-Relu-Conv-InstanceNormalization + skip"),
        ("mlp_cross_entropy", examples.mlp, "cross_entropy", False,
         "MLP Gemm-Tanh-MatMul-Add with a cross-entropy loss (no normalization: no inline variant)"),
    ]

    def make(block, builder, loss, with_inline, description):
        def build() -> List[Case]:
            from normgrad.graphs import build_training_graph
            from normgrad.graphs.builder import training_graph_with_stored_weights
            from normgrad.graphs.portable import as_exported

            forward = builder()
            name = f"train_{block}"
            text = f"training graph of the {description}" + (f", loss {loss}" if loss else ", seeded output gradients")
            stored = training_graph_with_stored_weights(forward, loss=loss)
            exported, initial = as_exported(stored)
            weights = fed_weights(initial, name)
            model = _finish(exported, text + "; weights are pure inputs (as exported), fed values that differ from "
                                            "the forward model's")
            feeds = _training_feeds(model, name, weights)
            expected64 = float64_outputs(model, feeds)
            expected = {
                o.name: np.asarray(expected64[o.name]).astype(
                    onnx.helper.tensor_dtype_to_np_dtype(o.type.tensor_type.elem_type))
                for o in model.graph.output
            }
            result = [Case(name, "training", "float32", model.doc_string, model, feeds, expected,
                           omits_optional=_omits_optional(model))]
            stored_text = (text + "; weights both inputs and initializers (training_graph_with_stored_weights), "
                                  "fed values that differ from the stored ones: a runtime that ignores fed weights fails")
            stored = _finish(stored, stored_text)
            stored_feeds = _training_feeds(stored, name, weights)
            assert all(np.array_equal(stored_feeds[k], feeds[k]) for k in feeds)
            assert [o.name for o in stored.graph.output] == list(expected)
            result.append(Case(name + "_stored_weights", "training", "float32", stored_text, stored, stored_feeds,
                               expected, omits_optional=_omits_optional(stored)))
            if with_inline:
                inline_text = text + "; normgrad function bodies inlined (standard ops only), weights pure inputs"
                inline, _ = build_training_graph(forward, loss=loss, inline=True)
                inline = _finish(inline, inline_text)
                assert [i.name for i in inline.graph.input] == list(feeds)
                assert [o.name for o in inline.graph.output] == list(expected)
                result.append(Case(name + "_inline", "training", "float32", inline_text, inline, feeds, expected,
                                   inline=True))
            return result

        return build

    return [make(*block) for block in blocks]


def cases() -> List[Case]:
    """Every corpus case, freshly generated (a few seconds)."""
    result = [make() for make in _node_cases()]
    for make in _training_cases():
        result.extend(make())
    return result


# ----------------------------------------------------------------------------- files


def _tensor_bytes(name: str, value: np.ndarray) -> bytes:
    return onh.from_array(np.asarray(value), name).SerializeToString(deterministic=True)


def _readme(all_cases: Sequence[Case]) -> str:
    lines = [
        "# normgrad interoperability corpus",
        "",
        "Generated by `normgrad corpus` (`python -m normgrad.tools.corpus --out graphs/corpus`); do not edit.",
        "ONNX backend-test layout: `CASE/model.onnx`, `CASE/test_data_set_0/input_*.pb` (graph-input order),",
        "`output_*.pb` (graph-output order), each an `onnx.TensorProto` with the value's name.",
        "Expected outputs are float64 references rounded to the output dtype: the operators' NumPy references",
        "for `node_*` cases; for `train_*` cases a float64 copy of the graph run by",
        "`onnx.reference.ReferenceEvaluator` with the normgrad nodes evaluated by the NumPy references.",
        "`manifest.json` describes every case. `tests/test_corpus.py` runs the corpus on every runtime path.",
        "",
        "| case | dtype | normgrad ops | description |",
        "|---|---|---|---|",
    ]
    for case in all_cases:
        info = case.manifest()
        ops = "none (inlined)" if case.inline else ", ".join(info["normgrad_ops"]) or "none"
        lines.append(f"| `{case.name}` | {case.dtype} | {ops} | {case.description} |")
    return "\n".join(lines) + "\n"


def files(all_cases: Sequence[Case]) -> Dict[str, bytes]:
    """The corpus as {relative path: bytes}."""
    out: Dict[str, bytes] = {}
    for case in all_cases:
        out[f"{case.name}/model.onnx"] = case.model.SerializeToString(deterministic=True)
        for i, (name, value) in enumerate(case.inputs.items()):
            out[f"{case.name}/{DATA_SET}/input_{i}.pb"] = _tensor_bytes(name, value)
        for i, (name, value) in enumerate(case.outputs.items()):
            out[f"{case.name}/{DATA_SET}/output_{i}.pb"] = _tensor_bytes(name, value)
    manifest = {case.name: case.manifest() for case in all_cases}
    out[MANIFEST] = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    out["README.md"] = _readme(all_cases).encode()
    return with_written_list(out)


def with_written_list(corpus: Dict[str, bytes]) -> Dict[str, bytes]:
    """``corpus`` plus its WRITTEN entry: the list of its other files."""
    files = sorted(path for path in corpus if path != WRITTEN)
    listing = (json.dumps({"producer": PRODUCER_NAME, "files": files}, indent=1) + "\n").encode()
    return {**{path: corpus[path] for path in files}, WRITTEN: listing}


def generate() -> Dict[str, bytes]:
    """The corpus as {relative path: bytes}, freshly generated."""
    return files(cases())


def _existing(out: pathlib.Path) -> Dict[str, pathlib.Path]:
    if not out.is_dir():
        return {}
    return {p.relative_to(out).as_posix(): p for p in sorted(out.rglob("*")) if p.is_file()}


class CorpusFolderError(ValueError):
    """The output folder is not one the generator may write into (it holds other files)."""


def _written_before(out: pathlib.Path) -> List[str]:
    """The files an earlier run listed in ``out``/WRITTEN; [] for a missing or empty folder.

    Raises:
        CorpusFolderError: ``out`` is a file, or a non-empty folder without a valid list.
    """
    if not out.exists():
        return []
    if not out.is_dir():
        raise CorpusFolderError(f"{out} is not a folder")
    if not any(out.iterdir()):
        return []
    refusal = (f"{out} is not empty and has no {WRITTEN} (the list of files normgrad corpus wrote there); "
               "refusing to write into it: choose a new or empty folder")
    try:
        written = json.loads((out / WRITTEN).read_text())
    except (OSError, ValueError):
        raise CorpusFolderError(refusal) from None
    files = written.get("files") if isinstance(written, dict) and written.get("producer") == PRODUCER_NAME else None
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise CorpusFolderError(refusal)
    # only plain relative paths inside the folder
    return [f for f in files if f and not pathlib.PurePosixPath(f).is_absolute() and ".." not in f.split("/")]


def write(out, corpus: Optional[Dict[str, bytes]] = None) -> List[str]:
    """Writes the corpus into folder ``out`` (created if needed), each file atomically, the
    list of files (WRITTEN) last; removes the files an earlier run listed there that are no
    longer generated, and nothing else.

    Returns:
        The relative paths written.

    Raises:
        CorpusFolderError: ``out`` is a file, a non-empty folder holding no list of an
            earlier run, or a file to write or remove leads outside ``out`` (through a
            symbolic link); nothing is written then.
        OSError: a file could not be written (the files already there are intact).
    """
    out = pathlib.Path(out)
    corpus = generate() if corpus is None else corpus
    before = _written_before(out)
    removed = [relative for relative in before if relative not in corpus]
    try:  # every path checked before anything is written or removed
        for relative in corpus:
            path_inside(out, relative, "corpus file")
        for relative in removed:
            path_inside(out, relative, "corpus file", follow_last=False)
    except PathOutsideFolderError as error:
        raise CorpusFolderError(f"{error}; nothing was written") from None
    for relative in sorted(corpus, key=lambda path: path == WRITTEN):
        write_inside(out, relative, corpus[relative], "corpus file")
    for relative in removed:
        remove_inside(out, relative, "corpus file")
    return list(corpus)


def tensor_difference(actual: np.ndarray, expected: np.ndarray, tolerance: float,
                      sides: Sequence[str] = ("got", "expected")) -> Optional[str]:
    """None when ``actual`` is ``expected`` within ``tolerance`` × max(1, max |expected|) (NaN
    and infinities where ``expected`` has them; integers exactly), else what differs and by
    how much, the values named by ``sides``."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        return f"shape {actual.shape} != {expected.shape}"
    if expected.size == 0:
        return None
    if expected.dtype.kind != "f" and expected.dtype != _BF16:
        unequal = actual != expected
        if not unequal.any():
            return None
        first = _index(unequal)
        return (f"{int(unequal.sum())} of {expected.size} values differ "
                f"(first at {first}: {sides[0]} {actual[first]}, {sides[1]} {expected[first]})")
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    nonfinite = (np.isnan(a) != np.isnan(e)) | ((np.isinf(a) | np.isinf(e)) & (a != e))
    if nonfinite.any():
        first = _index(nonfinite)
        return (f"{int(nonfinite.sum())} of {expected.size} values are NaN or infinite on one side only "
                f"(first at {first}: {sides[0]} {a[first]}, {sides[1]} {e[first]})")
    finite = np.isfinite(e)
    if not finite.any():
        return None
    scale = max(1.0, float(np.abs(e[finite]).max()))
    errors = np.where(finite, np.abs(a - e), 0.0)
    worst = _index(errors)
    if errors[worst] <= tolerance * scale:
        return None
    return (f"max error {errors[worst]:.3g} at {worst} ({sides[0]} {a[worst]:.9g}, {sides[1]} {e[worst]:.9g}), scale {scale:.3g}: "
            f"beyond the tolerance {tolerance:g} relative to the scale ({tolerance * scale:.3g})")


def _index(values: np.ndarray) -> tuple:
    """The index of the largest (first true) element, as plain ints."""
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(values)), values.shape))


def _tensor_tolerance(kind: str, dtype: np.dtype) -> float:
    """TOLERANCE for a tensor of ``dtype`` in a case of ``kind``; 0 (exact) for dtypes it has no entry for."""
    name = _dtype_name(dtype)
    return TOLERANCE.get((kind, name), TOLERANCE.get(("node", name), 0.0))


def _stored_difference(path: str, stored: bytes, fresh: bytes, kind: str) -> Optional[str]:
    """None when the stored file holds what the fresh one does: a tensor (``.pb``) of the same
    name, dtype and shape with values within :data:`TOLERANCE` (a float64 reference rounds
    differently on another CPU); any other file byte for byte. Else what differs."""
    if not path.endswith(".pb"):
        return "contents differ"
    tensors = []
    for data in (stored, fresh):
        tensor = onnx.TensorProto()
        try:
            tensor.ParseFromString(data)
            tensors.append((tensor.name, onh.to_array(tensor)))
        except Exception as error:  # a damaged or foreign file: say so rather than raise
            return f"not a readable onnx.TensorProto ({error})"
    (stored_name, stored_value), (fresh_name, fresh_value) = tensors
    if stored_name != fresh_name:
        return f"tensor name {stored_name!r} != {fresh_name!r}"
    if stored_value.dtype != fresh_value.dtype:
        return f"tensor {fresh_name!r}: dtype {_dtype_name(stored_value.dtype)} != {_dtype_name(fresh_value.dtype)}"
    difference = tensor_difference(stored_value, fresh_value, _tensor_tolerance(kind, fresh_value.dtype),
                                   ("stored", "generated"))
    return None if difference is None else f"tensor {fresh_name!r}: {difference}"


def compare(out, corpus: Optional[Dict[str, bytes]] = None) -> List[str]:
    """The differences between folder ``out`` and a fresh corpus: missing, extra and
    differing files (empty when the folder is current), each saying what differs. Stored
    tensors match within :data:`TOLERANCE` relative to their scale, so a corpus generated
    on another CPU is current; models, manifest and README match byte for byte."""
    out = pathlib.Path(out)
    corpus = generate() if corpus is None else corpus
    kinds = {name: info["kind"] for name, info in json.loads(corpus[MANIFEST]).items()} if MANIFEST in corpus else {}
    existing = _existing(out)
    problems = [f"missing: {p}" for p in corpus if p not in existing]
    problems += [f"not generated: {p}" for p in existing if p not in corpus]
    for path in corpus:
        stored = existing[path].read_bytes() if path in existing else None
        if stored is None or stored == corpus[path]:
            continue
        difference = _stored_difference(path, stored, corpus[path], kinds.get(path.split("/")[0], "node"))
        if difference is not None:
            problems.append(f"differs: {path}: {difference}")
    return problems


def default_out() -> pathlib.Path:
    """``normgrad-corpus`` in the current directory (never inside the installed package)."""
    return pathlib.Path("normgrad-corpus")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``normgrad corpus``; returns the process exit code."""
    from normgrad.tools.cli import ArgumentParser

    parser = ArgumentParser(prog="normgrad corpus", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None,
                        help=f"output folder: new, empty, or written by normgrad corpus before (default: ./{default_out()} "
                             "in the current directory; the repository's copy is graphs/corpus)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if the folder differs from a fresh corpus")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out) if args.out else default_out()
    corpus = generate()
    if args.check:
        problems = compare(out, corpus)
        for problem in problems:
            print(problem)
        print(f"{out}: {'up to date' if not problems else f'{len(problems)} differences'}")
        return 1 if problems else 0
    try:
        write(out, corpus)
    except CorpusFolderError as error:
        print(f"normgrad corpus: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"normgrad corpus: cannot write {out}: {error.strerror or error}", file=sys.stderr)
        return 1
    cases_count = len({p.split('/')[0] for p in corpus if '/' in p})
    size = sum(len(b) for b in corpus.values())
    print(f"wrote {cases_count} cases ({size / 1024:.0f} KiB) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
