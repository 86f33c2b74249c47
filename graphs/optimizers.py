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

The step, gradient, evaluation and inference graphs that compose a training graph with it
are assembled in :mod:`normgrad.graphs.step_graph`.
"""

from __future__ import annotations

import copy
import fnmatch
import json
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from normgrad.ops import api
from normgrad.util.external_data import check_model
from normgrad.ops._common import DOMAIN, IR_VERSION

__all__ = [
    "build_optimizer_graph",
    "clipping_without_if",
    "optimizer_state_names",
    "next_name",
    "optimizer_options",
    "decayed_parameters",
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
    if kind not in KINDS:
        raise ValueError(f"optimizer kind {kind!r} is not one of {', '.join(KINDS)}")
    torch_name = f"torch.optim.{KINDS[kind].torch_name}"
    label = (lambda name: "--" + name.replace("_", "-")) if command_line else (lambda name: f"{kind} {name}")  # noqa: E731
    for name in options:
        if name != "lr" and name not in KINDS[kind].options + COMMON_OPTIONS:
            owners = [k for k in KINDS if name in KINDS[k].options]
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
    if options.get("max_grad_norm") is not None and not _is_infinity(options["max_grad_norm"]):
        number("max_grad_norm", above=0.0)  # or +inf: no clipping, as clip_grad_norm_(max_norm=inf)
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


def _is_infinity(value) -> bool:
    try:
        return float(value) == np.inf
    except (TypeError, ValueError):
        return False


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
    return [f"{parameter}.{suffix}" for suffix in KINDS[kind].state_suffixes(momentum, amsgrad)]


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

    # the hyperparameters are float64 inputs, as torch's Python floats; each is rounded to
    # float32 where the arithmetic is float32, as torch does (1 - beta1 in float64 first)
    def as_float(self, name: str) -> str:
        return self.op("Cast", name, to=TensorProto.FLOAT)

    def one_minus(self, name: str) -> str:
        return self.as_float(self.op("Sub", self.const(1.0, np.float64), name))

    def update(self, op_type: str, inputs: Sequence[str], outputs: Sequence[str]) -> None:
        """A normgrad update node (its trailing omitted inputs dropped)."""
        inputs = list(inputs)
        while not inputs[-1]:
            inputs.pop()
        self.nodes.append(helper.make_node(op_type, inputs, list(outputs), domain=DOMAIN))


class OptimizerKind:
    """One torch.optim optimizer as a step (:data:`KINDS`): its options, its state tensors and
    hyperparameter inputs, and the normgrad update node it writes per parameter (every update
    is one SGDUpdate or AdamUpdate node, which scales the gradient, adds the weight decay and,
    in the trainer, takes the step's gate itself).

    Attributes:
        torch_name: the torch.optim class.
        options: its own keyword options, besides ``lr``, :data:`COMMON_OPTIONS`.
        weight_decay: its default weight decay (torch's).
    """

    torch_name: str
    options: Tuple[str, ...]
    weight_decay: float = 0.0

    def state_suffixes(self, momentum: float, amsgrad: bool) -> List[str]:
        """The state tensors kept per parameter ``P``, as ``P.SUFFIX``."""
        raise NotImplementedError

    def hyperparameters(self, momentum: float, dampening: float, betas: Tuple[float, float],
                        eps: float) -> Dict[str, float]:
        """{input name: value} of its hyperparameter inputs besides lr, weight_decay and max_grad_norm."""
        raise NotImplementedError

    def shared_scalars(self, g: _Nodes, decay: str, momentum: float, nesterov: bool) -> List[str]:
        """Writes the scalars every parameter's update reads; returns them."""
        raise NotImplementedError

    def update(self, g: _Nodes, parameter: str, shared: List[str], decay: str, grad_scale: str, momentum: float,
               amsgrad: bool) -> List[str]:
        """Writes ``parameter``'s update node (``decay``: the weight decay scalar, "" for a
        parameter without); returns the parameter's state tensors."""
        raise NotImplementedError


class _SGD(OptimizerKind):
    torch_name = "SGD"
    options = ("momentum", "dampening", "nesterov")

    def state_suffixes(self, momentum, amsgrad):
        return ["momentum_buffer"] if momentum != 0 else []

    def hyperparameters(self, momentum, dampening, betas, eps):
        return dict(momentum=momentum, dampening=dampening) if momentum != 0 else {}

    def shared_scalars(self, g, decay, momentum, nesterov):
        if momentum == 0:
            return []
        return [g.as_float("momentum"), g.one_minus("dampening"), "", "", g.op("Equal", "step", g.const(1.0)),
                g.const(True, np.bool_) if nesterov else ""]  # weight_decay and grad_scale per parameter

    def update(self, g, parameter, shared, decay, grad_scale, momentum, amsgrad):
        grad = f"{parameter}_grad"
        if momentum == 0:
            g.update("SGDUpdate", [parameter, grad, "lr", "", "", "", decay, grad_scale], [next_name(parameter)])
            return []
        buffer = f"{parameter}.momentum_buffer"
        scalars = shared[:2] + [decay, grad_scale] + shared[4:]
        g.update("SGDUpdate", [parameter, grad, "lr", buffer, *scalars], [next_name(parameter), next_name(buffer)])
        return [buffer]


class _Adam(OptimizerKind):
    options = ("betas", "eps", "amsgrad")

    def __init__(self, torch_name: str, decoupled_weight_decay: bool) -> None:
        self.torch_name, self.decoupled_weight_decay = torch_name, decoupled_weight_decay
        self.weight_decay = 0.01 if decoupled_weight_decay else 0.0

    def state_suffixes(self, momentum, amsgrad):
        return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])

    def hyperparameters(self, momentum, dampening, betas, eps):
        return dict(beta1=betas[0], beta2=betas[1], eps=eps)

    def shared_scalars(self, g, decay, momentum, nesterov):
        param_scale = g.op("Sub", g.const(1.0), g.op("Mul", "lr", decay)) if self.decoupled_weight_decay else ""
        # bias corrections in float64, as torch computes them (Python floats): in float32,
        # 1 - 0.999**step loses about 5 digits to cancellation in the first steps
        step64 = g.op("Cast", "step", to=TensorProto.DOUBLE)
        one = g.const(1.0, np.float64)
        correction1 = g.op("Sub", one, g.op("Pow", "beta1", step64))
        correction2 = g.op("Sub", one, g.op("Pow", "beta2", step64))
        step_size = g.op("Cast", g.op("Div", g.op("Cast", "lr", to=TensorProto.DOUBLE), correction1), to=TensorProto.FLOAT)
        correction2_sqrt = g.op("Cast", g.op("Sqrt", correction2), to=TensorProto.FLOAT)
        return [param_scale, step_size, correction2_sqrt, g.one_minus("beta1"), g.as_float("beta2"),
                g.one_minus("beta2"), g.as_float("eps")]

    def update(self, g, parameter, shared, decay, grad_scale, momentum, amsgrad):
        param_scale, moments = shared[0], shared[1:]
        names = [f"{parameter}.{suffix}" for suffix in self.state_suffixes(momentum, amsgrad)]
        decoupled = self.decoupled_weight_decay
        g.update("AdamUpdate", [parameter, f"{parameter}_grad", *names[:2], *moments,
                                param_scale if decay else "", grad_scale, "" if decoupled else decay, "", *names[2:]],
                 [next_name(name) for name in [parameter] + names])
        return names


