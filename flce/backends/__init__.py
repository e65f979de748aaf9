"""Backends: one folder each (kernels.py, ops.py, function.py, __init__.py), plus the chunk
loop and autograd.Function they share."""
