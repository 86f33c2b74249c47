"""The loggers of :func:`normgrad.loop.fit`, now in :mod:`normgrad.callbacks` (this module
keeps the names importable)."""

from normgrad.callbacks.loggers import CSVLogger, PlotLogger, ProgressBar, TensorBoardLogger

__all__ = ["CSVLogger", "TensorBoardLogger", "PlotLogger", "ProgressBar"]