KINDS: Dict[str, OptimizerKind] = {"sgd": _SGD(), "adam": _Adam("Adam", False), "adamw": _Adam("AdamW", True)}
"""The optimizer kinds a step graph can take, by name."""

COMMON_OPTIONS = ("weight_decay", "max_grad_norm")
"""The options every kind takes besides ``lr``."""


def hyperparameter_defaults(kind: str, *, lr: float = 1e-3, weight_decay: Optional[float] = None, momentum: float = 0.0,
                            dampening: float = 0.0, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                            max_grad_norm: Optional[float] = None) -> Dict[str, float]:
    """{input name: default} of the hyperparameter inputs of a ``kind`` optimizer graph built
    with these options (``weight_decay`` None: the kind's default), in the order of its inputs."""
    weight_decay = KINDS[kind].weight_decay if weight_decay is None else weight_decay
    hyper = {"lr": lr, "weight_decay": weight_decay, **KINDS[kind].hyperparameters(momentum, dampening, betas, eps)}
    hyper["max_grad_norm"] = np.inf if max_grad_norm is None else max_grad_norm
    return {name: float(value) for name, value in hyper.items()}


def hyperparameter_values(model: onnx.ModelProto) -> Dict[str, float]:
    """{input: export value} of every hyperparameter input of a step or optimizer graph (from
    its ``normgrad.optimizer`` metadata; lr 1e-3 for a graph written before lr had a default)."""
    kind, options = optimizer_options(model)
    exported = hyperparameter_defaults(kind, **{k: v for k, v in options.items() if k in (
        "lr", "weight_decay", "momentum", "dampening", "betas", "eps", "max_grad_norm")})
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
                        amsgrad=False, max_grad_norm=None)


