"""LSTM, GRU and RNN as ONNX defines them: every direction, layout 0 (``layout=1`` nodes are
rewritten to it first: :func:`normgrad.graphs.rewrites.recurrent_layout_0`), sequence_lens,
initial_h / initial_c, LSTM peepholes, GRU linear_before_reset, the activations Sigmoid,
Tanh and Relu in any position. Refused by name: ``clip``, LSTM ``input_forget=1``, other
activations.

An LSTM that needs gradients is computed in the training graph by a forward of ours that
keeps what the backward reads (:meth:`GradientContext.replace_forward`): the input
projection W X^T + b of all steps is one MatMul (b a column of W against ones in X), and a
``Scan`` over time does the step's
R h, the gates and the cell, returning the activated gates, the cell states and act(c)
with Y. The LSTM's Scans run feature-major ([hidden, batch] states), so that each step's
GEMM has the weight as its left operand (see :func:`_lstm_forward`). GRU and RNN nodes
stay as they are (onnxruntime's fused kernels) and the GRU's backward recomputes its gates
from the node's output Y (added to the node when absent): the hidden state before step t
is ``initial_h`` or Y at t - 1, so every gate pre-activation of every step is one batched
MatMul of X with W plus one of Y shifted by a step with R. The backward's reverse-time
recurrence of the state gradients is a Scan with one [batch, gates*hidden] x
[gates*hidden, hidden] MatMul per step (two for GRU with ``linear_before_reset=0``; the
LSTM's is [hidden, gates*hidden] x [gates*hidden, batch]), its per-step factors computed
before it for all steps (for the LSTM with the default activations, no peepholes and no
sequence_lens, by one ``normgrad:LSTMBackwardFactors`` node); the weight gradients are then
one GEMM each over all steps at once (an ``OuterProductSum`` when large:
:meth:`GradientContext.weight_gradient`).

Each direction is differentiated as a forward recurrence: the reverse direction on the
inputs and outputs reversed in time within each sequence's length (``ReverseSequence`` with
sequence_lens, a Slice with step -1 without: tract has no ReverseSequence).
With ``sequence_lens`` the steps past a sequence's end keep the state and write zeros to Y;
there the state gradient passes through unchanged and the gate gradients are zero. Every
Scan runs forward (a reverse-time one on sequences reversed by a Slice: onnx's reference
evaluator runs no other Scan direction), and its body declares the rank of every value.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from normgrad.graphs.context import GradientContext, attr, describe
from normgrad.graphs.rules.registry import UnsupportedOperatorError, register
from normgrad.ops import DOMAIN, lstm_backward_factors

__all__ = ["recurrent_gradient", "SUPPORTED_ACTIVATIONS"]

SUPPORTED_ACTIVATIONS = ("Sigmoid", "Tanh", "Relu")
"""Activations whose derivative follows from their output."""

_DEFAULT_ACTIVATIONS = {"LSTM": ("Sigmoid", "Tanh", "Tanh"), "GRU": ("Sigmoid", "Tanh"), "RNN": ("Tanh",)}
_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
_INPUTS = {"LSTM": (0, 1, 2, 3, 5, 6, 7), "GRU": (0, 1, 2, 3, 5), "RNN": (0, 1, 2, 3, 5)}
_X, _W, _R, _B, _SEQUENCE_LENS, _INITIAL_H, _INITIAL_C, _P = range(8)


def _input(node: onnx.NodeProto, index: int) -> Optional[str]:
    return node.input[index] if len(node.input) > index and node.input[index] else None


def _activations(node: onnx.NodeProto, directions: int) -> List[Tuple[str, ...]]:
    """The activations of each direction.

    Raises:
        UnsupportedOperatorError: clip, input_forget, or an activation without a rule.
    """
    if attr(node, "clip", None) is not None:
        raise UnsupportedOperatorError(f"{describe(node)}: {node.op_type} with 'clip' has no gradient rule")
    if node.op_type == "LSTM" and attr(node, "input_forget", 0):
        raise UnsupportedOperatorError(f"{describe(node)}: LSTM with input_forget=1 has no gradient rule")
    default = _DEFAULT_ACTIVATIONS[node.op_type]
    given = attr(node, "activations", None)
    names = [a.decode() if isinstance(a, bytes) else a for a in given] if given else list(default) * directions
    if len(names) != len(default) * directions:
        raise UnsupportedOperatorError(
            f"{describe(node)}: {len(names)} activations for {directions} direction(s) of {node.op_type}")
    unsupported = sorted({a for a in names if a not in SUPPORTED_ACTIVATIONS})
    if unsupported:
        raise UnsupportedOperatorError(
            f"{describe(node)}: {node.op_type} with activation {', '.join(unsupported)} has no gradient rule "
            f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
    return [tuple(names[d * len(default):(d + 1) * len(default)]) for d in range(directions)]


def _derivative(ctx: GradientContext, activation: str, y: str, like: str) -> str:
    """The activation's derivative at the input whose output is ``y``."""
    if activation in ("Sigmoid", "Tanh"):
        return lstm_backward_factors.activation_slope(ctx.op, activation, y, ctx.scalar(1.0, like))
    return ctx.op("Cast", ctx.op("Greater", y, ctx.scalar(0.0, like)), to=ctx.elem_type(like))


