"""Training-mode Dropout drawn from a seed, the step and the micro-batch
(:func:`seed_dropout`): the same masks on every runtime. Not a pass of the builder: the step
graph (:mod:`normgrad.graphs.step_graph`), the portable form and the Trainer seed a graph after
differentiation.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from normgrad.graphs.rewrites._graph import constant_values, unique_name
from normgrad.graphs.rewrites.expand import expand_operator
from normgrad.ops import DOMAIN, dropout_mask

__all__ = ["DROPOUT_SEED_INPUT", "DROPOUT_MICRO_BATCH_INPUT", "METADATA_DROPOUT", "training_dropouts", "seed_dropout", "expand_dropout_masks"]


DROPOUT_SEED_INPUT = "dropout_seed"
"""Step-graph input (int64 scalar) of :func:`seed_dropout`: the Dropout seed."""


DROPOUT_MICRO_BATCH_INPUT = "dropout_micro_batch"
"""The micro-batch index (int64 scalar) under gradient accumulation: a Constant 0 in a step
graph, an input of the gradient graph (:func:`normgrad.graphs.step_graph.build_gradient_graph`)."""


METADATA_DROPOUT = "normgrad.dropout"
"""Model metadata key: JSON {"seed": the default seed, "outputs": {Dropout output: its data input}}."""


_CHAIN_KEYS = (0x3C751DE9, 0x2B3D0209)
"""The fixed odd 30-bit keys of the key chain's two draws (varied hex digits, as squares keys should be)."""


_COUNTER_LIMBS = (("seed", 5), ("step", 2), ("micro_batch", 2))
"""The key chain's counters and their 15-bit limbs (5 cover an int64 seed)."""


def training_dropouts(graph: onnx.GraphProto) -> list:
    """The default-domain Dropout nodes that may run in training mode (a training_mode input
    that is not the constant False)."""
    found = []
    for node in graph.node:
        if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx"):
            continue
        training = node.input[2] if len(node.input) > 2 and node.input[2] else None
        value = constant_values(graph, training) if training else np.asarray(False)
        if value is None or bool(np.asarray(value).reshape(-1)[0]):
            found.append(node)
    return found


