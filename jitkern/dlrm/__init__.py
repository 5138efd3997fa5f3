"""A pure-NumPy DLRM with manual backprop, built only from jitkern.ops."""