def _differs(value, default) -> bool:
    if isinstance(default, tuple):
        return not (isinstance(value, (tuple, list)) and tuple(value) == default)
    return value is not default and value != default


def _clipping_scale(g: _Nodes, parameters: Mapping[str, Sequence[int]]) -> str:
    """Writes the gradients' scale: torch's clip_grad_norm_ coefficient, min(max_grad_norm /
    (norm + 1e-6), 1) of their global L2 norm, or 1 when ``max_grad_norm`` is +inf (no
    clipping: what the coefficient is then, without the pass over every gradient that the
    norm costs, about 3% of a ResNet-18 step); returns it. An If node: only the branch taken
    runs.

    The norm is summed in 1-element tensors (keepdims=1), squeezed to a scalar only at the
    end: onnxruntime-openvino leaves a reduction to a scalar and a Sum of scalars on the CPU
    provider, and its partitioning then merges a gradient node left alone between two of them
    into a later OpenVINO subgraph that reads its output through them ("the graph is not
    acyclic")."""
    outer, g.nodes = g.nodes, []
    squares = [g.op("ReduceSumSquare", f"{p}_grad", keepdims=1) for p in parameters]
    total = g.op("Sqrt", g.op("Sum", *squares))
    coefficient = g.op("Div", g.as_float("max_grad_norm"), g.op("Add", total, g.const(1e-6)))
    clipped = g.op("Squeeze", g.op("Min", coefficient, g.const(1.0)))
    unscaled = g.op("Identity", g.const(1.0))
    clipping, keeping = g.nodes[:-1], g.nodes[-1:]
    g.nodes = outer
    scalar = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [])  # noqa: E731
    return g.op("If", g.op("IsInf", "max_grad_norm", detect_negative=0),
                then_branch=helper.make_graph(keeping, _CLIPPING_BRANCHES[0], [], [scalar(unscaled)]),
                else_branch=helper.make_graph(clipping, _CLIPPING_BRANCHES[1], [], [scalar(clipped)]))


_CLIPPING_BRANCHES = ("no_clipping", "clip_grad_norm")


def clipping_without_if(model: onnx.ModelProto) -> int:
    """Writes, in place, the If of :func:`_clipping_scale` (main graph) as its clipping branch,
    for runtimes that run an If only on a constant condition (tract): the same values (the
    coefficient is exactly 1 at +inf), the pass over the gradients at every step. The
    ``--inline`` and ``--portable`` forms, for runtimes other than onnxruntime, are written so.
    Returns how many."""
    graph = model.graph
    nodes, lowered = [], 0
    for node in graph.node:
        branches = {a.name: a.g.name for a in node.attribute if a.type == onnx.AttributeProto.GRAPH}
        if node.op_type != "If" or (branches.get("then_branch"), branches.get("else_branch")) != _CLIPPING_BRANCHES:
            nodes.append(node)
            continue
        clipping = next(a.g for a in node.attribute if a.name == "else_branch")
        clipped = [copy.deepcopy(n) for n in clipping.node]
        clipped[-1].output[0] = node.output[0]
        nodes.extend(clipped)
        lowered += 1
    if lowered:
        read = {name for node in nodes for name in node.input}
        del graph.node[:]
        graph.node.extend(n for n in nodes if not (n.op_type == "IsInf" and n.output[0] not in read))
    return lowered


