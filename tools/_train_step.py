"""``normgrad train STEP.onnx --data ...``: one's own step graph trained on arrays with
:func:`normgrad.loop.fit` (the options, the data checks, the run)."""

from __future__ import annotations

import argparse
import ast
import os
import sys
import tokenize
import zipfile
import zlib
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np

import normgrad.loop as loop
from normgrad.util.files import beside_step_graph, eval_graph_path, owned_data_files
from normgrad._session import TrainerError
from normgrad.errors import LoraError
from normgrad.tools.cli import CommandError, one_line, positive_int

DEFAULT_BATCH_SIZE = 32

METRICS = ("accuracy", "perplexity", "top5", "f1_macro", "f1_micro")
_STEP_ONLY = {"--data": None, "--eval": None, "--checkpoint": None, "--checkpoint-dir": None, "--resume": False,
              "--scheduler": None, "--metrics": None, "--patience": None, "--weight-decay": None, "--betas": None,
              "--eps": None, "--momentum": None, "--dampening": None, "--max-grad-norm": None, "--accumulation": None,
              "--evaluate-every": None}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every default shown, except None and those the help text states itself."""

    def _get_help_string(self, action):
        if action.default is None or "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _add_step_arguments(parser: argparse.ArgumentParser) -> None:
    step = parser.add_argument_group("with a STEP graph")
    step.add_argument("--data", nargs="+", metavar="FILE", help="training arrays: a .npz, or .npy files named as the "
                      "inputs (NAME.npy or NAME=FILE.npy)")
    step.add_argument("--eval", nargs="+", metavar="FILE", help="validation arrays, as --data")
    step.add_argument("--checkpoint", help="the initial state (default: STEP with .ckpt for .onnx)")
    step.add_argument("--checkpoint-dir", help="checkpoints, and the folder --resume continues from (default: OUT/checkpoints)")
    step.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    step.add_argument("--keep-last", type=positive_int, default=2, help="checkpoints kept besides the best")
    step.add_argument("--checkpoint-every", type=positive_int, default=None, help="also checkpoint every N steps")
    step.add_argument("--evaluate-every", type=positive_int, default=None,
                      help="also evaluate (and checkpoint) every N steps, besides each epoch's end")
    step.add_argument("--accumulation", type=positive_int, default=None, metavar="N",
                      help="gradient accumulation: each batch split into N equal micro-batches whose gradients are "
                      "averaged into one optimizer step (default: 1)")
    for flag, what in (("--weight-decay", "weight decay"), ("--eps", "Adam's eps"), ("--momentum", "SGD momentum"),
                       ("--dampening", "SGD dampening"), ("--max-grad-norm", "gradient clipping norm")):
        step.add_argument(flag, type=float, default=None, help=f"{what} (default: the step graph's)")
    step.add_argument("--betas", type=float, nargs=2, default=None, metavar=("BETA1", "BETA2"),
                      help="Adam's betas (default: the step graph's)")
    step.add_argument("--scheduler", metavar="'NAME(ARG=VALUE, ...)'", help="a torch scheduler of normgrad.schedules, "
                      "e.g. 'StepLR(step_size=5, gamma=0.5)', 'OneCycleLR(max_lr=0.01, total_steps=500)', "
                      "'ReduceLROnPlateau(patience=2)'")
    step.add_argument("--scheduler-interval", choices=["step", "epoch"], default="epoch",
                      help="when the scheduler steps (OneCycleLR: step)")
    step.add_argument("--metrics", nargs="+", choices=METRICS, metavar="METRIC",
                      help=f"validation metrics of the loss's output: {', '.join(METRICS)} (the F1 scores: "
                      "scikit-learn's f1_score averages)")
    step.add_argument("--monitor", default=None, help="the value that picks the best checkpoint and early stopping "
                      "(default: val_loss with --eval, else train_loss)")
    step.add_argument("--mode", choices=["min", "max"], default="min", help="whether lower or higher --monitor is better")
    step.add_argument("--patience", type=positive_int, default=None, help="stop after N evaluations without improvement")
    step.add_argument("--min-delta", type=float, default=0.0, help="the improvement --patience counts")
    step.add_argument("--no-progress", action="store_true", help="no progress bar")


def load_arrays(paths: Sequence[str], option: str) -> Dict[str, np.ndarray]:
    """``{name: array}`` from .npz files and NAME.npy / NAME=FILE.npy files.

    Raises:
        CommandError: a file that cannot be read or is neither, a name given twice."""
    arrays: Dict[str, np.ndarray] = {}
    for spec in paths:
        name, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        try:
            if path.endswith(".npz"):
                if name:
                    raise CommandError(f"{option} {spec}: a .npz names its arrays itself (give just the path)")
                with np.load(path, allow_pickle=False) as archive:
                    loaded = {key: archive[key] for key in archive.files}
            elif path.endswith(".npy"):
                loaded = {name or os.path.basename(path)[:-4]: np.load(path, allow_pickle=False)}
            else:
                raise CommandError(f"{option} {spec}: not a .npz or .npy file")
        except OSError as error:
            raise CommandError(f"{option}: cannot read {path}: {error.strerror or error}") from None
        except (ValueError, EOFError, SyntaxError, MemoryError, NotImplementedError, tokenize.TokenError,
                zipfile.BadZipFile, zlib.error) as error:  # the ways np.load meets a truncated or corrupted file
            raise CommandError(f"{option}: {path} is not a readable NumPy {path[-4:]} file (truncated or corrupted?): "
                               f"{one_line(error)}") from None
        for key, value in loaded.items():
            if key in arrays:
                raise CommandError(f"{option}: array {key!r} given twice")
            arrays[key] = value
    return arrays


def check_arrays(arrays: Mapping[str, np.ndarray], trainer, option: str) -> Dict[str, np.ndarray]:
    """The arrays as the step graph takes them: refuses, naming the array, a missing or
    unknown name, a sample shape other than the graph's, unequal lengths, or a dtype that
    cannot be cast without changing a value (:func:`cast_losslessly`); casts the others (e.g.
    float64 features, int32 labels) and says so in one line."""
    from normgrad._session import _np_dtype

    missing = [name for name in trainer.data_inputs if name not in arrays]
    unknown = sorted(set(arrays) - set(trainer.data_inputs))
    expected = ", ".join(trainer.data_inputs)
    if missing:
        raise CommandError(f"{option}: no array {missing[0]!r}; the step graph's data inputs are {expected}")
    if unknown:
        raise CommandError(f"{option}: array {unknown[0]!r} is not a data input of the step graph ({expected})")
    inputs = {i.name: i for i in trainer.step_model.graph.input}
    lengths, conformed, casts = {}, {}, []
    for name in trainer.data_inputs:
        value, dtype = arrays[name], _np_dtype(inputs[name])
        dims = [d.dim_value if d.HasField("dim_value") else None for d in inputs[name].type.tensor_type.shape.dim]
        if value.ndim != len(dims) or any(d is not None and d != v for d, v in zip(dims[1:], value.shape[1:])):
            wanted = ["N"] + [d if d is not None else "any" for d in dims[1:]]
            raise CommandError(f"{option}: array {name!r} has shape {list(value.shape)}; the step graph takes {wanted} "
                               "(N samples along axis 0)")
        conformed[name] = cast_losslessly(value, dtype, f"{option}: array {name!r}")
        if value.dtype != dtype:
            casts.append(f"{name} {value.dtype} -> {dtype}")
        lengths[name] = len(value)
    if len(set(lengths.values())) > 1:
        raise CommandError(f"{option}: the arrays differ in length along axis 0: "
                           + ", ".join(f"{name} {length}" for name, length in lengths.items()))
    if casts:
        print(f"{option}: cast {', '.join(casts)} (the step graph's dtypes; no value changes beyond float rounding)")
    return conformed


def cast_losslessly(value: np.ndarray, dtype: np.dtype, what: str) -> np.ndarray:
    """``value`` as ``dtype``, refused (naming ``what`` and a value) where the cast would
    change a value: a float beyond the target float's range, a non-integral or out-of-range
    label, an integer a float cannot hold exactly; anything but numbers and booleans.
    Floats to a narrower float are rounded (as torch's ``.float()``)."""
    if value.dtype == dtype:
        return value
    if value.dtype.kind not in "biuf" or dtype.kind not in "biuf":
        raise CommandError(f"{what} is {value.dtype}; the step graph takes {dtype}")
    flat = value.reshape(-1)
    if dtype.kind == "f" and value.dtype.kind == "f":
        finite = flat[np.isfinite(flat)]
        beyond = finite[np.abs(finite) > np.finfo(dtype).max]
        if beyond.size:
            raise CommandError(f"{what} is {value.dtype} with values beyond {dtype}'s range (e.g. {beyond[0].item()!r}); "
                               f"the step graph takes {dtype}")
        return value.astype(dtype)
    if value.dtype.kind == "f":
        bad = flat[~np.isfinite(flat) | (flat != np.round(flat))]
        if bad.size:
            raise CommandError(f"{what} is {value.dtype} with non-integral values (e.g. {bad[0].item()!r}); the step graph "
                               f"takes {dtype}")
    if dtype.kind in "iu":  # (max + 1: a float compares exactly with it, a float max may round up)
        changed = flat[(flat < np.iinfo(dtype).min) | (flat >= np.iinfo(dtype).max + 1)]
    else:  # an integer to a float: exact if it comes back the same
        changed = flat[value.astype(dtype).reshape(-1).astype(value.dtype) != flat]
    if changed.size:
        raise CommandError(f"{what} is {value.dtype} with values {dtype} cannot hold exactly (e.g. {changed[0].item()!r}); "
                           f"the step graph takes {dtype}")
    return value.astype(dtype)


def fixed_batch_size(trainer) -> Optional[int]:
    """The batch size a step graph exported with a static axis 0 takes (None: any)."""
    inputs = {i.name: i for i in trainer.step_model.graph.input}
    sizes = set()
    for name in trainer.data_inputs:
        dims = inputs[name].type.tensor_type.shape.dim
        sizes.add(dims[0].dim_value if dims and dims[0].HasField("dim_value") else None)
    return sizes.pop() if len(sizes) == 1 and None not in sizes else None


def parse_scheduler(text: str, trainer):
    """``'StepLR(step_size=5, gamma=0.5)'`` -> that :mod:`normgrad.schedules` scheduler on ``trainer``."""
    import normgrad.schedules as schedules

    try:
        call = ast.parse(text.strip(), mode="eval").body
        if not isinstance(call, (ast.Call, ast.Name)):
            raise ValueError
        name = (call.func if isinstance(call, ast.Call) else call).id
        arguments = {k.arg: ast.literal_eval(k.value) for k in call.keywords} if isinstance(call, ast.Call) else {}
        if isinstance(call, ast.Call) and (call.args or None in arguments):
            raise ValueError
    except (SyntaxError, ValueError, AttributeError):
        raise CommandError(f"--scheduler {text!r}: write NAME(ARG=VALUE, ...), e.g. 'StepLR(step_size=5, gamma=0.5)'") from None
    usable = [n for n in schedules.__all__ if n.endswith(("LR", "Plateau", "Restarts")) and n not in ("SequentialLR",)]
    if name not in usable:
        raise CommandError(f"--scheduler: {name!r} is not one of {', '.join(usable)} (SequentialLR and "
                           "ChainedScheduler: use normgrad.loop.fit from Python)")
    try:
        return getattr(schedules, name)(trainer, **arguments)
    except (TypeError, ValueError) as error:  # an unknown or missing argument; a value its rules refuse
        raise CommandError(f"--scheduler {name}: {one_line(error)}") from None


def session_options(threads: Optional[int], step_model):
    """The Trainer's default session options for ``step_model`` (a ``ModelProto`` or its
    path) with ``threads`` intra-op threads (None: the Trainer's own default options)."""
    if threads is None:
        return None
    import onnx
    import onnxruntime

    from normgrad._session import training_session_options

    if isinstance(step_model, str):
        step_model = onnx.load(step_model, load_external_data=False)
    options = training_session_options(onnxruntime, step_model)
    options.intra_op_num_threads = threads
    return options


def given_hyperparameters(args: argparse.Namespace) -> Dict[str, float]:
    """The step graph's hyperparameters given on the command line (or in --config), by
    their names in ``Trainer.hyperparameters``."""
    given = {"lr": getattr(args, "lr", None), "weight_decay": args.weight_decay, "eps": args.eps,
             "momentum": args.momentum, "dampening": args.dampening, "max_grad_norm": args.max_grad_norm}
    if args.betas:
        given["beta1"], given["beta2"] = args.betas
    return {name: float(value) for name, value in given.items() if value is not None}


class StartOfRun(loop.Callback):
    """At the start of the run, after a resume restored the checkpoint's hyperparameters:
    applies those given on the command line (the checkpoint's would otherwise win silently)
    and prints the effective ones in one line, each with where it comes from. What the
    run's scheduler moves is the scheduler's: a resumed run is refused a start value other
    than the one its scheduler started from (the scheduler's state would overrule it)."""

    def __init__(self, given: Mapping[str, float], scheduler, settings: str) -> None:
        self.given, self.scheduler, self.settings = dict(given), scheduler, settings
        self.scheduled = {getattr(scheduler, "momentum", None)} - {None}
        if hasattr(scheduler, "base_lrs"):  # (ReduceLROnPlateau only scales the value it finds: it takes a new one)
            self.scheduled.add(scheduler.hyperparameter)

    def on_fit_start(self, loop_) -> None:
        values, resumed = loop_.trainer.hyperparameters, bool(loop_.history)
        described = []
        for name in list(values):
            value, origin = float(values[name]), "the checkpoint's" if resumed else "the step graph's"
            if name in self.scheduled:
                origin = self._scheduled(name, value, resumed)
            elif name in self.given:
                origin = "given"
                if resumed and self.given[name] != value:
                    values[name] = self.given[name]
                    origin, value = f"given; the checkpoint had {value:g}", self.given[name]
            described.append(f"{name} {value:g} ({origin})")
        head = f"resuming at step {loop_.trainer.step_count}" if resumed else "training"
        print(f"{head}: {', '.join(described)}; {self.settings}", flush=True)

    def _scheduled(self, name: str, value: float, resumed: bool) -> str:
        kind = type(self.scheduler).__name__
        if name != getattr(self.scheduler, "hyperparameter", None):
            return f"scheduled by {kind}"
        start = float(self.scheduler.base_lrs[0])
        if resumed and name in self.given and np.float32(self.given[name]) != np.float32(start):
            raise TrainerError(f"{_flag(name)} {self.given[name]:g} with --resume: the checkpoint's {kind} schedules "
                               f"{name} from {start:g} (now {value:g}); resume with {_flag(name)} {start:g} or without "
                               f"{_flag(name)}, or start a new run (another --out)")
        return f"scheduled by {kind} from {start:g}"


def _flag(hyperparameter: str) -> str:
    return "--betas" if hyperparameter.startswith("beta") else "--" + hyperparameter.replace("_", "-")


def _metric(name: str):
    import normgrad.metrics as metrics

    return metrics.top_k_accuracy(5) if name == "top5" else getattr(metrics, name)


def _batching(args: argparse.Namespace, trainer, length: int):
    """``(batch_size, drop_last, description)``: a graph exported with a static batch axis
    takes exactly that batch (the remainder left out); --accumulation splits each batch."""
    batch_size, drop_last = args.batch_size or DEFAULT_BATCH_SIZE, False
    fixed = fixed_batch_size(trainer)
    if fixed is not None:
        if args.batch_size not in (None, fixed):
            raise CommandError(f"--batch-size {args.batch_size}: the step graph takes batches of exactly {fixed} "
                               f"(its input {trainer.data_inputs[0]!r} has a static axis 0); pass --batch-size {fixed} "
                               "or export with a dynamic batch axis")
        batch_size, drop_last = fixed, True
    accumulation = args.accumulation or 1
    if batch_size % accumulation:
        raise CommandError(f"--accumulation {accumulation}: the batch size {batch_size} is not a multiple of it "
                           "(each batch is split into equal micro-batches)")
    if length % batch_size % accumulation:  # the epoch's last, smaller batch cannot be split evenly
        drop_last = True
    description = f"batch size {batch_size}" + (f" in {accumulation} micro-batches" if accumulation > 1 else "")
    if drop_last and length % batch_size:
        description += f" (the last {length % batch_size} samples of each epoch left out)"
    return batch_size, drop_last, f"{description}, {args.epochs} epoch{'s' if args.epochs != 1 else ''}"


def _train_step_graph(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from normgrad.train import Trainer

    if not args.data:
        parser.error("a STEP graph needs its training arrays: --data FILE")
    checkpoint = args.checkpoint or beside_step_graph(args.step, ".ckpt")
    eval_graph = eval_graph_path(args.step)
    folder = args.checkpoint_dir or os.path.join(args.out, "checkpoints")
    given = given_hyperparameters(args)
    try:
        for path in (args.step, checkpoint):
            if not os.path.isfile(path):
                raise CommandError(f"no file {path}" + (" (the initial state: --checkpoint)" if path == checkpoint else ""))
        train = load_arrays(args.data, "--data")
        validation = load_arrays(args.eval, "--eval") if args.eval else None
        options = {k: v for k, v in given.items() if k not in ("beta1", "beta2")}
        if "beta1" in given:
            options["betas"] = (given["beta1"], given["beta2"])
        trainer = Trainer(args.step, checkpoint, eval_model=eval_graph if os.path.isfile(eval_graph) else None,
                          accumulation=args.accumulation or 1, session_options=session_options(args.threads, args.step), **options)
        train = check_arrays(train, trainer, "--data")
        if validation is not None:
            validation = check_arrays(validation, trainer, "--eval")
        batch_size, drop_last, settings = _batching(args, trainer, len(next(iter(train.values()))))
        scheduler = parse_scheduler(args.scheduler, trainer) if args.scheduler else None
        chosen = {name: _metric(name) for name in args.metrics or []}
        if chosen and validation is None:
            raise CommandError("--metrics needs validation arrays: --eval FILE")
        callbacks: List[loop.Callback] = [StartOfRun(given, scheduler, settings)]
        if args.patience is not None:
            callbacks.append(loop.EarlyStopping(args.monitor or ("val_loss" if validation else "train_loss"),
                                                args.mode, args.patience, args.min_delta))
        result = trainer.fit(
            loop.array_batches(train, batch_size, shuffle=True, seed=args.seed, drop_last=drop_last), epochs=args.epochs,
            evaluation=(loop.array_batches(validation, batch_size, drop_last=drop_last) if validation is not None
                        else None), evaluate_every=args.evaluate_every,
            metrics=chosen, callbacks=callbacks, scheduler=scheduler, scheduler_interval=args.scheduler_interval,
            monitor=args.monitor, mode=args.mode, checkpoint_dir=folder, keep_last=args.keep_last,
            checkpoint_every=args.checkpoint_every, resume=args.resume, log_dir=args.out,
            progress=not args.no_progress)
        inference = os.path.join(args.out, "inference.onnx")
        trainer.export_inference_model(inference)
        inference = ", ".join([inference, *_export_onnx_adapter(trainer, args.step, folder)])
    except (CommandError, TrainerError, LoraError) as error:
        print(f"normgrad train: {one_line(error)}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # stdout's reader has gone: normgrad.tools.cli ends quietly
        raise
    except OSError as error:
        print(f"normgrad train: cannot write {error.filename or args.out}: {error.strerror or error}", file=sys.stderr)
        return 1
    _report(result, trainer, args, folder, inference, validation is not None)
    return 0


ONNX_ADAPTER, ADAPTER_MODEL, PEFT_ADAPTER = "adapter.onnx_adapter", "adapter_model.onnx", "peft_adapter"
"""The files ``normgrad train`` writes in the checkpoint folder for a step graph with adapters
of ``normgrad export --lora-*`` (peft's pair in the folder ``PEFT_ADAPTER``, for an
onnxruntime-genai build whose layers map to the transformers model's)."""


def _export_onnx_adapter(trainer, step_path: str, folder: str) -> List[str]:
    """For a step graph with adapters of ``normgrad export --lora-*``: the trained adapters
    in onnxruntime's format, the deployable model (the base model the step graph was exported
    from, adapters as inputs, the base's external data streamed into a data file beside it)
    and, for a genai build, peft's pair, in ``folder``, written as one set (a failure or a
    kill leaves the earlier run's files or these, never a mix); the paths written."""
    from normgrad.graphs.adapters import lora_layers

    info = lora_layers(trainer.step_model)
    if info is None or not trainer.is_saving_rank:
        return []
    import normgrad.lora as lora
    from normgrad.util.files import StagedFile, commit_files, staging

    adapter_file = lora.onnx_adapter_bytes(trainer.step_model, trainer.state_dict())
    os.makedirs(folder, exist_ok=True)
    with staging() as staged:
        staged.append(StagedFile(os.path.join(folder, ONNX_ADAPTER), [adapter_file]))
        deployable = _stage_adapter_model(trainer, step_path, folder, info)
        staged.extend(deployable)
        if deployable:
            for path, data in _peft_adapter_files(trainer, _base_model(step_path, info), folder).items():
                os.makedirs(os.path.dirname(path), exist_ok=True)
                staged.append(StagedFile(path, [data]))
    commit_files(staged)
    return [file.path for file in staged]


def _base_model(step_path: str, info: dict) -> Optional[str]:
    """The path of the base model the step graph's adapters were added to, as it names it."""
    base = info.get("base_model")
    return base and os.path.join(os.path.dirname(os.path.abspath(step_path)), base)


def _stage_adapter_model(trainer, step_path: str, folder: str, info: dict) -> list:
    """The deployable model staged (with its data file where the base has external data);
    none (an earlier run's removed, peft's pair with it) and one line saying why where the
    base model is unusable."""
    import normgrad.lora as lora

    base = _base_model(step_path, info)
    try:
        if not base or not os.path.isfile(base):
            where = f"{base} is not there" if base else "the step graph does not name it"
            raise LoraError(f"the base model the adapters were added to is needed ({where}; "
                            "normgrad.lora.adapter_model(step, BASE) makes it)")
        return lora.stage_adapter_model(os.path.join(folder, ADAPTER_MODEL), trainer.step_model, base)
    except LoraError as error:  # the training's files stand; no earlier run's beside them
        _remove_earlier(folder, [ADAPTER_MODEL, *(os.path.relpath(path, folder) for path in
                                                  owned_data_files(os.path.join(folder, ADAPTER_MODEL))),
                                 *(os.path.join(PEFT_ADAPTER, name) for name in (lora.ADAPTER_WEIGHTS,
                                                                                lora.ADAPTER_CONFIG))])
        print(f"normgrad train: warning: {ADAPTER_MODEL} not written: {one_line(error)}", file=sys.stderr)
        return []


def _peft_adapter_files(trainer, base: str, folder: str) -> dict:
    """{path: bytes} of peft's files for the adapters of an onnxruntime-genai build, in
    ``folder/PEFT_ADAPTER``; where their names do not map, none (an earlier run's removed) and
    one line saying why. Another base (no ``genai_config.json`` beside it) gets none, silently."""
    import normgrad.lora as lora

    if not os.path.isfile(os.path.join(os.path.dirname(base), lora.GENAI_CONFIG)):
        return {}
    target = os.path.join(folder, PEFT_ADAPTER)
    try:
        pair = lora.genai_peft_files(trainer.step_model, trainer.state_dict(), base)
    except LoraError as error:
        _remove_earlier(target, [lora.ADAPTER_WEIGHTS, lora.ADAPTER_CONFIG])
        print(f"normgrad train: no peft adapter written: {one_line(error)}", file=sys.stderr)
        return {}
    return {os.path.join(target, name): data for name, data in pair.items()}


def _remove_earlier(folder: str, names: Sequence[str]) -> None:
    """Removes the files ``names`` in ``folder`` an earlier run wrote, which would not fit
    this run's adapters."""
    for name in names:
        if os.path.exists(os.path.join(folder, name)):
            os.remove(os.path.join(folder, name))


def _report(result, trainer, args: argparse.Namespace, folder: str, inference: str, evaluated: bool) -> None:
    """The run's last lines: its steps and last evaluation, the best checkpoint, the files written."""
    last = result.evaluations[-1] if result.evaluations else {}
    summary = ", ".join(f"{k} {v:.4g}" for k, v in last.items() if k not in ("epoch", "step"))
    stopped = " (stopped early)" if result.stopped_early else ""
    print(f"{trainer.step_count} steps{stopped}; last evaluation: {summary or 'none'}")
    if result.best is not None and result.best_checkpoint:
        monitor = args.monitor or ("val_loss" if evaluated else "train_loss")
        print(f"best {monitor} {result.best[monitor]:.4g} at step {result.best['step']}: {result.best_checkpoint}")
    print(f"wrote {folder}/, {os.path.join(args.out, 'metrics.csv')}, {inference}"
          + (f", {os.path.join(args.out, 'training.png')}" if os.path.isfile(os.path.join(args.out, "training.png")) else ""))
