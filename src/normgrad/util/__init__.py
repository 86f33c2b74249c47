"""Leaf helpers of normgrad: they import nothing of normgrad but each other (and
:mod:`normgrad.errors`), so every layer above may use them.

* :mod:`normgrad.util.files`: atomic files, sets of files committed as one, paths kept inside a folder.
* :mod:`normgrad.util.external_data`: ONNX external data written and read inside a folder.
* :mod:`normgrad.util.strict_json`: standard JSON with non-finite numbers as strings.
"""