def _reversed_in_time(ctx: GradientContext, sequence: str) -> str:
    return ctx.op("Slice", sequence, ctx.ints([-1]), ctx.ints([-(2 ** 63)]), ctx.ints([0]), ctx.ints([-1]))


def _scan(
    ctx: GradientContext,
    states: Sequence[str],
    sequences: Sequence[str],
    body: Callable[[List[str], List[str]], Tuple[List[str], List[str]]],
    reverse: bool,
    like: str,
    mask: Optional[str] = None,
    outputs_reversed: bool = False,
    reversed_already: Sequence[str] = (),
) -> Tuple[List[str], List[str]]:
    """A Scan over axis 0 of ``sequences`` carrying ``states``; ``body(states, slices)``
    emits the step (through ``ctx``) and returns (new states, per-step outputs). Returns
    (final states, stacked outputs in time order). Every value is of ``like``'s type but
    the sequence ``mask`` (bool); every state and step slice is [batch, n]. ``reverse``
    runs from the last step to the first (as a forward Scan over reversed sequences, but
    those in ``reversed_already``, which are last step first as given); with
    ``outputs_reversed`` its stacked outputs stay in that order (last step first)."""
    elem_type = ctx.elem_type(like)
    if reverse:
        mask_index = list(sequences).index(mask) if mask is not None else None
        sequences = [sequence if sequence in reversed_already else _reversed_in_time(ctx, sequence)
                     for sequence in sequences]
        mask = None if mask_index is None else sequences[mask_index]
    outer_nodes, ctx.nodes = ctx.nodes, []
    state_inputs = [ctx.fresh("state") for _ in states]
    slice_inputs = [ctx.fresh("step") for _ in sequences]
    new_states, step_outputs = body(list(state_inputs), list(slice_inputs))
    body_inputs = set(state_inputs) | set(slice_inputs)
    outputs = []
    for name in list(new_states) + list(step_outputs):
        outputs.append(ctx.op("Identity", name) if name in body_inputs or name in outputs else name)
    body_nodes, ctx.nodes = ctx.nodes, outer_nodes
    rank_2 = [None, None]
    graph = oh.make_graph(
        body_nodes,
        ctx.fresh("scan_body"),
        [oh.make_tensor_value_info(name, onnx.TensorProto.BOOL if sequence == mask else elem_type, rank_2)
         for name, sequence in zip(state_inputs + slice_inputs, list(states) + list(sequences))],
        [oh.make_tensor_value_info(name, elem_type, rank_2) for name in outputs],
    )
    results = ctx.op("Scan", *states, *sequences, outputs=len(outputs), body=graph, num_scan_inputs=len(sequences))
    results = [results] if isinstance(results, str) else results
    stacked = results[len(states):]
    if reverse and not outputs_reversed:
        stacked = [_reversed_in_time(ctx, output) for output in stacked]
    return results[:len(states)], stacked


@contextlib.contextmanager
def _emitting_into(ctx: GradientContext, nodes) -> Iterator[None]:
    """Nodes emitted inside go to ``nodes`` (e.g. a replaced forward node's)."""
    outer, ctx.nodes = ctx.nodes, nodes
    try:
        yield
    finally:
        ctx.nodes = outer


