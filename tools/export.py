"""``normgrad export IN.onnx -o OUT.onnx [--loss KIND | --loss-output NAME] [--inline] [--portable] [--optimizer sgd|adam|adamw ...]
[--no-weight-decay GLOB ...] [--data-parallel] [--sync-batch-norm] [--lora-rank R --lora-targets GLOB ...]``:
write the training graph (forward + gradients) of a forward model, or with ``--optimizer``
its step graph (gradients + one optimizer step) and the evaluation graph (``NAME.eval.onnx``:
loss and outputs in eval mode, no update); trainable weights are pure graph inputs, their
initial values (and the optimizer's state) in a checkpoint beside the graph. With ``--lora-*``,
LoRA adapters are added to the chosen layers first (:func:`normgrad.lora.add_adapters`) and
only they train."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Optional, Sequence

from normgrad.util.files import PathAliasError, refuse_irregular_file
from normgrad.util.external_data import EXTERNAL_TENSOR_MIN_BYTES, external_data_files, uses_external_data
from normgrad.tools.cli import ArgumentParser, CommandError, load_model, one_line

__all__ = ["main"]


class _NothingToTrain(CommandError):
    """--freeze/--trainable leave no weight for --optimizer (a usage error: exit code 2)."""


def _parser():
    """The ``normgrad export`` argument parser."""
    from normgrad.graphs.losses import LOSSES

    parser = ArgumentParser(prog="normgrad export", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="forward ONNX model")
    parser.add_argument("-o", "--output", required=True, help="where to write the training graph (not the input)")
    parser.add_argument("--loss", choices=sorted(LOSSES), help="append a loss of the first output (adds a 'labels' input)")
    parser.add_argument("--label-smoothing", type=float, default=None, metavar="EPS",
                        help="cross_entropy: torch's label_smoothing (0..1)")
    parser.add_argument("--ignore-index", type=int, default=None, metavar="CLASS",
                        help="cross_entropy: samples with this label get no loss or gradient (torch's ignore_index, e.g. -100)")
    parser.add_argument("--beta", type=float, default=None, help="smooth_l1: torch's beta (default 1)")
    parser.add_argument("--loss-output", metavar="NAME",
                        help="the model's scalar output NAME is already its loss (instead of --loss)")
    parser.add_argument("--inline", action="store_true", help="standard ONNX ops only (normgrad functions inlined)")
    parser.add_argument("--portable", action="store_true",
                        help="also the portable rewrites that cost time on onnxruntime's CPU provider (OneHot as "
                             "Equal + Where, LayerNorm statistics computed beside it, training-mode Dropout as a "
                             "mask seeded by a dropout_seed input), for OpenVINO; without it every other rewrite is "
                             "made (weights are always pure inputs, their initial values in the checkpoint)")
    parser.add_argument("--freeze", action="append", default=[], metavar="NAME_OR_GLOB",
                        help="initializers that get no gradient (repeatable; fnmatch globs)")
    parser.add_argument("--trainable", action="append", default=None, metavar="NAME_OR_GLOB",
                        help="train only these initializers (repeatable; fnmatch globs)")
    parallel = parser.add_argument_group("data parallelism over MPI ranks (run the graph under mpirun; see normgrad.mpi)")
    parallel.add_argument("--data-parallel", action="store_true",
                          help="average parameter gradients and the loss over the ranks (bucketed AllReduce)")
    parallel.add_argument("--sync-batch-norm", action="store_true",
                          help="training-mode BatchNorm statistics and backward sums over the global batch")
    parallel.add_argument("--bucket-mb", type=float, default=None,
                          help="with --data-parallel: largest gradient all-reduce, MiB (default 25)")
    adapters = parser.add_argument_group("LoRA adapters on any model (only the adapters train; see normgrad.lora)")
    adapters.add_argument("--lora-rank", type=int, default=None, metavar="R",
                          help="add a LoRA adapter of rank R beside each MatMul, Gemm or MatMulNBits --lora-targets names")
    adapters.add_argument("--lora-alpha", type=float, default=None, metavar="A",
                          help="the adapters' scaling is A / R (default 8, as peft)")
    adapters.add_argument("--lora-targets", action="append", default=[], metavar="GLOB",
                          help="the layers to adapt: fnmatch globs of node or weight names (repeatable; '*': all)")
    adapters.add_argument("--lora-dropout", type=float, default=None, metavar="P",
                          help="dropout on each adapter's input, in training only (default 0)")
    step = parser.add_argument_group("step graph (weights as inputs, initial state in a checkpoint)")
    step.add_argument("--optimizer", choices=["sgd", "adam", "adamw"], help="append one torch.optim step (needs --loss or --loss-output)")
    step.add_argument("--checkpoint", help="where to write the initial weights (and, with --optimizer, optimizer "
                                           "state); default: OUTPUT with .ckpt for .onnx")
    step.add_argument("--momentum", type=float, default=None, help="sgd only (default 0)")
    step.add_argument("--dampening", type=float, default=None, help="sgd only (default 0)")
    step.add_argument("--nesterov", action="store_true", default=None, help="sgd only")
    step.add_argument("--weight-decay", type=float, default=None, help="default 0 (sgd, adam), 0.01 (adamw), as torch")
    step.add_argument("--no-weight-decay", nargs="+", default=[], metavar="GLOB",
                      help="parameters that get no weight decay, as a torch param_group with weight_decay=0 "
                           "(fnmatch globs on parameter names, e.g. '*.bias' '*norm*'); default: decay all")
    step.add_argument("--betas", type=float, nargs=2, default=None, help="adam, adamw only (default 0.9 0.999)")
    step.add_argument("--eps", type=float, default=None, help="adam, adamw only (default 1e-8)")
    step.add_argument("--amsgrad", action="store_true", default=None, help="adam, adamw only")
    step.add_argument("--max-grad-norm", type=float, default=None,
                      help="clip the gradients' global L2 norm to this, as clip_grad_norm_ (default: no clipping)")
    step.add_argument("--clip-grad-norm", type=float, default=None, dest="clip_grad_norm", help=argparse.SUPPRESS)
    step.add_argument("--seed", type=int, default=None,
                      help="Dropout seed (int64, default 0): training-mode Dropout masks are a function of it, the step "
                           "and the micro-batch; the Trainer's seed= overrides it")
    return parser


def _optimizer_options(parser, args) -> dict:
    """The optimizer step's keyword options given on the command line, checked (a usage
    error exits through ``parser.error``)."""
    options = {name: value for name, value in (
        ("momentum", args.momentum), ("dampening", args.dampening), ("nesterov", args.nesterov),
        ("weight_decay", args.weight_decay), ("betas", None if args.betas is None else tuple(args.betas)),
        ("eps", args.eps), ("amsgrad", args.amsgrad), ("max_grad_norm", args.max_grad_norm)) if value is not None}
    if options and not args.optimizer:
        given = next(iter(options))
        parser.error(f"--{given.replace('_', '-')} is an option of the optimizer step: it needs --optimizer")
    if args.optimizer:
        from normgrad.graphs.optimizers import check_hyperparameters

        try:
            check_hyperparameters(args.optimizer, command_line=True, **options)
        except TypeError as error:
            name = str(error).split("'")[1]
            parser.error(f"--{name.replace('_', '-')} is not an option of --optimizer {args.optimizer} ({error})")
        except ValueError as error:
            parser.error(f"--optimizer {args.optimizer}: {error}")
    return options


def _loss_options(parser, args) -> dict:
    """The loss's keyword options given on the command line, checked."""
    from normgrad.graphs.losses import LOSS_OPTIONS

    options = {name: value for name, value in (("label_smoothing", args.label_smoothing),
                                               ("ignore_index", args.ignore_index), ("beta", args.beta))
               if value is not None}
    if args.label_smoothing is not None and not 0.0 <= args.label_smoothing <= 1.0:
        parser.error(f"--label-smoothing must be in [0, 1]; got {args.label_smoothing}")
    if args.beta is not None and not args.beta >= 0:
        parser.error(f"--beta must be >= 0; got {args.beta}")
    for name in options:
        if name not in LOSS_OPTIONS.get(args.loss, ()):
            parser.error(f"--{name.replace('_', '-')} is an option of "
                         f"{' '.join(k for k, v in LOSS_OPTIONS.items() if name in v)} (--loss {args.loss})")
    return options


