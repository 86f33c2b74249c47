"""A step graph, its evaluation graph and its checkpoint written as one set
(:func:`save_artifacts`; ``normgrad export`` wraps it).

Each file is built and staged under a temporary name before any is put in place, then all
are committed as one set (:func:`normgrad.util.files.commit_files`): a failure or a kill leaves
the old graphs and checkpoint (a trained one) or the new ones, never a mix. A frozen base in
external data stays in its files (graphs in the input's folder) or is copied to one
``NAME.HASH.data``, which both graphs share.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable, Mapping, Optional, Tuple, Union

import numpy as np
import onnx

import normgrad.checkpoint as checkpoints
from normgrad.graphs.step_graph import build_eval_graph
from normgrad.util.external_data import stage_models_external
from normgrad.util.files import (PathLike, beside_step_graph, commit_files, eval_graph_path, refuse_aliases,
                                 refuse_irregular_file, staging)

__all__ = ["Artifacts", "artifact_paths", "check_artifact_paths", "save_artifacts"]


@dataclasses.dataclass(frozen=True)
class Artifacts:
    """Where a set is written.

    Attributes:
        graph: the step graph (or a training graph).
        checkpoint: its initial state (``NAME.ckpt`` beside ``NAME.onnx`` by default).
        eval_graph: its evaluation graph (``NAME.eval.onnx``), or None when the set has none.
    """

    graph: str
    checkpoint: str
    eval_graph: Optional[str]

    def outputs(self) -> dict:
        """{what: path} of every file of the set, as :func:`normgrad.util.files.refuse_aliases` names them."""
        named = {"output (-o)": self.graph, "checkpoint (--checkpoint)": self.checkpoint}
        return {**named, **({"evaluation graph": self.eval_graph} if self.eval_graph is not None else {})}


def artifact_paths(path: PathLike, checkpoint: Optional[PathLike] = None, eval_graph: bool = True) -> Artifacts:
    """The paths of the set of the graph ``path``: the checkpoint ``checkpoint`` (default
    ``NAME.ckpt``), and with ``eval_graph`` the evaluation graph ``NAME.eval.onnx``."""
    path = os.fspath(path)
    return Artifacts(path, os.fspath(checkpoint) if checkpoint is not None else beside_step_graph(path, ".ckpt"),
                     eval_graph_path(path) if eval_graph else None)


def check_artifact_paths(artifacts: Artifacts,
                         inputs: Union[Mapping[str, PathLike], Iterable[Tuple[str, PathLike]]] = ()) -> None:
    """Refuses a set that cannot be written, before anything is built: two of its files that
    are one, one that is one of ``inputs`` (``{what: path}``), a missing folder, a path that
    is a folder or another non-regular file.

    Raises:
        normgrad.util.files.PathAliasError: (a ValueError) two of them are one file.
        OSError: a folder that does not exist, or a path that is not a regular file.
    """
    refuse_aliases(artifacts.outputs(), inputs)
    for what, path in artifacts.outputs().items():
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise FileNotFoundError(2, f"no folder {folder} for the {what}", path)
        refuse_irregular_file(path, what)


def save_artifacts(path: PathLike, graph: onnx.ModelProto, state: Mapping[str, np.ndarray], *,
                   eval_graph: Union[bool, onnx.ModelProto] = True, checkpoint: Optional[PathLike] = None,
                   data_folder: Optional[PathLike] = None,
                   inputs: Union[Mapping[str, PathLike], Iterable[Tuple[str, PathLike]]] = ()) -> Artifacts:
    """Writes a step graph (``graph``, from :func:`normgrad.graphs.build_step_graph`), its
    evaluation graph and its checkpoint (``state``: the initial state it returned) as one set.

    Args:
        path: where the step graph goes (``NAME.onnx``).
        graph: the step graph, or a training graph (then pass ``eval_graph=False``).
        state: the checkpoint's tensors.
        eval_graph: True: :func:`normgrad.graphs.step_graph.build_eval_graph` of ``graph``,
            written to ``NAME.eval.onnx``; a model: that one; False: none.
        checkpoint: where the checkpoint goes (default ``NAME.ckpt``).
        data_folder: the folder the external data locations of ``graph`` are relative to (a
            frozen base left in the input's files; default the current folder).
        inputs: ``{what: path}`` of files the set must not overwrite (the input model).

    Returns:
        Where each file was written.

    Raises:
        ValueError: the paths alias each other or one of ``inputs``, or the external data
            cannot be written beside the graphs.
        OSError: a file cannot be written (``filename``: which of the set); then none of the
            set is, and no old file is replaced.
    """
    artifacts = artifact_paths(path, checkpoint, eval_graph is not False)
    check_artifact_paths(artifacts, inputs)
    if eval_graph is True:
        eval_graph = build_eval_graph(graph)
    graphs = {artifacts.graph: graph, **({artifacts.eval_graph: eval_graph} if artifacts.eval_graph else {})}
    target = artifacts.graph
    try:
        with staging() as staged:
            try:
                staged += stage_models_external(graphs, data_folder, share=True)
            except ValueError as error:
                raise ValueError(f"cannot write {artifacts.graph}: {error}") from None
            target = artifacts.checkpoint
            staged += checkpoints.stage(artifacts.checkpoint, state)
        target = artifacts.graph
        commit_files(staged)
    except OSError as error:
        error.filename = target  # the file of the set that failed, not a temporary one
        raise
    return artifacts
