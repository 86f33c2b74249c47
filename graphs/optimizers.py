"""Optimizer graphs: one torch.optim step as an ONNX model that takes gradients as inputs.

:func:`build_optimizer_graph` builds the update alone, so a gradient graph can be composed
with it directly, through an accumulation of micro-batch gradients, or through an
all-reduce. Inputs: for each parameter ``P``: ``P`` and ``P_grad``; then the optimizer state
(``P.momentum_buffer`` for SGD with momentum; ``P.exp_avg``, ``P.exp_avg_sq`` and with
amsgrad ``P.max_exp_avg_sq`` for Adam/AdamW); then ``lr`` and ``step`` (float32 scalars,
``step`` 1-based as torch's ``state["step"]`` after its increment). Outputs: ``NAME.next``
for every parameter and state input. Semantics are torch's single-tensor implementations of
``torch.optim.SGD``/``Adam``/``AdamW`` and ``torch.nn.utils.clip_grad_norm_``. Initial state
is zeros (SGD's first step takes the gradient as its momentum buffer, as torch does).
"""

from __future__ import annotations

import base64
import copy
import fnmatch
import json
from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import normgrad
from normgrad._external_data import check_model
from normgrad.graphs import rewrites
from normgrad.graphs.portable import make_portable
from normgrad.graphs.tidy import tidy
from normgrad.graphs.structure import subgraph_captures
from normgrad.ops._common import DOMAIN, IR_VERSION

if TYPE_CHECKING:
    from normgrad.graphs.builder import AnyTrainingGraph

__all__ = [
    "build_optimizer_graph",
    "build_step_graph",
    "optimizer_state_names",
    "next_name",
    "optimizer_options",
    "running_statistics",
    "build_gradient_graph",
    "build_inference_model",
    "build_eval_graph",
    "decayed_parameters",
    "expose_forward_outputs",
    "forward_outputs",
    "ACCUMULATOR_SUFFIX",
    "WEIGHT_DECAY_METADATA",
    "check_hyperparameters",
    "hyperparameter_defaults",
    "HYPERPARAMETER_INPUTS",
    "hyperparameter_feeds",
    "hyperparameter_values",
]

HYPERPARAMETER_INPUTS = ("lr", "weight_decay", "beta1", "beta2", "eps", "momentum", "dampening", "max_grad_norm")
"""Every hyperparameter a step or optimizer graph can take as a scalar input (of that name;
:func:`hyperparameter_defaults` says which one graph takes)."""

ACCUMULATOR_SUFFIX = "_grad.sum"
"""``P_grad.sum``: the gradient accumulator input of :func:`build_gradient_graph` for parameter ``P``."""

_KINDS = ("sgd", "adam", "adamw")
_TORCH_NAMES = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}
_OPTIONS = {"sgd": ("momentum", "dampening", "nesterov"), "adam": ("betas", "eps", "amsgrad"),
            "adamw": ("betas", "eps", "amsgrad")}
_COMMON_OPTIONS = ("weight_decay", "clip_grad_norm")


