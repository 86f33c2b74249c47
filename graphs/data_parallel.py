"""Data parallelism in the graph: gradients averaged over MPI ranks with few, large AllReduces.

Every rank runs the same training (or step) graph on its own shard of the global batch.
:func:`average_over_ranks` makes the parameter gradients (and the loss) the mean over the
ranks, as torch's DistributedDataParallel does: the values are flattened and concatenated
per element type into buckets of at most ``bucket_bytes`` (torch's default bucket is 25
MiB), each bucket goes through one normgrad ``AllReduce`` with a trailing 1 whose sum is the
number of ranks, is divided by it, and is split back into the original tensors. So a graph
knows nothing of the number of ranks, and on one process (or where AllReduce is its
function body, the identity) the averages are the values themselves.

:func:`all_reduce` is the hook ``build_training_graph(batch_norm_all_reduce=...)`` takes for
synchronized BatchNorm.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import onnx
import onnx.numpy_helper as onh

from normgrad.graphs.context import GradientContext
from normgrad.ops import DOMAIN

__all__ = ["DEFAULT_BUCKET_BYTES", "METADATA", "Member", "all_reduce", "average_over_ranks", "metadata",
           "plan_buckets", "static_member"]

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
METADATA = "normgrad.data_parallel"
"""Model metadata key: JSON {"data_parallel": bool, "sync_batch_norm": bool, "buckets":
[{"elem_type", "elements", "members"}, ...]}."""


def all_reduce(ctx: GradientContext, value: str) -> str:
    """Emits a normgrad AllReduce of ``value`` (the sum over the ranks); returns its output."""
    return ctx.op("AllReduce", value, domain=DOMAIN)


@dataclasses.dataclass(frozen=True)
class Member:
    """One value to average: ``key`` names it, ``value`` is its name in the graph."""

    key: str
    value: str
    elem_type: int
    shape: Sequence[int]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def plan_buckets(members: Sequence[Member], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> List[List[Member]]:
    """Members grouped by element type, in order, into buckets of at most ``bucket_bytes``
    (a member larger than that gets a bucket of its own)."""
    buckets: List[List[Member]] = []
    open_bucket: Dict[int, List[Member]] = {}
    filled: Dict[int, int] = {}
    for member in members:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(member.elem_type).itemsize
        nbytes = member.size * itemsize
        bucket = open_bucket.get(member.elem_type)
        if bucket is None or filled[member.elem_type] + nbytes > bucket_bytes:
            bucket = open_bucket[member.elem_type] = []
            buckets.append(bucket)
            filled[member.elem_type] = 0
        bucket.append(member)
        filled[member.elem_type] += nbytes
    return buckets


def average_over_ranks(
    ctx: GradientContext, members: Sequence[Member], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Tuple[Dict[str, str], List[List[Member]]]:
    """Emits the bucketed all-reduces; returns {member key: the name of its mean over the
    ranks} and the buckets."""
    averaged: Dict[str, str] = {}
    buckets = plan_buckets(members, bucket_bytes)
    for bucket in buckets:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(bucket[0].elem_type)
        flat = [ctx.op("Reshape", m.value, ctx.ints([-1])) for m in bucket]
        one = ctx.op("Constant", value=onh.from_array(np.ones(1, dtype)))
        summed = all_reduce(ctx, ctx.op("Concat", *flat, one, axis=0))
        ranks = ctx.op("Slice", summed, ctx.ints([-1]), ctx.ints([np.iinfo(np.int64).max]))
        mean = ctx.op("Div", summed, ranks)
        pieces = ctx.op("Split", mean, ctx.ints([m.size for m in bucket] + [1]), axis=0, outputs=len(bucket) + 1)
        for member, piece in zip(bucket, pieces):
            averaged[member.key] = ctx.op("Reshape", piece, ctx.ints(member.shape))
    return averaged, buckets


def metadata(data_parallel: bool, sync_batch_norm: bool, buckets: Sequence[Sequence[Member]] = ()) -> Dict[str, str]:
    """The model metadata entry (none when neither option is on): both flags, and for each
    bucket its element type, element count and members."""
    if not (data_parallel or sync_batch_norm):
        return {}
    described = [
        {
            "elem_type": onnx.TensorProto.DataType.Name(bucket[0].elem_type).lower(),
            "elements": sum(m.size for m in bucket),
            "members": [m.key for m in bucket],
        }
        for bucket in buckets
    ]
    entry = {"data_parallel": data_parallel, "sync_batch_norm": sync_batch_norm, "buckets": described}
    return {METADATA: json.dumps(entry)}


def static_member(ctx: GradientContext, key: str, value: str, like: Optional[str] = None, shape=None) -> Member:
    """A :class:`Member` whose type and shape are those of forward value ``like`` (default ``key``)."""
    like = like or key
    shape = ctx.static_shape(like) if shape is None else list(shape)
    elem_type = ctx.elem_type(like)
    if shape is None or elem_type is None:
        raise ValueError(f"data parallelism needs the static shape and type of '{like}'; shape inference could not find them")
    return Member(key, value, elem_type, shape)
