"""Backends only: one folder each, the same shape in each (kernels.py, ops.py, plan.py, tuning.py,
__init__.py with the descriptor); what they share is flce.engine."""
