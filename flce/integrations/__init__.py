"""Optional adapters that route other libraries' LM heads through flce."""