class _Direction:
    """One direction's inputs, time-major and in processing order, its output Y (once known:
    :meth:`set_output`) and its output gradients (once taken: :meth:`take_gradients`)."""

    def __init__(self, ctx: GradientContext, node: onnx.NodeProto, common: "_Common", d: int, reverse: bool):
        self.ctx, self.common, self.reverse = ctx, common, reverse
        self.index = index = ctx.op("Constant", value=onh.from_array(np.asarray(d, np.int64)))
        self.w = ctx.op("Gather", node.input[_W], index)
        self.r = ctx.op("Gather", node.input[_R], index)
        bias = _input(node, _B)
        self.bias = None if bias is None else ctx.op("Gather", bias, index)
        peephole = _input(node, _P) if node.op_type == "LSTM" else None
        self.peephole = None if peephole is None else ctx.op("Gather", peephole, index)
        self.x = self.in_time_order(common.x)
        self.h0 = common.state(_input(node, _INITIAL_H), index)
        self.c0 = common.state(_input(node, _INITIAL_C), index) if node.op_type == "LSTM" else None
        self.y = self._h_prev = self.dy = self.dyh = self.dyc = None

    def set_output(self, y: str) -> None:
        """This direction's Y, [T, B, H] in processing order."""
        self.y = y

    @property
    def h_prev(self) -> str:
        """The hidden states entering each step, [T, B, H] in processing order."""
        if self._h_prev is None:
            previous = self.ctx.op("Slice", self.y, self.ctx.ints([0]), self.ctx.ints([-1]), self.ctx.ints([0]))
            self._h_prev = self.ctx.op("Concat", self.ctx.unsqueeze(self.h0, [0]), previous, axis=0)
        return self._h_prev

    def h_prev_reversed(self) -> str:
        """:attr:`h_prev` last step first (Y's steps T - 2 .. 0, then initial_h): one copy, as :attr:`h_prev` is."""
        ctx = self.ctx
        previous = ctx.op("Slice", self.y, ctx.ints([-2]), ctx.ints([-(2 ** 63)]), ctx.ints([0]), ctx.ints([-1]))
        return ctx.op("Concat", previous, ctx.unsqueeze(self.h0, [0]), axis=0)

    def take_gradients(self, dy: Optional[str], dyh: Optional[str], dyc: Optional[str]) -> None:
        """The gradients of Y, Y_h, Y_c ([T, D, B, H] and [D, B, H]; None: not used) for this direction."""
        ctx = self.ctx
        self.dy = None if dy is None else self.in_time_order(ctx.op("Gather", dy, self.index, axis=1))
        self.dyh = self.common.state(dyh, self.index)
        self.dyc = self.common.state(dyc, self.index)

    def in_time_order(self, sequence: str) -> str:
        """[T, B, ...] in this direction's processing order (and back: it is an involution).
        Without sequence_lens every sequence is reversed whole: a Slice (tract has no ReverseSequence)."""
        if not self.reverse:
            return sequence
        if self.common.sequence_lens is None:
            return _reversed_in_time(self.ctx, sequence)
        return self.ctx.op("ReverseSequence", sequence, self.common.lengths, batch_axis=1, time_axis=0)

    def block(self, value: str, start: int, stop: int, axis: int = -1) -> str:
        hidden = self.common.hidden
        return self.ctx.op("Slice", value, self.ctx.ints([start * hidden]), self.ctx.ints([stop * hidden]), self.ctx.ints([axis]))

    def bias_halves(self) -> Tuple[Optional[str], Optional[str]]:
        if self.bias is None:
            return None, None
        gates = _GATES[self.common.kind]
        return self.block(self.bias, 0, gates, axis=0), self.block(self.bias, gates, 2 * gates, axis=0)

    def masked(self, mask: Optional[str], value: str, otherwise: str) -> str:
        return value if mask is None else self.ctx.op("Where", mask, value, otherwise)

    def weight_gradients(self, d_pre_w: str, d_pre_r: str, r_input: str, reversed_steps: bool = False) -> Dict[str, str]:
        """dX (in time order), dW, dR, dB of the pre-activations' gradients ([T, B, G*H],
        ``d_pre_r`` the part through R, whose input sequence is ``r_input``). With
        ``reversed_steps`` the gradients and ``r_input`` are last step first, as a reverse
        Scan returns them: the sums over all steps pair them with X reversed alike."""
        ctx, gates = self.ctx, _GATES[self.common.kind]
        width = gates * self.common.hidden
        x = _reversed_in_time(ctx, self.x) if reversed_steps else self.x
        dx = None
        if ctx.needs_grad(self.common.node.input[_X]):
            dx = ctx.op("MatMul", d_pre_w, self.w)
            dx = self.in_time_order(_reversed_in_time(ctx, dx) if reversed_steps else dx)
        flat_w = ctx.op("Reshape", d_pre_w, ctx.ints([-1, width]))
        flat_r = flat_w if d_pre_r == d_pre_w else ctx.op("Reshape", d_pre_r, ctx.ints([-1, width]))
        result = {
            "x": dx,
            "w": self.summed_over_steps(flat_w, x, width, (ctx.shape(self.common.x) or [None] * 3)[2]),
            "r": self.summed_over_steps(flat_r, r_input, width, self.common.hidden),
        }
        db_w = ctx.reduce("ReduceSum", flat_w, [0], keepdims=False)
        db_r = db_w if flat_r is flat_w else ctx.reduce("ReduceSum", flat_r, [0], keepdims=False)
        result["b"] = ctx.op("Concat", db_w, db_r, axis=0)
        return result

    def summed_over_steps(self, flat_gradient: str, sequence: str, width: int, features) -> str:
        """flat_gradient [T * B, width]^T times ``sequence`` [T, B, features] flattened alike: a
        weight's gradient summed over every step and sample (:meth:`GradientContext.weight_gradient`;
        ``features`` an int when static)."""
        steps, batch = (self.ctx.shape(self.common.x) or [None, None])[:2]
        static = [d if isinstance(d, int) else None for d in (steps, batch, features)]
        rows = None if None in static[:2] else static[0] * static[1]
        return self.ctx.weight_gradient(flat_gradient, self.flat(sequence), (rows, width, static[2]), self.common.x)

    def flat(self, sequence: str) -> str:
        """[T, B, n] as [T * B, n]."""
        return self.ctx.op("Reshape", sequence, self.ctx.op(
            "Concat", self.ctx.ints([-1]), self.ctx.shape_of(sequence, start=2), axis=0))


