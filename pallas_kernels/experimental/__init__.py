"""Kernel variants that were measured and are not routed: the two-kernel tree verify
(``verify_split.py``)."""
