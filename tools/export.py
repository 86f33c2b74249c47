"""``normgrad export IN.onnx -o OUT.onnx [--loss mse|cross_entropy] [--inline]``: write the
training graph (forward + gradients) of a forward model."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from normgrad._files import refuse_same_file, save_model_atomic
from normgrad.tools.cli import ArgumentParser, CommandError, load_model, one_line

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``normgrad export``; returns the process exit code (2: usage error,
    1: a model it cannot export or a file it cannot write)."""
    import onnx

    from normgrad.graphs import UnsupportedOperatorError, build_training_graph
    from normgrad.graphs.losses import LOSSES

    parser = ArgumentParser(prog="normgrad export", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="forward ONNX model")
    parser.add_argument("-o", "--output", required=True, help="where to write the training graph (not the input)")
    parser.add_argument("--loss", choices=sorted(LOSSES), help="append a loss of the first output (adds a 'labels' input)")
    parser.add_argument("--inline", action="store_true", help="standard ONNX ops only (normgrad functions inlined)")
    args = parser.parse_args(argv)
    try:
        refuse_same_file(args.model, args.output)
    except ValueError as error:
        print(f"normgrad export: {error}", file=sys.stderr)
        return 2
    try:
        training = build_training_graph(load_model(args.model), loss=args.loss, inline=args.inline)
        save_model_atomic(training, args.output)
    except OSError as error:
        print(f"normgrad export: cannot write {args.output}: {error.strerror or error}", file=sys.stderr)
        return 1
    except (CommandError, UnsupportedOperatorError, ValueError, onnx.checker.ValidationError,
            onnx.shape_inference.InferenceError) as error:
        print(f"normgrad export: {one_line(error)}", file=sys.stderr)
        return 1
    grads = [o.name for o in training.graph.output if o.name.endswith("_grad")]
    print(f"wrote {args.output}: {len(training.graph.node)} nodes, {len(grads)} gradient outputs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
