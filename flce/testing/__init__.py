"""What flce offers for checking: the float64 oracle every backend is tested against, and (measure)
the inputs, clocks and memory figures its tools and tuner share."""

from flce.testing.oracle import reference_loss

__all__ = ["reference_loss"]
