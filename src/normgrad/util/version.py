"""The release of normgrad (``normgrad.__version__``), which the models it writes name as their producer's version."""

__version__ = "0.1.0"