class _Common:
    """What every direction shares: time-major X, lengths, mask."""

    def __init__(self, ctx: GradientContext, node: onnx.NodeProto):
        self.ctx, self.node, self.kind = ctx, node, node.op_type
        if attr(node, "layout", 0):
            raise UnsupportedOperatorError(f"{describe(node)}: layout=1 (batch first) should have been rewritten to 0")
        hidden = attr(node, "hidden_size", None)
        if hidden is None:
            r_shape = ctx.shape(node.input[_R])
            hidden = r_shape[-1] if r_shape is not None and isinstance(r_shape[-1], int) else None
        if hidden is None:
            raise UnsupportedOperatorError(f"{describe(node)}: hidden_size is neither given nor static in R's shape")
        self.hidden = int(hidden)
        self.x = node.input[_X]
        self.sequence_lens = _input(node, _SEQUENCE_LENS)
        self.lengths = self.mask = None  # int64 [B] sequence_lens; [T, B, 1] bool: the step is within the sequence
        if self.sequence_lens is not None:
            self.lengths = ctx.op("Cast", self.sequence_lens, to=onnx.TensorProto.INT64)
            steps = ctx.op("Range", self._int(0), self._scalar_dim(self.x, 0), self._int(1))
            within = ctx.op("Less", ctx.unsqueeze(steps, [1]), ctx.unsqueeze(self.lengths, [0]))
            self.mask = ctx.unsqueeze(within, [2])
        self._zeros = None

    def _int(self, value: int) -> str:
        return self.ctx.op("Constant", value=onh.from_array(np.asarray(value, np.int64)))

    def _scalar_dim(self, value: str, axis: int) -> str:
        return self.ctx.op("Reshape", self.ctx.shape_of(value, start=axis, end=axis + 1), self.ctx.ints([]))

    def zeros(self) -> str:
        """[B, H] zeros of X's type."""
        if self._zeros is None:
            shape = self.ctx.op("Concat", self.ctx.shape_of(self.x, start=1, end=2), self.ctx.ints([self.hidden]), axis=0)
            self._zeros = self.ctx.op("Expand", self.ctx.scalar(0.0, self.node.input[_X]), shape)
        return self._zeros

    def state(self, value: Optional[str], index: str) -> str:
        """Direction ``index`` of a [D, B, H] state, or zeros."""
        return self.zeros() if value is None else self.ctx.op("Gather", value, index)


def _feature_major(ctx: GradientContext, value: str, rank: int) -> str:
    """[..., B, n] as [..., n, B] (and back)."""
    return ctx.op("Transpose", value, perm=list(range(rank - 2)) + [rank - 1, rank - 2])