def _check_usage(parser, args) -> None:
    """The usage errors between flags (``parser.error``)."""
    if args.optimizer and not (args.loss or args.loss_output):
        parser.error("--optimizer needs --loss or --loss-output")
    if args.loss and args.loss_output:
        parser.error("give --loss or --loss-output, not both")
    if args.inline and (args.data_parallel or args.sync_batch_norm):
        parser.error("--inline writes AllReduce as its function body (the identity): it cannot be combined with "
                     "--data-parallel or --sync-batch-norm")
    if args.seed is not None and not args.optimizer:
        parser.error("--seed needs --optimizer (gradient-only graphs keep onnxruntime's own Dropout masks)")
    if args.seed is not None and not -2**63 <= args.seed < 2**63:
        parser.error(f"--seed must be in the int64 range; got {args.seed}")
    if args.bucket_mb is not None and not args.data_parallel:
        parser.error("--bucket-mb needs --data-parallel")
    if args.no_weight_decay and not args.optimizer:
        parser.error("--no-weight-decay needs --optimizer")
    lora_given = [flag for flag, value in (("--lora-alpha", args.lora_alpha), ("--lora-targets", args.lora_targets),
                                           ("--lora-dropout", args.lora_dropout)) if value not in (None, [])]
    if lora_given and args.lora_rank is None:
        parser.error(f"{lora_given[0]} needs --lora-rank")
    if args.lora_rank is not None and not args.lora_targets:
        parser.error("--lora-rank needs --lora-targets GLOB (the layers to adapt; '*' for all)")
    if args.bucket_mb is not None and not args.bucket_mb > 0:
        parser.error(f"--bucket-mb must be a positive number; got {args.bucket_mb}")


