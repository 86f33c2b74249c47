"""Small forward models built in code, shared by the training-graph tests.

The builders live in the package (:mod:`normgrad.graphs.examples`) so that the corpus
generator (``normgrad corpus``) can use them without importing the tests.
"""

from normgrad.graphs.examples import (  # noqa: F401
    FLOAT,
    group_norm_block,
    instance_norm_block,
    mlp,
    model,
    resnet_block,
    style_transfer_block,
    unet_block,
    unet_block_torchscript,
    weights,
)