def build_optimizer_graph(
    parameters: Mapping[str, Sequence[int]],
    kind: str,
    *,
    lr: float = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: Optional[float] = None,
    betas: Tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    amsgrad: bool = False,
    max_grad_norm: Optional[float] = None,
    no_weight_decay: Sequence[str] = (),
) -> onnx.ModelProto:
    """An ONNX model doing one optimizer step on float32 ``parameters`` ({name: shape}).

    The hyperparameters are scalar inputs of the graph (:func:`hyperparameter_defaults`: lr
    float32, the others float64), whose defaults are the values given here, recorded in the
    ``normgrad.optimizer`` metadata (:func:`hyperparameter_feeds`; no initializer: tract and
    the portable graphs take no input that is also an initializer);
    which of them the graph takes is decided here: momentum and dampening only with a momentum
    buffer (``momentum`` != 0); max_grad_norm always, +inf (no clipping) unless
    ``max_grad_norm`` is given, so that clipping can be turned on at run time. ``weight_decay``:
    None is the kind's default (torch's: 0.01 for AdamW, 0 for the others).

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
    if weight_decay is None and kind in KINDS:
        weight_decay = KINDS[kind].weight_decay
    given = dict(lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=weight_decay, betas=betas,
                 eps=eps, amsgrad=amsgrad, max_grad_norm=max_grad_norm)
    check_hyperparameters(kind, **{name: value for name, value in given.items()
                                   if kind not in KINDS or name in KINDS[kind].options + COMMON_OPTIONS + ("lr",)
                                   or _differs(value, _OPTION_DEFAULTS[name])})
    if not parameters:
        raise ValueError("build_optimizer_graph needs at least one parameter")
    optimizer = KINDS[kind]
    no_weight_decay = [no_weight_decay] if isinstance(no_weight_decay, str) else list(no_weight_decay)
    decayed_map = decayed_parameters(list(parameters), no_weight_decay)
    decays = {p: weight_decay if decayed else 0.0 for p, decayed in decayed_map.items()}

    g = _Nodes()
    value_info = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))  # noqa: E731
    inputs = [value_info(p, s) for p, s in parameters.items()]
    inputs += [value_info(f"{p}_grad", s) for p, s in parameters.items()]
    for p, s in parameters.items():
        inputs += [value_info(name, s) for name in optimizer_state_names(p, kind, momentum, amsgrad)]
    hyper = hyperparameter_defaults(kind, lr=lr, weight_decay=weight_decay, momentum=momentum, dampening=dampening,
                                    betas=betas, eps=eps, max_grad_norm=max_grad_norm)
    inputs += [value_info("lr", []), value_info("step", [])]
    inputs += [helper.make_tensor_value_info(name, TensorProto.DOUBLE, []) for name in hyper if name != "lr"]
    decay = g.as_float("weight_decay")
    grad_scale = _clipping_scale(g, parameters)
    shared = optimizer.shared_scalars(g, decay, momentum, nesterov)
    state: Dict[str, str] = {}
    outputs = []
    for p, s in parameters.items():
        names = optimizer.update(g, p, shared, decay if decayed_map[p] else "", grad_scale, momentum, amsgrad)
        state.update({name: next_name(name) for name in names})
        outputs.append(value_info(next_name(p), s))
    outputs += [value_info(next_name(name), parameters[name.rsplit(".", 1)[0]]) for name in state]

    graph = helper.make_graph(g.nodes, f"{kind}_step", inputs, outputs, initializer=g.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = IR_VERSION
    model = api.add_functions(model)
    hyperparameters = {"kind": kind, "lr": lr, "max_grad_norm": max_grad_norm, "weight_decay": weight_decay}
    if no_weight_decay:
        hyperparameters["no_weight_decay"] = no_weight_decay
    hyperparameters.update({name: list(given[name]) if name == "betas" else given[name] for name in optimizer.options})
    helper.set_model_props(model, {
        "normgrad.state": json.dumps({**{p: next_name(p) for p in parameters}, **state}),
        "normgrad.parameters": json.dumps(list(parameters)),
        "normgrad.optimizer": json.dumps(hyperparameters),
        WEIGHT_DECAY_METADATA: json.dumps(decays),
    })
    check_model(model)
    return model


def optimizer_options(model: onnx.ModelProto) -> Tuple[str, Dict[str, object]]:
    """The optimizer kind and :func:`build_optimizer_graph` keyword arguments recorded in the
    ``normgrad.optimizer`` metadata of a step or optimizer graph."""
    metadata = {entry.key: entry.value for entry in model.metadata_props}
    if "normgrad.optimizer" not in metadata:
        raise ValueError("the model has no normgrad.optimizer metadata: not a step graph written by normgrad")
    options = json.loads(metadata["normgrad.optimizer"])
    kind = options.pop("kind")
    if "clip_grad_norm" in options:  # the name graphs written before max_grad_norm recorded
        options["max_grad_norm"] = options.pop("clip_grad_norm")
    if not isinstance(options.get("lr", 0.0), (int, float)):  # "input": written before lr had a default
        options.pop("lr")
    if "betas" in options:
        options["betas"] = tuple(options["betas"])
    return kind, options
