"""What flce offers for checking: the float64 oracle every backend is tested against."""

from flce.testing.oracle import reference_loss

__all__ = ["reference_loss"]