def _lstm_forward(ctx: GradientContext, run: _Direction, activations: Tuple[str, ...]) -> Tuple[str, str, str]:
    """One direction of an LSTM (gates i, o, f, c; peepholes i, o, f) computed as a Scan that
    keeps the activated gates, the cell states and act_h(c) for :func:`_lstm` (in ``run``).
    Returns (Y in processing order, the last h, the last c).

    The Scans of the LSTM run feature-major: states [H, B], step slices [4H, B], so each
    step's GEMM has the weight as its left operand (MLAS packs the right one on every call:
    [B, H] there is 32x less than R)."""
    hidden, like = run.common.hidden, run.common.node.input[_X]
    act_f, act_g, act_h = activations
    w_bias, r_bias = run.bias_halves()
    w, x = run.w, run.x
    if w_bias is not None:  # the bias as one more input column of ones: added inside the product
        w = ctx.op("Concat", w, ctx.unsqueeze(ctx.op("Add", w_bias, r_bias), [1]), axis=1)
        ones = ctx.op("Expand", ctx.scalar(1.0, like), ctx.op("Concat", ctx.shape_of(x, end=2), ctx.ints([1]), axis=0))
        x = ctx.op("Concat", x, ones, axis=2)
    xw = ctx.op("MatMul", w, _feature_major(ctx, x, 3))  # [T, 4H, B]
    peep = None
    if run.peephole is not None:
        peep = [ctx.unsqueeze(run.block(run.peephole, k, k + 1, axis=0), [1]) for k in range(3)]
    mask = None if run.common.mask is None else _feature_major(ctx, run.common.mask, 3)  # [T, 1, B]
    zero = ctx.scalar(0.0, like)

    def step(states, slices):
        (h_prev, c_prev), (xw_t, *mask_t) = states, slices
        pre = ctx.op("Gemm", run.r, h_prev, xw_t)
        p_i, p_o, p_f, p_c = ctx.op("Split", pre, ctx.ints([hidden] * 4), axis=0, outputs=4)
        if peep is not None:
            p_i = ctx.op("Add", p_i, ctx.op("Mul", peep[0], c_prev))
            p_f = ctx.op("Add", p_f, ctx.op("Mul", peep[2], c_prev))
        i, f, g = ctx.op(act_f, p_i), ctx.op(act_f, p_f), ctx.op(act_g, p_c)
        c = ctx.op("Add", ctx.op("Mul", f, c_prev), ctx.op("Mul", i, g))
        o = ctx.op(act_f, p_o if peep is None else ctx.op("Add", p_o, ctx.op("Mul", peep[1], c)))
        act_c = ctx.op(act_h, c)
        h = ctx.op("Mul", o, act_c)
        if not mask_t:
            return [h, c], [h, i, o, f, g, c, act_c]
        within = mask_t[0]  # past the end: the state is kept, Y is 0
        c = ctx.op("Where", within, c, c_prev)
        return [ctx.op("Where", within, h, h_prev), c], [ctx.op("Where", within, h, zero), i, o, f, g, c, act_c]

    c0 = _feature_major(ctx, run.c0, 2)
    sequences = [xw] + ([mask] if mask is not None else [])
    (h_last, c_last), (y, i, o, f, g, cells, act_c) = _scan(ctx, [_feature_major(ctx, run.h0, 2), c0], sequences, step,
                                                            reverse=False, like=like, mask=mask)
    run.kept = dict(i=i, o=o, f=f, g=g, cells=cells, act_c=act_c, peep=peep, c0=c0, mask=mask)
    return _feature_major(ctx, y, 3), _feature_major(ctx, h_last, 2), _feature_major(ctx, c_last, 2)


def _lstm(ctx: GradientContext, run: _Direction, activations: Tuple[str, ...]) -> Dict[str, str]:
    """The backward of one direction of an LSTM from what :func:`_lstm_forward` kept,
    feature-major as it.

    The backward step is d_c = dc + dh a_c, d_pre = [d_c, dh, d_c, d_c] * factors,
    dc_{t-1} = d_c keep, dh_{t-1} = R^T d_pre, with a_c, factors and keep (the peepholes
    folded in) computed for all steps at once before the Scan: for the default activations
    without peepholes or sequence_lens by one LSTMBackwardFactors node, which writes them last
    step first as the reverse Scan reads them, otherwise by standard nodes."""
    like = run.common.node.input[_X]
    peep, mask = run.kept["peep"], run.kept["mask"]
    masks = [mask] if mask is not None else []
    i, o, f, g = (run.kept[gate] for gate in "iofg")
    cells, tanh_c = run.kept["cells"], run.kept["act_c"]
    dy = None if run.dy is None else _feature_major(ctx, run.dy, 3)
    if (peep is None and mask is None and activations == ("Sigmoid", "Tanh", "Tanh") and ctx.opset >= 15
            and ctx.elem_type(like) in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)):
        # one node for the factors, last step first as the reverse Scan reads them
        factors, a_c, keep = ctx.op(lstm_backward_factors.OP_TYPE, i, o, f, g, cells, tanh_c, run.kept["c0"],
                                    domain=DOMAIN, outputs=3)
        return _lstm_backward(ctx, run, dy, a_c, factors, keep, masks, reversed_already=(a_c, factors, keep))[0]
    c_prev_all = ctx.op("Concat", ctx.unsqueeze(run.kept["c0"], [0]),
                        ctx.op("Slice", cells, ctx.ints([0]), ctx.ints([-1]), ctx.ints([0])), axis=0)
    a_i, a_o, a_f, a_g, a_c = lstm_backward_factors.gate_factors(
        ctx.op, i, o, f, g, c_prev_all, tanh_c, *(lambda y, act=act: _derivative(ctx, act, y, like) for act in activations))
    keep = f
    if peep is not None:
        a_c = ctx.op("Add", a_c, ctx.op("Mul", a_o, peep[1]))
        keep = ctx.op("Add", keep, ctx.op("Add", ctx.op("Mul", a_i, peep[0]), ctx.op("Mul", a_f, peep[2])))
    factors = ctx.op("Concat", a_i, a_o, a_f, a_g, axis=1)
    if mask is not None:  # past the end: no gate gradient, the state gradients pass unchanged
        zero = ctx.scalar(0.0, like)
        factors, a_c = ctx.op("Where", mask, factors, zero), ctx.op("Where", mask, a_c, zero)
        keep = ctx.op("Where", mask, keep, ctx.scalar(1.0, like))
        dy = None if dy is None else ctx.op("Where", mask, dy, zero)
    result, d_pre = _lstm_backward(ctx, run, dy, a_c, factors, keep, masks)
    if run.peephole is not None:
        d_pre = _reversed_in_time(ctx, d_pre)
        sums = [ctx.reduce("ReduceSum", ctx.op("Mul", run.block(d_pre, block, block + 1), _feature_major(ctx, state, 3)),
                           [0, 1], keepdims=False)
                for block, state in ((0, c_prev_all), (1, cells), (2, c_prev_all))]
        result["p"] = ctx.op("Concat", *sums, axis=0)
    return result