def check_hyperparameters(kind: str, *, command_line: bool = False, **options) -> None:
    """The one check of optimizer hyperparameters (``build_optimizer_graph``, ``build_step_graph``,
    ``normgrad export``; the AdamUpdate kernels check the attributes they become): refuses
    what torch.optim refuses, and NaN or infinite values, which torch lets through to NaN
    weights in a few places (SGD's lr, momentum and weight_decay, any dampening).

    ``options``: the options given (``lr`` among them, when known); an option of another
    optimizer raises TypeError, as torch's constructors do. ``command_line``: messages name
    the options as flags (``--weight-decay``).

    Raises:
        ValueError: an unknown ``kind``, or a value naming the option and the rule it breaks.
        TypeError: an option ``kind`` does not have.
    """
    if kind not in _KINDS:
        raise ValueError(f"optimizer kind {kind!r} is not one of {', '.join(_KINDS)}")
    torch_name = f"torch.optim.{_TORCH_NAMES[kind]}"
    label = (lambda name: "--" + name.replace("_", "-")) if command_line else (lambda name: f"{kind} {name}")  # noqa: E731
    for name in options:
        if name != "lr" and name not in _OPTIONS[kind] + _COMMON_OPTIONS:
            owners = [k for k in _KINDS if name in _OPTIONS[k]]
            where = f"an option of {' and '.join(owners)}" if owners else "not an optimizer option"
            raise TypeError(f"{kind} has no option {name!r} ({where}; {torch_name} refuses it too)")

    def number(name, low_inclusive=None, below=None, above=None):
        value = options[name]
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{label(name)} must be a number; got {options[name]!r}") from None
        rules = ["finite"]
        ok = np.isfinite(value)
        if low_inclusive is not None:
            ok = ok and value >= low_inclusive
            rules.append(f">= {low_inclusive:g}")
        if above is not None:
            ok = ok and value > above
            rules.append(f"> {above:g}")
        if below is not None:
            ok = ok and value < below
            rules.append(f"< {below:g}")
        if not ok:
            raise ValueError(f"{label(name)} must be {' and '.join(rules)}; got {options[name]!r}")

    for name in ("lr", "momentum", "weight_decay", "eps"):
        if options.get(name) is not None:
            number(name, low_inclusive=0.0)
    if options.get("dampening") is not None:
        number("dampening")
    if options.get("clip_grad_norm") is not None:
        number("clip_grad_norm", above=0.0)
    if "betas" in options:
        betas = options["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"{label('betas')} must be two numbers in [0, 1); got {betas!r}")
        for index, beta in enumerate(betas):
            if not (isinstance(beta, (int, float, np.floating, np.integer)) and 0.0 <= beta < 1.0):
                raise ValueError(f"{label('betas')}[{index}] must be in [0, 1); got {beta!r}")
    for name in ("nesterov", "amsgrad"):
        if name in options and not isinstance(options[name], (bool, np.bool_)):
            raise ValueError(f"{label(name)} must be True or False; got {options[name]!r}")
    if options.get("nesterov") and (float(options.get("momentum", 0.0)) <= 0 or float(options.get("dampening", 0.0)) != 0):
        raise ValueError(f"nesterov needs momentum > 0 and dampening 0 (as {torch_name}); got momentum "
                         f"{options.get('momentum', 0.0)!r}, dampening {options.get('dampening', 0.0)!r}")

WEIGHT_DECAY_METADATA = "normgrad.weight_decay"
"""Step/optimizer graph metadata key: JSON {parameter: its weight decay} (0 for the
parameters ``no_weight_decay`` matched), as torch's param_groups would hold them."""


def decayed_parameters(parameters: Sequence[str], no_weight_decay: Sequence[str]) -> Dict[str, bool]:
    """{parameter: whether weight decay applies to it}: every parameter except those a
    ``no_weight_decay`` pattern (``fnmatch``, case-sensitive, e.g. ``"*.bias"``) matches.

    Raises:
        ValueError: a pattern that matches no parameter (a typo would otherwise decay everything silently).
    """
    for pattern in no_weight_decay:
        if not any(fnmatch.fnmatchcase(p, pattern) for p in parameters):
            shown = ", ".join(list(parameters)[:8]) + (", ..." if len(parameters) > 8 else "")
            raise ValueError(f"no_weight_decay pattern {pattern!r} matches no trainable parameter ({shown})")
    return {p: not any(fnmatch.fnmatchcase(p, pattern) for pattern in no_weight_decay) for p in parameters}


def next_name(name: str) -> str:
    """The output that holds ``name``'s value after the step."""
    return f"{name}.next"


def optimizer_state_names(parameter: str, kind: str, momentum: float = 0.0, amsgrad: bool = False) -> List[str]:
    """The optimizer-state inputs kept for ``parameter``."""
    if kind == "sgd":
        return [f"{parameter}.momentum_buffer"] if momentum != 0 else []
    names = [f"{parameter}.exp_avg", f"{parameter}.exp_avg_sq"]
    return names + [f"{parameter}.max_exp_avg_sq"] if amsgrad else names


class _Nodes:
    def __init__(self) -> None:
        self.nodes: List[onnx.NodeProto] = []
        self.initializers: List[onnx.TensorProto] = []
        self._count = 0

    def const(self, value: float, dtype=np.float32) -> str:
        self._count += 1
        name = f"optimizer.const{self._count}"
        self.initializers.append(numpy_helper.from_array(np.array(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, *inputs: str, output: Optional[str] = None, **attributes) -> str:
        self._count += 1
        output = output or f"optimizer.t{self._count}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [output], **attributes))
        return output


def hyperparameter_defaults(kind: str, *, lr: float = 1e-3, weight_decay: float = 0.0, momentum: float = 0.0,
                            dampening: float = 0.0, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                            clip_grad_norm: Optional[float] = None) -> Dict[str, float]:
    """{input name: default} of the hyperparameter inputs of a ``kind`` optimizer graph built
    with these options, in the order of its inputs."""
    hyper = {"lr": lr, "weight_decay": weight_decay}
    if kind == "sgd" and momentum != 0:
        hyper.update(momentum=momentum, dampening=dampening)
    elif kind != "sgd":
        hyper.update(beta1=betas[0], beta2=betas[1], eps=eps)
    if clip_grad_norm is not None:
        hyper["max_grad_norm"] = clip_grad_norm
    return {name: float(value) for name, value in hyper.items()}


def hyperparameter_values(model: onnx.ModelProto) -> Dict[str, float]:
    """{input: export value} of every hyperparameter input of a step or optimizer graph (from
    its ``normgrad.optimizer`` metadata; lr 1e-3 for a graph written before lr had a default)."""
    kind, options = optimizer_options(model)
    exported = hyperparameter_defaults(kind, **{k: v for k, v in options.items() if k in (
        "lr", "weight_decay", "momentum", "dampening", "betas", "eps", "clip_grad_norm")})
    inputs = {i.name for i in model.graph.input}
    return {name: value for name, value in exported.items() if name in inputs}


def hyperparameter_feeds(model: onnx.ModelProto) -> Dict[str, np.ndarray]:
    """{input: scalar array} of :func:`hyperparameter_values`, each in the dtype its input
    declares (float64 but lr by default, float32 in the portable form): the feeds a session
    of the graph takes besides the batch, the state and ``step``."""
    inputs = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    return {name: np.array(value, helper.tensor_dtype_to_np_dtype(inputs[name]))
            for name, value in hyperparameter_values(model).items()}


_OPTION_DEFAULTS = dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8,
                        amsgrad=False, clip_grad_norm=None)


def _differs(value, default) -> bool:
    if isinstance(default, tuple):
        return not (isinstance(value, (tuple, list)) and tuple(value) == default)
    return value is not default and value != default


def build_optimizer_graph(
    parameters: Mapping[str, Sequence[int]],
    kind: str,
    *,
    lr: float = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    betas: Tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    amsgrad: bool = False,
    clip_grad_norm: Optional[float] = None,
    no_weight_decay: Sequence[str] = (),
) -> onnx.ModelProto:
    """An ONNX model doing one optimizer step on float32 ``parameters`` ({name: shape}).

    The hyperparameters are scalar inputs of the graph (:func:`hyperparameter_defaults`: lr
    float32, the others float64), whose defaults are the values given here, recorded in the
    ``normgrad.optimizer`` metadata (:func:`hyperparameter_feeds`; no initializer: tract and
    the portable graphs take no input that is also an initializer);
    which of them the graph takes is decided here: momentum and dampening only with a momentum
    buffer (``momentum`` != 0), max_grad_norm only with ``clip_grad_norm``.

    ``no_weight_decay``: fnmatch patterns of parameters that get no weight decay (e.g.
    ``["*.bias", "*norm*"]``), as a torch param_group with ``weight_decay=0`` beside one with
    the others (:func:`decayed_parameters`).

    Raises:
        ValueError: an unknown ``kind``, a hyperparameter torch would refuse
            (:func:`check_hyperparameters`), or a ``no_weight_decay`` pattern that matches
            no parameter.
        TypeError: an option of another optimizer given a value other than its default
            (``betas`` for sgd, ``momentum`` for adam...), as torch refuses it.
    """
    given = dict(lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=weight_decay, betas=betas,
                 eps=eps, amsgrad=amsgrad, clip_grad_norm=clip_grad_norm)
    check_hyperparameters(kind, **{name: value for name, value in given.items()
                                   if kind not in _KINDS or name in _OPTIONS[kind] + _COMMON_OPTIONS + ("lr",)
                                   or _differs(value, _OPTION_DEFAULTS[name])})
    if not parameters:
        raise ValueError("build_optimizer_graph needs at least one parameter")
    no_weight_decay = [no_weight_decay] if isinstance(no_weight_decay, str) else list(no_weight_decay)
    decayed_map = decayed_parameters(list(parameters), no_weight_decay)
    decays = {p: weight_decay if decayed else 0.0 for p, decayed in decayed_map.items()}

    g = _Nodes()
    value_info = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))
    inputs = [value_info(p, s) for p, s in parameters.items()]
    inputs += [value_info(f"{p}_grad", s) for p, s in parameters.items()]
    state: Dict[str, str] = {}
    for p, s in parameters.items():
        for name in optimizer_state_names(p, kind, momentum, amsgrad):
            inputs.append(value_info(name, s))
    hyper = hyperparameter_defaults(kind, lr=lr, weight_decay=weight_decay, momentum=momentum, dampening=dampening,
                                    betas=betas, eps=eps, clip_grad_norm=clip_grad_norm)
    inputs += [value_info("lr", []), value_info("step", [])]
    inputs += [helper.make_tensor_value_info(name, TensorProto.DOUBLE, []) for name in hyper if name != "lr"]
    # the hyperparameters are float64 inputs, as torch's Python floats; each is rounded to
    # float32 where the arithmetic is float32, as torch does (1 - beta1 in float64 first)
    as_float = lambda name: g.op("Cast", name, to=TensorProto.FLOAT)  # noqa: E731
    one_minus = lambda name: as_float(g.op("Sub", g.const(1.0, np.float64), name))  # noqa: E731
    decay = as_float("weight_decay")

    grads = {p: f"{p}_grad" for p in parameters}
    # every update is one AdamUpdate or SGDUpdate node, which scales the gradient, adds the L2
    # weight decay and (in the trainer) takes the step's gate itself
    grad_scale = ""
    if clip_grad_norm is not None:
        squares = [g.op("ReduceSumSquare", grads[p], keepdims=0) for p in parameters]
        total = g.op("Sqrt", g.op("Sum", *squares))
        coefficient = g.op("Div", as_float("max_grad_norm"), g.op("Add", total, g.const(1e-6)))
        grad_scale = g.op("Min", coefficient, g.const(1.0))
    param_scale = g.op("Sub", g.const(1.0), g.op("Mul", "lr", decay)) if kind == "adamw" else ""

    if kind != "sgd":
        # bias corrections in float64, as torch computes them (Python floats): in float32,
        # 1 - 0.999**step loses about 5 digits to cancellation in the first steps
        step64 = g.op("Cast", "step", to=TensorProto.DOUBLE)
        one = g.const(1.0, np.float64)
        correction1 = g.op("Sub", one, g.op("Pow", "beta1", step64))
        correction2 = g.op("Sub", one, g.op("Pow", "beta2", step64))
        step_size = g.op("Cast", g.op("Div", g.op("Cast", "lr", to=TensorProto.DOUBLE), correction1), to=TensorProto.FLOAT)
        correction2_sqrt = g.op("Cast", g.op("Sqrt", correction2), to=TensorProto.FLOAT)
        moments = [one_minus("beta1"), as_float("beta2"), one_minus("beta2"), as_float("eps")]
    elif momentum != 0:
        sgd_momentum = [as_float("momentum"), one_minus("dampening"), "", "", g.op("Equal", "step", g.const(1.0)),
                        g.const(True, np.bool_) if nesterov else ""]  # weight_decay and grad_scale per parameter

    def update(op_type, inputs, outputs):
        inputs = list(inputs)
        while not inputs[-1]:
            inputs.pop()
        g.nodes.append(helper.make_node(op_type, inputs, outputs, domain=DOMAIN))

    outputs = []
    for p, s in parameters.items():
        grad, decayed = grads[p], decayed_map[p]
        if kind == "sgd":
            if momentum != 0:
                buffer = f"{p}.momentum_buffer"
                scalars = sgd_momentum[:2] + [decay if decayed else "", grad_scale] + sgd_momentum[4:]
                update("SGDUpdate", [p, grad, "lr", buffer, *scalars], [next_name(p), next_name(buffer)])
                state[buffer] = next_name(buffer)
            else:
                update("SGDUpdate", [p, grad, "lr", "", "", "", decay if decayed else "", grad_scale], [next_name(p)])
        else:
            exp_avg, exp_avg_sq = f"{p}.exp_avg", f"{p}.exp_avg_sq"
            moment_names = [exp_avg, exp_avg_sq] + ([f"{p}.max_exp_avg_sq"] if amsgrad else [])
            update("AdamUpdate", [p, grad, exp_avg, exp_avg_sq, step_size, correction2_sqrt, *moments,
                                  param_scale if decayed else "", grad_scale, decay if decayed and kind == "adam" else "",
                                  "", *moment_names[2:]],
                   [next_name(name) for name in [p] + moment_names])
            state.update({name: next_name(name) for name in moment_names})
        outputs.append(value_info(next_name(p), s))
    outputs += [value_info(next_name(name), parameters[name.rsplit(".", 1)[0]]) for name in state]

    graph = helper.make_graph(g.nodes, f"{kind}_step", inputs, outputs, initializer=g.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = IR_VERSION
    model = normgrad.add_functions(model)
    hyperparameters = {"kind": kind, "lr": lr, "clip_grad_norm": clip_grad_norm, "weight_decay": weight_decay}
    if no_weight_decay:
        hyperparameters["no_weight_decay"] = no_weight_decay
    if kind == "sgd":
        hyperparameters.update(momentum=momentum, dampening=dampening, nesterov=nesterov)
    else:
        hyperparameters.update(betas=list(betas), eps=eps, amsgrad=amsgrad)
    helper.set_model_props(model, {
        "normgrad.state": json.dumps({**{p: next_name(p) for p in parameters}, **state}),
        "normgrad.parameters": json.dumps(list(parameters)),
        "normgrad.optimizer": json.dumps(hyperparameters),
        WEIGHT_DECAY_METADATA: json.dumps(decays),
    })
    check_model(model)
    return model


def _live_nodes(nodes: Sequence[onnx.NodeProto], outputs: Sequence[str]) -> List[onnx.NodeProto]:
    """The nodes some output depends on (the gradients of data inputs are not step outputs)."""
    needed, live = set(outputs), []
    for node in reversed(nodes):
        if any(name in needed for name in node.output):
            live.append(node)
            needed.update(node.input)
            needed.update(subgraph_captures(node))
    return live[::-1]


METADATA_FORWARD_TAIL = "normgrad.forward_tail"
"""Step graph metadata: the forward nodes computing the loss's model output that the step
does not run (a bias Add the loss node absorbed, ``normgrad.graphs.losses.bias_add_before``,
and its Reshapes), with the initializers only they read: a JSON string of a base64 GraphProto, which
:func:`forward_outputs`, :func:`expose_forward_outputs`, :func:`build_eval_graph` and
:func:`build_inference_model` put back."""


def _forward_tail(training: onnx.GraphProto, live: Sequence[onnx.NodeProto], loss_output: str,
                  state: set) -> Optional[str]:
    """:data:`METADATA_FORWARD_TAIL` of a step graph of ``live`` nodes, or None when they
    compute the loss's model output themselves."""
    running = {id(node) for node in live}
    tail = [n for n in _live_nodes(list(training.node), [loss_output]) if id(n) not in running]
    if not tail:
        return None
    read_by_step = _read_values(live)
    read = _read_values(tail)
    initializers = [t for t in training.initializer if t.name in read and t.name not in read_by_step
                    and t.name not in state]
    graph = helper.make_graph(tail, "forward_tail", [], [onnx.ValueInfoProto(name=loss_output)], initializers)
    return json.dumps(base64.b64encode(graph.SerializeToString()).decode("ascii"))


def _tail(model: onnx.ModelProto) -> onnx.GraphProto:
    """The :data:`METADATA_FORWARD_TAIL` graph of ``model`` (empty without one)."""
    encoded = next((p.value for p in model.metadata_props if p.key == METADATA_FORWARD_TAIL), None)
    if encoded is None:
        return onnx.GraphProto()
    try:
        return onnx.GraphProto.FromString(base64.b64decode(json.loads(encoded), validate=True))
    except Exception:  # not JSON, not base64 or not a GraphProto
        raise ValueError(f"corrupt step graph: metadata {METADATA_FORWARD_TAIL} is not a base64 GraphProto") from None


def _with_tail(model: onnx.ModelProto, names: Sequence[str]) -> Tuple[List[onnx.NodeProto], List[onnx.TensorProto]]:
    """The forward-tail nodes (and initializers) that compute those of ``names`` the nodes
    of ``model`` do not."""
    produced = {o for node in model.graph.node for o in node.output}
    missing = [n for n in names if n not in produced]
    tail = _tail(model) if missing else onnx.GraphProto()
    nodes = _live_nodes(list(tail.node), missing)
    read = _read_values(nodes)
    return nodes, [t for t in tail.initializer if t.name in read]


def _read_values(nodes: Sequence[onnx.NodeProto]) -> set:
    return {name for node in nodes for name in list(node.input) + subgraph_captures(node)}


def _metadata(model: onnx.ModelProto) -> Dict[str, object]:
    return {entry.key: json.loads(entry.value) for entry in model.metadata_props if entry.key.startswith("normgrad.")}


def _sub_model(step: onnx.ModelProto, name: str, nodes: List[onnx.NodeProto], inputs: List[onnx.ValueInfoProto],
               outputs: List[onnx.ValueInfoProto], properties: Mapping[str, str],
               initializers: Sequence[onnx.TensorProto] = (), check: bool = True) -> onnx.ModelProto:
    """A model of ``nodes`` cut out of ``step``, with the initializers they read (plus
    ``initializers``) and the function bodies and opsets of the domains they use."""
    read = _read_values(nodes)
    stored = list(step.graph.initializer) + list(_tail(step).initializer)
    graph = helper.make_graph(nodes, name, inputs, outputs,
                              initializer=[t for t in stored if t.name in read] + list(initializers),
                              value_info=[v for v in step.graph.value_info if v.name in read])
    domains = {node.domain for node in nodes} | {""}
    opsets = [o for o in step.opset_import if o.domain in domains or (o.domain == "ai.onnx" and "" in domains)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="normgrad")
    model.functions.extend(f for f in step.functions if f.domain in domains)
    model.ir_version = IR_VERSION
    helper.set_model_props(model, dict(properties))
    if check:
        check_model(model)
    return model


def build_gradient_graph(step: onnx.ModelProto) -> onnx.ModelProto:
    """The gradient half of a step graph, accumulating: (data inputs, parameters, running
    statistics, ``P_grad.sum`` per parameter, ``grad_scale``) -> (``loss``, ``NAME.next`` per
    running statistic, ``P_grad.sum.next`` = ``P_grad.sum`` + ``P_grad`` * ``grad_scale``).

    Run once per micro-batch with ``grad_scale`` = 1/k and the sums starting at zero, it
    gives the mean gradient of k micro-batches (torch's ``(loss / k).backward()`` k times)
    for the optimizer graph (:func:`build_optimizer_graph` with :func:`optimizer_options`),
    with room for an all-reduce between the two.
    """
    meta = _metadata(step)
    parameters = meta["normgrad.parameters"]
    statistics = meta.get("normgrad.running_statistics", [])
    types = {i.name: i for i in step.graph.input}
    grad_outputs = [f"{p}_grad" for p in parameters]
    outputs = ["loss"] + [next_name(s) for s in statistics]
    nodes = [copy.deepcopy(n) for n in _live_nodes(step.graph.node, outputs + grad_outputs)]
    micro_batch = [n for n in nodes if n.op_type == "Constant" and list(n.output) == [rewrites.DROPOUT_MICRO_BATCH_INPUT]]
    for constant in micro_batch:  # seeded Dropout: the micro-batch index becomes an input
        nodes.remove(constant)
    accumulated = []
    for p in parameters:
        total = p + ACCUMULATOR_SUFFIX
        scaled = helper.make_node("Mul", [f"{p}_grad", "grad_scale"], [f"{total}.scaled"])
        nodes += [scaled, helper.make_node("Add", [total, scaled.output[0]], [next_name(total)])]
        accumulated.append(total)
    read = _read_values(nodes)
    inputs = [i for i in step.graph.input if i.name in read and i.name != "lr"]  # step: read by seeded Dropout
    inputs.append(helper.make_tensor_value_info("grad_scale", TensorProto.FLOAT, []))
    inputs += [helper.make_tensor_value_info(rewrites.DROPOUT_MICRO_BATCH_INPUT, TensorProto.INT64, []) for _ in micro_batch]
    inputs += [helper.make_tensor_value_info(a, TensorProto.FLOAT, _dims(types[p])) for a, p in zip(accumulated, parameters)]
    loss = [o for o in step.graph.output if o.name == "loss"]
    state_outputs = [o for o in step.graph.output if o.name in {next_name(s) for s in statistics}]
    outputs_info = loss + state_outputs + [helper.make_tensor_value_info(next_name(a), TensorProto.FLOAT, _dims(types[p]))
                                           for a, p in zip(accumulated, parameters)]
    state = {**{s: next_name(s) for s in statistics}, **{a: next_name(a) for a in accumulated}}
    tail = {p.key: p.value for p in step.metadata_props if p.key == METADATA_FORWARD_TAIL}
    return _sub_model(step, f"{step.graph.name}_gradients", nodes, inputs, outputs_info,
                      {"normgrad.state": json.dumps(state), "normgrad.parameters": json.dumps(parameters), **tail})


def _dims(info: onnx.ValueInfoProto) -> List[int]:
    return [d.dim_value for d in info.type.tensor_type.shape.dim]


def build_inference_model(step: onnx.ModelProto, tensors: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """The forward model inside a step graph, for inference: the nodes computing its forward
    outputs (those the step graph still computes; for a model computing its own loss
    (``loss_output``), its other outputs when it has any), with every training-mode
    BatchNormalization normalizing with its running statistics instead of the batch's,
    Dropout as Identity, and every state tensor it reads (``tensors``: trained weights,
    running statistics) as an initializer.

    Raises:
        ValueError: ``step`` is not a step graph, or ``tensors`` lacks a state tensor the forward reads.
    """
    meta = _step_metadata(step)
    loss_output = meta["normgrad.loss"]["output"]
    outputs = forward_outputs(step)
    if meta["normgrad.loss"]["kind"] == "output" and len(outputs) > 1:
        outputs.remove(loss_output)  # a model computing its own loss: serve its other outputs
    nodes = _live_nodes(_eval_mode_nodes(step), outputs)
    read = _read_values(nodes)
    state = set(meta["normgrad.state"])
    missing = sorted(n for n in state if n in read and n not in tensors)
    if missing:
        raise ValueError(f"no value for state tensor {missing[0]!r}, which the forward model reads")
    inputs = [i for i in step.graph.input if i.name in read and i.name not in state]
    trained = [numpy_helper.from_array(np.asarray(tensors[n]), n) for n in sorted(state & read)]
    model = _sub_model(step, step.graph.name.split("_training")[0] or "model", nodes, inputs,
                       [onnx.ValueInfoProto(name=o) for o in outputs], {}, trained, check=False)
    _infer_output_types(model)
    check_model(model)
    return model


def _step_metadata(step: onnx.ModelProto) -> Dict[str, object]:
    meta = _metadata(step)
    if "normgrad.loss" not in meta or not meta["normgrad.loss"]:
        raise ValueError("not a step graph written by normgrad: no normgrad.loss metadata")
    return meta


def forward_outputs(step: onnx.ModelProto) -> List[str]:
    """The forward model's outputs that a step graph still computes (those its loss needs;
    for a model computing its own loss (``loss_output``), that output among them)."""
    meta = _step_metadata(step)
    produced = {o for node in list(step.graph.node) + list(_tail(step).node) for o in node.output}
    return [o for o in meta.get("normgrad.forward_outputs", [meta["normgrad.loss"]["output"]]) if o in produced]


def _eval_mode_nodes(step: onnx.ModelProto) -> List[onnx.NodeProto]:
    """The step graph's nodes (and its forward tail's, :data:`METADATA_FORWARD_TAIL`) with
    every training-mode BatchNormalization normalizing with its running statistics instead
    of the batch's, and Dropout as Identity (torch's eval mode)."""
    meta = _metadata(step)
    running = {layer["output"]: layer for layer in meta.get("normgrad.batch_norm", [])}
    dropout_inputs = meta.get(rewrites.METADATA_DROPOUT, {}).get("outputs", {})  # seeded Dropout: {output: input}
    nodes = []
    for node in list(step.graph.node) + list(_tail(step).node):
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx") and node.output[0] in running:
            # the layer normalizes with its batch statistics in training: the running ones now
            node = copy.deepcopy(node)
            node.input[3], node.input[4] = running[node.output[0]]["running_mean"], running[node.output[0]]["running_var"]
        elif node.op_type == "Dropout" and node.domain in ("", "ai.onnx"):
            node = helper.make_node("Identity", node.input[:1], node.output[:1], name=node.name)
        elif node.output and node.output[0] in dropout_inputs:
            node = helper.make_node("Identity", [dropout_inputs[node.output[0]]], node.output[:1], name=node.name)
        nodes.append(node)
    return nodes


def _infer_output_types(model: onnx.ModelProto) -> None:
    """Fills in the types of ``model``'s graph outputs that have none, by shape inference."""
    untyped = [o for o in model.graph.output if not o.HasField("type")]
    if not untyped:
        return
    inferred_graph = onnx.shape_inference.infer_shapes(model).graph
    inferred = {o.name: o for o in list(inferred_graph.value_info) + list(inferred_graph.output) if o.HasField("type")}
    for output in untyped:
        if output.name in inferred:
            output.CopyFrom(inferred[output.name])


def expose_forward_outputs(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """A copy of ``model`` (a step, gradient or eval graph) with the values ``names`` (computed
    by its nodes or its forward tail's, e.g. :func:`forward_outputs`) as graph outputs too,
    after its own outputs, for an onnxruntime session (``model`` itself when they all are
    outputs already).

    Raises:
        ValueError: a name no node of the graph computes.
    """
    tail_nodes, tail_initializers = _with_tail(model, names)
    produced = {o for node in list(model.graph.node) + tail_nodes for o in node.output}
    present = {o.name for o in model.graph.output}
    for name in names:
        if name not in produced:
            raise ValueError(f"{name!r} is not computed by the graph {model.graph.name!r}")
    added = [n for n in dict.fromkeys(names) if n not in present]
    if not added:
        return model
    exposed = copy.deepcopy(model)
    exposed.graph.node.extend(tail_nodes)  # (they read forward values and state the step reads before its update)
    exposed.graph.initializer.extend(tail_initializers)
    # typed where the graph records the type; onnxruntime (1.19.2 and newer) infers the
    # others when it loads the model
    known = {v.name: v for v in model.graph.value_info}
    exposed.graph.output.extend(copy.deepcopy(known[n]) if n in known else onnx.ValueInfoProto(name=n) for n in added)
    return exposed


def _rank_local_loss(step: onnx.ModelProto) -> Optional[str]:
    """In a ``--data-parallel`` step graph, the value this rank's loss has before it joins the
    gradients' bucketed all-reduce (``loss`` = Reshape(Split(Div(AllReduce(Concat(...,
    Reshape(local), ...)), ranks))[k]), :func:`normgrad.graphs.data_parallel.average_over_ranks`);
    None in a graph without that all-reduce."""
    producer = {name: node for node in step.graph.node for name in node.output}
    node = producer.get("loss")
    while node is not None and node.op_type == "Identity":
        node = producer.get(node.input[0])
    chain = [node]
    for op_type in ("Split", "Div", "AllReduce", "Concat"):
        node = producer.get(chain[-1].input[0]) if chain[-1] is not None else None
        chain.append(node if node is not None and node.op_type == op_type else None)
    reshape, split, _, all_reduce, concat = chain
    if reshape is None or reshape.op_type != "Reshape" or concat is None or all_reduce.domain != DOMAIN:
        return None
    flat = producer.get(concat.input[list(split.output).index(reshape.input[0])])
    return flat.input[0] if flat is not None and flat.op_type == "Reshape" else None


def build_eval_graph(step: onnx.ModelProto) -> onnx.ModelProto:
    """The evaluation graph of a step graph: (data inputs, the state tensors the forward reads:
    trained weights, running statistics) -> (``loss``, the :func:`forward_outputs`), in
    torch's eval mode (BatchNormalization on its running statistics, Dropout off; the nodes
    of :func:`build_inference_model`) and without an update. ``normgrad export --optimizer``
    writes it beside the step graph (``NAME.eval.onnx``); :meth:`normgrad.train.Trainer.evaluate`
    runs it with the trainer's current state. Of a ``--data-parallel`` step graph, ``loss`` is
    this rank's (no collective: a rank can evaluate alone).

    Raises:
        ValueError: ``step`` is not a step graph.
    """
    meta = _step_metadata(step)
    outputs = ["loss"] + [o for o in forward_outputs(step) if o != "loss"]
    nodes = _eval_mode_nodes(step)
    local = _rank_local_loss(step)
    if local is not None:  # this rank's loss, not the mean over the ranks in the gradient all-reduce
        nodes = [n for n in nodes if "loss" not in n.output] + [helper.make_node("Identity", [local], ["loss"])]
    nodes = _live_nodes(nodes, outputs)
    read = _read_values(nodes)
    inputs = [i for i in step.graph.input if i.name in read]
    state = [i.name for i in inputs if i.name in meta["normgrad.state"]]
    properties = {key: json.dumps(meta[key]) for key in ("normgrad.loss", "normgrad.data_inputs") if key in meta}
    properties["normgrad.eval_state"] = json.dumps(state)
    model = _sub_model(step, f"{step.graph.name}_eval", nodes, inputs,
                       [onnx.ValueInfoProto(name=o) for o in outputs], properties, check=False)
    _infer_output_types(model)
    tidy(model)
    check_model(model)
    return model


def running_statistics(training: onnx.ModelProto) -> Dict[str, str]:
    """{running statistic: the value holding its train-mode update} for every training-mode
    BatchNormalization of a training graph whose running_mean/running_var are initializers
    (``normgrad.batch_norm`` metadata, written by ``build_training_graph``)."""
    initializers = {t.name for t in training.graph.initializer}
    updated: Dict[str, str] = {}
    for layer in _metadata(training).get("normgrad.batch_norm", []):
        for stat in ("running_mean", "running_var"):
            if layer[stat] in initializers:
                if layer[stat] in updated:
                    raise ValueError(f"running statistic {layer[stat]!r} belongs to two training-mode BatchNormalization "
                                     "nodes; a step graph cannot update it twice")
                updated[layer[stat]] = layer[f"{stat}_next"]
    return updated


def optimizer_options(model: onnx.ModelProto) -> Tuple[str, Dict[str, object]]:
    """The optimizer kind and :func:`build_optimizer_graph` keyword arguments recorded in the
    ``normgrad.optimizer`` metadata of a step or optimizer graph."""
    metadata = {entry.key: entry.value for entry in model.metadata_props}
    if "normgrad.optimizer" not in metadata:
        raise ValueError("the model has no normgrad.optimizer metadata: not a step graph written by normgrad")
    options = json.loads(metadata["normgrad.optimizer"])
    kind = options.pop("kind")
    if not isinstance(options.get("lr", 0.0), (int, float)):  # "input": written before lr had a default
        options.pop("lr")
    if "betas" in options:
        options["betas"] = tuple(options["betas"])
    return kind, options


def _refuse_clashing_names(names: set, trainable: List[str], kind: str, options: Mapping[str, object]) -> None:
    """ValueError naming a value of the training graph that has a name the optimizer step
    gives a state tensor or its next value (e.g. a weight ``W.exp_avg`` beside a weight ``W``)."""
    for weight in trainable:
        state = [weight] + optimizer_state_names(weight, kind, options.get("momentum", 0.0), options.get("amsgrad", False))
        for name in state[1:] + [next_name(n) for n in state]:
            if name in names:
                raise ValueError(f"the training graph has a value named {name!r}, the name the {kind} step gives a "
                                 f"state tensor of weight {weight!r} or its next value: rename it in the forward model")


def build_step_graph(
    training: "AnyTrainingGraph", kind: str, portable: bool = False, *, dropout_seed: int = 0, **options
) -> Tuple[onnx.ModelProto, Dict[str, np.ndarray]]:
    """Composes a training graph that has a loss (``build_training_graph(model, loss=...)``,
    whose weights' values it takes) with :func:`build_optimizer_graph` into one step graph: (data inputs, state, ``lr``,
    ``step``) -> (``loss``, ``NAME.next`` per state input). Trainable weights become pure
    inputs (no initializer); so do the running statistics of every training-mode
    BatchNormalization (initializers read as inputs 3 and 4), whose ``NAME.next`` outputs are
    torch's train-mode update (:func:`running_statistics`). The returned dict holds every
    state input's initial value, for :func:`normgrad.checkpoint.save`. ``portable``: rewrite
    the step graph so that every execution provider runs it correctly
    (:func:`normgrad.graphs.portable.make_portable`).

    With training-mode Dropout, the step graph takes one more input, ``dropout_seed`` (int64
    scalar), and draws each mask from it, ``step`` and the micro-batch index
    (:func:`normgrad.graphs.rewrites.seed_dropout`); ``dropout_seed`` is recorded in the
    ``normgrad.dropout`` metadata as the seed :class:`normgrad.train.Trainer` feeds by default.

    Raises:
        ValueError: a training graph without a loss, a non-float32 trainable weight, a
            graph that already has a value named ``lr``, ``step`` or ``dropout_seed``, or a
            ``dropout_seed`` outside int64.
    """
    from normgrad.graphs.builder import training_graph_parts

    from_model_alone = isinstance(training, onnx.ModelProto)
    training, weights = training_graph_parts(training)
    metadata = {entry.key: entry.value for entry in training.metadata_props}
    if json.loads(metadata.get("normgrad.loss", "null")) is None:
        raise ValueError("a step graph needs a training graph built with a loss")
    graph = training.graph
    initializers = {t.name: t for t in graph.initializer}
    input_names = {i.name for i in graph.input}
    trainable = [name for name in json.loads(metadata["normgrad.gradients"]).values() if name in weights]
    for name in trainable:
        if weights[name].dtype != np.float32:
            raise ValueError(f"trainable weight {name!r} is not float32; step graphs are float32")
    names = input_names | {o for n in graph.node for o in n.output} | set(initializers)
    for reserved in ("lr", "step", *hyperparameter_defaults(kind, momentum=options.get("momentum", 0.0),
                                                           clip_grad_norm=options.get("clip_grad_norm"))):
        if reserved in names:
            raise ValueError(f"the training graph already has a value named {reserved!r}")
    if not trainable and from_model_alone:
        raise ValueError("the training graph model carries no trainable weight's value: pass the TrainingGraph that "
                         "build_training_graph returns, not its .model (a model alone has values only of weights it "
                         "stores as initializers), or every weight is frozen or none reaches the loss")
    if not trainable:
        raise ValueError("the training graph has no trainable weight (every initializer frozen, or none reaches the "
                         "loss): a step graph needs at least one")
    _refuse_clashing_names(names, trainable, kind, options)
    optimizer = build_optimizer_graph({n: list(weights[n].shape) for n in trainable}, kind, **options)
    statistics = running_statistics(training)
    nodes = list(graph.node) + [helper.make_node("Identity", [updated], [next_name(stat)])
                                for stat, updated in statistics.items()]
    present = {i.name for i in graph.input}
    produced = {o for n in graph.node for o in n.output}
    inputs = [i for i in graph.input if i.name not in statistics]
    inputs += [i for i in optimizer.graph.input if i.name not in present and i.name not in produced]
    inputs += [helper.make_tensor_value_info(s, initializers[s].data_type, list(initializers[s].dims)) for s in statistics]
    loss = [o for o in graph.output if o.name == "loss"]
    outputs = loss + list(optimizer.graph.output)
    outputs += [helper.make_tensor_value_info(next_name(s), initializers[s].data_type, list(initializers[s].dims))
                for s in statistics]
    state_inputs = set(trainable) | set(statistics)
    live = _live_nodes(nodes + list(optimizer.graph.node), [o.name for o in outputs])
    tail = _forward_tail(graph, live, json.loads(metadata["normgrad.loss"])["output"], state_inputs)
    step = helper.make_graph(
        live,
        f"{graph.name}_{kind}_step",
        inputs,
        outputs,
        initializer=[t for t in graph.initializer if t.name not in state_inputs] + list(optimizer.graph.initializer),
        value_info=list(graph.value_info),
    )
    dropout_outputs = rewrites.seed_dropout(step, "step", dropout_seed)
    model = helper.make_model(step, opset_imports=list(training.opset_import), producer_name="normgrad")
    model.functions.extend(training.functions)
    model.ir_version = IR_VERSION
    model = normgrad.add_functions(model)  # the optimizer's AdamUpdate body and opset, if the training graph had none
    if metadata.get("normgrad.inline") == "true":  # standard domains only, as the training graph
        from normgrad.graphs.inline import inline_normgrad

        model = inline_normgrad(model)
    step_metadata = {entry.key: entry.value for entry in optimizer.metadata_props}
    state_map = json.loads(step_metadata["normgrad.state"])
    state_map.update({s: next_name(s) for s in statistics})
    step_metadata["normgrad.state"] = json.dumps(state_map)
    step_metadata["normgrad.running_statistics"] = json.dumps(list(statistics))
    if tail is not None:
        step_metadata[METADATA_FORWARD_TAIL] = tail
    if dropout_outputs:
        step_metadata[rewrites.METADATA_DROPOUT] = json.dumps({"seed": int(dropout_seed), "outputs": dropout_outputs})
    data_inputs = [i.name for i in graph.input if i.name not in state_inputs]
    gradients = json.loads(metadata["normgrad.gradients"])
    step_metadata["normgrad.forward_outputs"] = json.dumps(
        [o.name for o in graph.output if o.name != "loss" and o.name not in gradients])
    helper.set_model_props(model, {**metadata, **step_metadata, "normgrad.data_inputs": json.dumps(data_inputs)})
    tidy(model)
    check_model(model)
    initial = {n: np.array(weights[n], copy=True) for n in trainable}
    for n in trainable:
        for name in optimizer_state_names(n, kind, options.get("momentum", 0.0), options.get("amsgrad", False)):
            initial[name] = np.zeros(initial[n].shape, np.float32)
    initial.update({s: numpy_helper.to_array(initializers[s]).copy() for s in statistics})
    if portable:
        model, _ = make_portable(model)
    return model, initial
