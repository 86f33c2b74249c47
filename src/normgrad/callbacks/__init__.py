"""Callbacks of :func:`normgrad.loop.fit`, as Lightning's: the :class:`Callback` hooks,
:class:`EarlyStopping`, :class:`ModelCheckpoint` (top-k and latest checkpoints, the resume
points), and the loggers (:class:`CSVLogger`, :class:`TensorBoardLogger`,
:class:`PlotLogger`, :class:`ProgressBar`). ``fit``'s own options (``checkpoint_dir``,
``log_dir``, ``progress``) build these."""

from normgrad.callbacks.base import Callback
from normgrad.callbacks.early_stopping import EarlyStopping
from normgrad.callbacks.loggers import CSVLogger, PlotLogger, ProgressBar, TensorBoardLogger
from normgrad.callbacks.model_checkpoint import ModelCheckpoint

__all__ = ["Callback", "EarlyStopping", "ModelCheckpoint", "CSVLogger", "TensorBoardLogger", "PlotLogger",
           "ProgressBar"]