def _lstm_backward(ctx: GradientContext, run: _Direction, dy: Optional[str], a_c: str, factors: str, keep: str,
                   masks: List[str], reversed_already: Sequence[str] = ()) -> Tuple[Dict[str, str], str]:
    """The reverse Scan of an LSTM backward over the per-step factors ([T, H, B] a_c and keep,
    [T, 4H, B] factors, in time order but those in ``reversed_already``): the gradients it
    gives and ``d_pre`` (last step first) for the peepholes' sums."""
    like = run.common.node.input[_X]
    mask = masks[0] if masks else None
    r_t = ctx.op("Transpose", run.r, perm=[1, 0])

    def backward_step(states, slices):
        (dh, dc), slices = states, list(slices)
        dy_t = slices.pop(0) if dy is not None else None
        a_c_t, factors_t, keep_t, *mask_t = slices
        dh_total = dh if dy_t is None else ctx.op("Add", dh, dy_t)
        d_c = ctx.op("Add", dc, ctx.op("Mul", dh_total, a_c_t))
        d_pre = ctx.op("Mul", ctx.op("Concat", d_c, dh_total, d_c, d_c, axis=0), factors_t)
        dh_prev = run.masked(mask_t[0] if mask_t else None, ctx.op("MatMul", r_t, d_pre), dh)
        return [dh_prev, ctx.op("Mul", d_c, keep_t)], [_feature_major(ctx, d_pre, 2)]  # [B, 4H] for the GEMMs

    sequences = ([dy] if dy is not None else []) + [a_c, factors, keep] + masks
    (dh0, dc0), (d_pre,) = _scan(ctx, [_feature_major(ctx, run.dyh, 2), _feature_major(ctx, run.dyc, 2)], sequences,
                                 backward_step, reverse=True, like=like, mask=mask, outputs_reversed=True,
                                 reversed_already=reversed_already)
    result = run.weight_gradients(d_pre, d_pre, run.h_prev_reversed(), reversed_steps=True)
    result.update(h0=_feature_major(ctx, dh0, 2), c0=_feature_major(ctx, dc0, 2))
    return result, d_pre