def seed_dropout(graph: onnx.GraphProto, step: str, seed: int) -> dict:
    """Replaces, in place, every Dropout node of ``graph`` that may run in training mode by
    ops whose mask is a function of (seed, step, micro-batch, node, element):

    * squares on 30-bit words (:func:`normgrad.ops.dropout_mask.squares`: four rounds of
      x * x + y mod 2**30 and swapping 15-bit halves), exact in 32-bit integer arithmetic, so
      every runtime (OpenVINO computes int64 in 32 bits, tract has no int64 Square) draws the
      same masks;
    * a key: the 15-bit limbs of the seed (5), the step (2) and the micro-batch (2), limb j
      with value v as the counter j * 2**15 + v, each drawn under K1; the draws summed mod
      2**30 and drawn again under K2, made odd; node i (graph order) gets squares(i, key),
      made odd;
    * element e (row-major, mod 2**30) is kept when squares(e, node key)'s top 24 bits /
      2**24 >= ratio: probability 1 - ratio; kept elements are divided by 1 - ratio, as
      Dropout does. This draw is a ``normgrad:DropoutMask`` node (the key chain before it
      is a few scalar standard ops): onnxruntime runs its kernel, other runtimes its function
      body, the same generator in standard ops, which ``--inline`` and the portable form write
      in its place (:func:`expand_dropout_masks`).

    The seed is the new int64 scalar input ``dropout_seed`` (``seed``, recorded in the
    metadata, is what :class:`normgrad.train.Trainer` feeds by default); ``step`` names a
    scalar of the graph (the step graph's ``step``), cast to int64; the micro-batch index
    ``dropout_micro_batch`` is a Constant 0. The replaced nodes keep their output names (the
    mask too, which the Dropout gradient rule already reads): run after differentiation,
    forward and backward share one mask. Integer arithmetic only: bitwise the same on any
    onnxruntime, thread count and graph optimization level, and on OpenVINO and onnx's
    ReferenceEvaluator (``tests/test_runtimes.py``; on OpenVINO, which holds int64 as int32,
    for seeds of int32's range).

    Returns:
        {Dropout output: its data input} of the replaced nodes ({} and ``graph`` unchanged
        when there are none).

    Raises:
        ValueError: ``seed`` is not an int64 integer, or the graph already has a value named
            like a new input.
    """
    dropouts = training_dropouts(graph)
    if not dropouts:
        return {}
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not -2**63 <= int(seed) < 2**63:
        raise ValueError(f"the Dropout seed must be an integer in the int64 range, got {seed!r}")
    names = {n for node in graph.node for n in list(node.input) + list(node.output)}
    names |= {i.name for i in graph.input} | {t.name for t in graph.initializer}
    for reserved in (DROPOUT_SEED_INPUT, DROPOUT_MICRO_BATCH_INPUT):
        if reserved in names:
            raise ValueError(f"the graph already has a value named {reserved!r}")
    emit = dropout_mask.Emitter(unique_name(graph, "dropout_mask"))
    one = emit.const([1])
    step_int = emit.op("Cast", step, to=onnx.TensorProto.INT64)
    emit.op("Constant", value=onh.from_array(np.array(0, np.int64)), output=DROPOUT_MICRO_BATCH_INPUT)
    limbs = [limb for counter, (_, count) in zip((DROPOUT_SEED_INPUT, step_int, DROPOUT_MICRO_BATCH_INPUT), _COUNTER_LIMBS)
             for limb in emit.limbs(emit.op("Reshape", counter, one), count)]
    counters = (emit.const(np.arange(len(limbs)), np.int32),
                emit.op("Cast", emit.op("Concat", *limbs, axis=0), to=onnx.TensorProto.INT32))
    drawn = emit.squares(counters, emit.word_const(_CHAIN_KEYS[0]))
    high, low = (emit.op("ReduceSum", half, keepdims=1) for half in drawn)
    summed = emit.carry(low, high, emit.const(dropout_mask.LIMB, np.int32))
    key = emit.odd(emit.squares(summed, emit.word_const(_CHAIN_KEYS[1])))
    node_keys = emit.odd(emit.squares((emit.const(np.zeros(len(dropouts)), np.int32),
                                       emit.const(np.arange(len(dropouts)), np.int32)), key))
    # a Split, not Gathers: onnxruntime 1.19's GatherSliceToSplitFusion gives every fused
    # group the same node name, then rejects the graph
    node_keys = list(zip(*(emit.split(half, len(dropouts)) for half in node_keys)))
    chain, emit.nodes = emit.nodes, []
    replaced, outputs = {}, {}
    for index, node in enumerate(dropouts):
        x = node.input[0]
        ratio = node.input[1] if len(node.input) > 1 and node.input[1] else emit.const(0.5, np.float32)
        training = node.input[2]
        keep = emit.op(dropout_mask.OP_TYPE, x, emit.op("Cast", ratio, to=onnx.TensorProto.FLOAT), *node_keys[index],
                       domain=DOMAIN)
        runtime = constant_values(graph, training) is None
        mask = node.output[1] if len(node.output) > 1 and node.output[1] else None
        if runtime:
            emit.op("Or", keep, emit.op("Not", training), output=mask)
        elif mask:
            emit.op("Identity", keep, output=mask)
        one_x = emit.op("CastLike", emit.const(1.0, np.float32), x)
        kept = emit.op("Div", x, emit.op("Sub", one_x, emit.op("CastLike", ratio, x)))
        masked = emit.op("Where", keep, kept, emit.op("CastLike", emit.const(0.0, np.float32), x),
                         output=None if runtime else node.output[0])
        if runtime:
            emit.op("Where", training, masked, x, output=node.output[0])
        replaced[id(node)], emit.nodes = emit.nodes, []
        outputs[node.output[0]] = x
    nodes = chain + [new for node in graph.node for new in replaced.get(id(node), [node])]
    del graph.node[:]
    graph.node.extend(nodes)
    graph.input.append(oh.make_tensor_value_info(DROPOUT_SEED_INPUT, onnx.TensorProto.INT64, []))
    return outputs


def expand_dropout_masks(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every main-graph DropoutMask node replaced by its function body (the
    generator in standard integer ops, as :func:`seed_dropout` wrote it before the operator
    existed); ``model`` itself when it has none."""
    return expand_operator(model, dropout_mask)
