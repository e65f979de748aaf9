"""The exceptions flce raises for a bad argument or option.

Each derives from the Python type that says what is wrong (ValueError: a bad value; TypeError: a value of
the wrong type) and from RuntimeError, the type PyTorch raises for the same mistakes, so that code written
against ``torch.nn.functional.linear_cross_entropy`` (``except RuntimeError``) catches flce's errors too.
"""

from __future__ import annotations


class InputError(ValueError, RuntimeError):
    """An argument or option with a value flce cannot use (a shape, a range, a name)."""


class InputTypeError(TypeError, RuntimeError):
    """An argument or option of a type flce cannot use (not a tensor, an integer dtype, not a bool)."""