def _gru(ctx: GradientContext, run: _Direction, activations: Tuple[str, ...]) -> Dict[str, str]:
    """One direction of a GRU (gates z, r, h).

    Every gate gradient is the step's total state gradient dh times a factor known for all
    steps before the Scan, but (linear_before_reset=0) the reset gate's, which goes through
    R_h inside the step; the Scan returns dh per step (and that one)."""
    like = run.common.node.input[_X]
    act_f, act_g = activations
    before_reset = int(attr(run.common.node, "linear_before_reset", 0))
    w_bias, r_bias = run.bias_halves()
    xw = ctx.op("MatMul", run.x, ctx.op("Transpose", run.w, perm=[1, 0]))
    if w_bias is not None:
        xw = ctx.op("Add", xw, w_bias)
    r_zr, r_h = run.block(run.r, 0, 2, axis=0), run.block(run.r, 2, 3, axis=0)
    h_zr = ctx.op("MatMul", run.h_prev, ctx.op("Transpose", r_zr, perm=[1, 0]))
    if r_bias is not None:
        h_zr = ctx.op("Add", h_zr, run.block(r_bias, 0, 2, axis=0))
    zr = ctx.op(act_f, ctx.op("Add", run.block(xw, 0, 2), h_zr))
    z, r = run.block(zr, 0, 1), run.block(zr, 1, 2)
    reset_h = ctx.op("Mul", r, run.h_prev)
    linear_h = ctx.op("MatMul", run.h_prev if before_reset else reset_h, ctx.op("Transpose", r_h, perm=[1, 0]))
    if r_bias is not None:
        linear_h = ctx.op("Add", linear_h, run.block(r_bias, 2, 3, axis=0))
    candidate = ctx.op(act_g, ctx.op("Add", run.block(xw, 2, 3), ctx.op("Mul", r, linear_h) if before_reset else linear_h))
    a_z = ctx.op("Mul", ctx.op("Sub", run.h_prev, candidate), _derivative(ctx, act_f, z, like))
    a_n = ctx.op("Mul", ctx.op("Sub", ctx.scalar(1.0, like), z), _derivative(ctx, act_g, candidate, like))
    d_r = _derivative(ctx, act_f, r, like)
    if before_reset:
        through_r = ctx.op("Concat", a_z, ctx.op("Mul", ctx.op("Mul", a_n, linear_h), d_r), ctx.op("Mul", a_n, r), axis=-1)
        step_factors = [through_r]
    else:
        step_factors = [a_z, a_n, ctx.op("Mul", run.h_prev, d_r), r]
    mask, dy, carry = run.common.mask, run.dy, z
    if mask is not None:  # past the end: no gate gradient, dh passes unchanged (as through z = 1)
        zero = ctx.scalar(0.0, like)
        step_factors = [ctx.op("Where", mask, value, zero) for value in step_factors]
        carry = ctx.op("Where", mask, z, ctx.scalar(1.0, like))
        dy = None if dy is None else ctx.op("Where", mask, dy, zero)

    def backward_step(states, slices):
        (dh,), slices = states, list(slices)
        dy_t = slices.pop(0) if dy is not None else None
        carry_t, *factors_t = slices
        dh_total = dh if dy_t is None else ctx.op("Add", dh, dy_t)
        dh_prev = ctx.op("Mul", dh_total, carry_t)
        if before_reset:
            d_through_r = ctx.op("Mul", ctx.op("Concat", dh_total, dh_total, dh_total, axis=-1), factors_t[0])
            return [ctx.op("Add", dh_prev, ctx.op("MatMul", d_through_r, run.r))], [dh_total]
        a_z_t, a_n_t, b_r_t, r_t = factors_t
        d_reset_h = ctx.op("MatMul", ctx.op("Mul", dh_total, a_n_t), r_h)
        d_pre_r = ctx.op("Mul", d_reset_h, b_r_t)
        d_zr = ctx.op("Concat", ctx.op("Mul", dh_total, a_z_t), d_pre_r, axis=-1)
        dh_prev = ctx.op("Add", ctx.op("Add", dh_prev, ctx.op("Mul", d_reset_h, r_t)), ctx.op("MatMul", d_zr, r_zr))
        return [dh_prev], [dh_total, d_pre_r]

    sequences = ([dy] if dy is not None else []) + [carry] + step_factors
    (dh0,), step_outputs = _scan(ctx, [run.dyh], sequences, backward_step, reverse=True, like=like, mask=None)
    dh_all = step_outputs[0]
    if before_reset:
        through_r = step_factors[0]
        d_pre_r = ctx.op("Mul", ctx.op("Concat", dh_all, dh_all, dh_all, axis=-1), through_r)
        a_n_masked = a_n if mask is None else ctx.op("Where", mask, a_n, ctx.scalar(0.0, like))
        d_pre = ctx.op("Concat", run.block(d_pre_r, 0, 2), ctx.op("Mul", dh_all, a_n_masked), axis=-1)
        result = run.weight_gradients(d_pre, d_pre_r, run.h_prev)
    else:
        a_z_m, a_n_m = step_factors[0], step_factors[1]
        d_pre = ctx.op("Concat", ctx.op("Mul", dh_all, a_z_m), step_outputs[1], ctx.op("Mul", dh_all, a_n_m), axis=-1)
        result = run.weight_gradients(d_pre, d_pre, run.h_prev)  # dR's z, r rows; the h rows read r * h_prev
        d_r_h = run.summed_over_steps(run.flat(run.block(d_pre, 2, 3)), reset_h, run.common.hidden, run.common.hidden)
        result["r"] = ctx.op("Concat", run.block(result["r"], 0, 2, axis=0), d_r_h, axis=0)
    result["h0"] = dh0
    return result