def _build(args, optimizer_options: dict, loss_options: dict, input_files: list):
    """(the graph to write, its initial state) of the forward model ``args.model``: its
    training graph, or with ``--optimizer`` its step graph. ``input_files`` gets the input's
    external data files."""
    from normgrad.graphs import build_step_graph, build_training_graph
    from normgrad.graphs.builder import frozen_parameters
    from normgrad.graphs.data_parallel import DEFAULT_BUCKET_BYTES
    from normgrad.graphs.portable import as_exported, make_portable
    from normgrad.graphs.torch_exports import TorchExportWarning

    def keep_external(model):  # sees the model before its external data is read
        input_files.extend(("a data file of the input model", path)
                           for path in external_data_files(model, os.path.dirname(os.path.abspath(args.model))))
        return _frozen_weights(model, args.freeze, args.trainable, lora=args.lora_rank is not None)

    forward = load_model(args.model, keep_external=keep_external)
    if args.lora_rank is not None:
        forward = _with_adapters(forward, args)
    _refuse_beyond_memory(args.model, forward)
    frozen = frozen_parameters(forward, args.freeze, args.trainable)
    bucket_bytes = int(args.bucket_mb * 1024 * 1024) if args.bucket_mb is not None else DEFAULT_BUCKET_BYTES
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TorchExportWarning)
        training = build_training_graph(forward, loss=args.loss, inline=args.inline, frozen=frozen,
                                        loss_options=loss_options, loss_output=args.loss_output,
                                        data_parallel=args.data_parallel, sync_batch_norm=args.sync_batch_norm,
                                        bucket_bytes=bucket_bytes,
                                        portable=args.portable and not args.optimizer)  # the step graph's, below
        del forward  # the training graph holds all of it
    for warning in caught:
        if issubclass(warning.category, TorchExportWarning):
            print(f"normgrad export: warning: {one_line(warning.message)}", file=sys.stderr)
        else:
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    if not args.optimizer:
        return training
    if (args.freeze or args.trainable) and not training.weights:
        raise _NothingToTrain("--freeze/--trainable leave no weight to train; --optimizer needs at least one (see --help)")
    step, initial = build_step_graph(training, args.optimizer, dropout_seed=args.seed or 0,
                                     no_weight_decay=args.no_weight_decay, **optimizer_options)
    del training
    written, _ = (make_portable if args.portable else as_exported)(step, in_place=True)
    return written, initial


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``normgrad export``; returns the process exit code (2: usage error,
    1: a model it cannot export or a file it cannot write)."""
    import onnx

    from normgrad.graphs import UnsupportedOperatorError
    from normgrad.artifacts import artifact_paths, check_artifact_paths, save_artifacts

    parser = _parser()
    args = parser.parse_args(argv)
    if args.clip_grad_norm is not None:
        print("normgrad export: warning: --clip-grad-norm is deprecated; use --max-grad-norm", file=sys.stderr)
        if args.max_grad_norm is not None:
            parser.error("give --max-grad-norm, not also its old name --clip-grad-norm")
        args.max_grad_norm = args.clip_grad_norm
    _check_usage(parser, args)
    optimizer_options = _optimizer_options(parser, args)
    loss_options = _loss_options(parser, args)
    artifacts = artifact_paths(args.output, args.checkpoint, eval_graph=bool(args.optimizer))
    input_files = [("the input model", args.model)]
    try:
        check_artifact_paths(artifacts, input_files)
    except PathAliasError as error:
        print(f"normgrad export: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"normgrad export: cannot write {error.filename}: {error.strerror}; nothing was written", file=sys.stderr)
        return 1
    try:
        refuse_irregular_file(args.model, "input model")
    except OSError as error:
        print(f"normgrad export: {error.filename}: {error.strerror}; nothing was written", file=sys.stderr)
        return 1
    try:
        try:
            written, initial = _build(args, optimizer_options, loss_options, input_files)
            check_artifact_paths(artifacts, input_files)  # the input's external data files too
        except (PathAliasError, _NothingToTrain) as error:
            print(f"normgrad export: {error}", file=sys.stderr)
            return 2
        save_artifacts(artifacts.graph, written, initial, eval_graph=bool(args.optimizer),
                       checkpoint=artifacts.checkpoint, data_folder=os.path.dirname(os.path.abspath(args.model)))
    except OSError as error:
        print(f"normgrad export: cannot write {error.filename or args.output}: {error.strerror or error}", file=sys.stderr)
        return 1
    except (CommandError, UnsupportedOperatorError, ValueError, onnx.checker.ValidationError,
            onnx.shape_inference.InferenceError) as error:
        print(f"normgrad export: {one_line(error)}", file=sys.stderr)
        return 1
    except MemoryError:
        print(f"normgrad export: out of memory exporting {args.model}; nothing was written", file=sys.stderr)
        return 1
    print(_summary(args, artifacts, written))
    return 0


def _summary(args, artifacts, written) -> str:
    """The line ``normgrad export`` prints when it wrote the set."""
    folder = os.path.dirname(args.output)
    data = sorted({os.path.join(folder, entry.value) for t in written.graph.initializer if uses_external_data(t)
                   for entry in t.external_data if entry.key == "location"})
    frozen = f"; frozen weights in {', '.join(data)}" if data else ""
    if args.lora_rank is not None:
        from normgrad.graphs.adapters import lora_layers

        count = len(lora_layers(written)["layers"])
        frozen += f"; LoRA adapters of rank {args.lora_rank} on {count} layer{'s' * (count != 1)} (only they train)"
    if args.optimizer:
        return (f"wrote {args.output}: {len(written.graph.node)} nodes, {args.optimizer} step; initial state in "
                f"{artifacts.checkpoint}; evaluation graph in {artifacts.eval_graph}{frozen}")
    grads = [o.name for o in written.graph.output if o.name.endswith("_grad")]
    return (f"wrote {args.output}: {len(written.graph.node)} nodes, {len(grads)} gradient outputs; "
            f"initial weights in {artifacts.checkpoint}{frozen}")


EXPORT_BYTES_PER_NODE = 13 * 1024
"""Peak memory of ``normgrad export`` per forward node, measured on chains of 10^4 and 10^5
elementwise nodes (docs/reference/errors.md, "Large models"): 1.25 GiB at 10^5 nodes."""


def _available_memory() -> Optional[int]:
    """Bytes this process can still allocate: the smaller of the system's MemAvailable and
    what the address-space limit (ulimit -v) leaves; None where neither is known."""
    import resource

    limits = []
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    limits.append(int(line.split()[1]) * 1024)
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            with open("/proc/self/statm") as statm:
                limits.append(soft - int(statm.read().split()[0]) * resource.getpagesize())
    except (OSError, ValueError):
        pass
    return min(limits) if limits else None


def _refuse_beyond_memory(path: str, forward) -> None:
    """CommandError when exporting ``forward`` would need more memory than is available:
    past that point onnx's C++ code and protobuf abort or crash with no message."""
    needed = EXPORT_BYTES_PER_NODE * len(forward.graph.node) + 3 * forward.ByteSize()
    available = _available_memory()
    if available is not None and needed > available:
        raise CommandError(f"exporting {path} ({len(forward.graph.node):,} nodes) needs about "
                           f"{needed / 2**30:.1f} GiB of memory; {max(available, 0) / 2**30:.1f} GiB are available; "
                           "nothing was written")