def _rnn(ctx: GradientContext, run: _Direction, activations: Tuple[str, ...]) -> Dict[str, str]:
    """One direction of a simple RNN: h_t = f(x_t W^T + h_{t-1} R^T + b)."""
    like, (act,) = run.common.node.input[_X], activations
    mask, dy = run.common.mask, run.dy
    slope = _derivative(ctx, act, run.y, like)
    if mask is not None:
        zero = ctx.scalar(0.0, like)
        slope = ctx.op("Where", mask, slope, zero)
        dy = None if dy is None else ctx.op("Where", mask, dy, zero)

    def backward_step(states, slices):
        (dh,), slices = states, list(slices)
        dy_t = slices.pop(0) if dy is not None else None
        slope_t, *mask_t = slices
        dh_total = dh if dy_t is None else ctx.op("Add", dh, dy_t)
        d_pre = ctx.op("Mul", dh_total, slope_t)
        return [run.masked(mask_t[0] if mask_t else None, ctx.op("MatMul", d_pre, run.r), dh)], [d_pre]

    sequences = ([dy] if dy is not None else []) + [slope] + ([mask] if mask is not None else [])
    (dh0,), (d_pre,) = _scan(ctx, [run.dyh], sequences, backward_step, reverse=True, like=like, mask=mask)
    result = run.weight_gradients(d_pre, d_pre, run.h_prev)
    result["h0"] = dh0
    return result


_DIRECTION_GRADIENT = {"LSTM": _lstm, "GRU": _gru, "RNN": _rnn}


@register("LSTM", "GRU", "RNN", inputs=lambda ctx, node: _INPUTS[node.op_type])
def recurrent_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """Gradients of X, W, R, B, initial_h (and LSTM's initial_c, P); see the module docstring."""
    direction = attr(node, "direction", "forward")
    if direction not in ("forward", "reverse", "bidirectional"):
        raise UnsupportedOperatorError(f"{describe(node)}: unknown direction '{direction}'")
    directions = 2 if direction == "bidirectional" else 1
    activations = _activations(node, directions)
    own_forward = node.op_type == "LSTM"
    forward_nodes: List[onnx.NodeProto] = []
    with _emitting_into(ctx, forward_nodes if own_forward else ctx.nodes):
        common = _Common(ctx, node)
        runs = [_Direction(ctx, node, common, d, reverse=direction == "reverse" or d == 1) for d in range(directions)]
        if own_forward:
            _replace_lstm_forward(ctx, node, runs, activations)
        else:
            y = ctx.ensure_output(node, 0, "Y")
            for run in runs:
                run.set_output(run.in_time_order(ctx.op("Gather", y, run.index, axis=1)))
    if own_forward:
        ctx.replace_forward(node, forward_nodes)
    grads = list(grads) + [None] * (3 - len(grads))
    per_direction = []
    for d, run in enumerate(runs):
        run.take_gradients(*grads[:3])
        per_direction.append(_DIRECTION_GRADIENT[node.op_type](ctx, run, activations[d]))

    def stacked(key: str) -> str:
        return ctx.op("Concat", *[ctx.unsqueeze(g[key], [0]) for g in per_direction], axis=0)

    result: List[Optional[str]] = [None] * len(node.input)
    if ctx.needs_grad(node.input[_X]):
        result[_X] = ctx.sum_all([g["x"] for g in per_direction])
    result[_W], result[_R] = stacked("w"), stacked("r")
    for index, key in ((_B, "b"), (_INITIAL_H, "h0"), (_INITIAL_C, "c0"), (_P, "p")):
        if _input(node, index) is not None and index in _INPUTS[node.op_type] and ctx.needs_grad(node.input[index]):
            result[index] = stacked(key)
    return result


def _replace_lstm_forward(ctx: GradientContext, node: onnx.NodeProto, runs: List[_Direction],
                          activations: List[Tuple[str, ...]]) -> None:
    """Emits every direction's :func:`_lstm_forward` and the node's outputs Y [T, D, B, H],
    Y_h and Y_c [D, B, H] under their names."""
    ys, last_h, last_c = [], [], []
    for run, acts in zip(runs, activations):
        y, h, c = _lstm_forward(ctx, run, acts)
        run.set_output(y)
        ys.append(ctx.unsqueeze(run.in_time_order(y), [1]))
        last_h.append(ctx.unsqueeze(h, [0]))
        last_c.append(ctx.unsqueeze(c, [0]))
    outputs = list(node.output) + [""] * (3 - len(node.output))
    for name, parts, axis in zip(outputs, (ys, last_h, last_c), (1, 0, 0)):
        if name:
            ctx.op("Concat", *parts, axis=axis, outputs=[name]) if len(parts) > 1 else ctx.op("Identity", parts[0], outputs=[name])