def _with_adapters(forward, args):
    """``forward`` with the LoRA adapters of ``--lora-*``, its ``normgrad.lora`` metadata
    naming the input model by its path from the output's folder (``normgrad train`` writes
    the deployable model from it: :func:`normgrad.lora.adapter_model`)."""
    import json

    from normgrad.graphs.adapters import METADATA_LORA, add_adapters
    from onnx import helper

    adapted = add_adapters(forward, args.lora_targets, args.lora_rank,
                           8.0 if args.lora_alpha is None else args.lora_alpha, args.lora_dropout or 0.0)
    metadata = {p.key: p.value for p in adapted.metadata_props}
    info = json.loads(metadata[METADATA_LORA])
    info["base_model"] = os.path.relpath(os.path.abspath(args.model), os.path.dirname(os.path.abspath(args.output)))
    helper.set_model_props(adapted, {**metadata, METADATA_LORA: json.dumps(info)})
    return adapted


def _frozen_weights(forward, freeze, trainable, lora: bool = False) -> set:
    """The initializers whose data may stay in the input's external data files: the frozen
    float weights (``--freeze``/``--trainable``, and with normgrad.torch.export's metadata
    every one that is no torch parameter with requires_grad; with ``lora`` every one, the
    adapters being new) of 1 KiB or more. No graph builder reads their values; every other
    tensor is loaded."""
    from normgrad.graphs.builder import _frozen_by_metadata, frozen_parameters

    import numpy as np
    from onnx.helper import tensor_dtype_to_np_dtype

    frozen = frozen_parameters(forward, freeze, trainable) | _frozen_by_metadata(forward)
    if lora:
        frozen = {t.name for t in forward.graph.initializer}
    return {t.name for t in forward.graph.initializer if t.name in frozen and
            np.prod(t.dims) * tensor_dtype_to_np_dtype(t.data_type).itemsize >= EXTERNAL_TENSOR_MIN_BYTES}


if __name__ == "__main__":
    sys.exit(main())
