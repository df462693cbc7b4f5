"""The gated delta rule token by token on recurrent states in the serving memory arena
(``arena.py``: one decode token, or a short prefill chunk), and a plain-JAX reference
(``reference.py``)."""

from pallas_kernels.decode.arena import recurrent_prefill, recurrent_step

__all__ = ["recurrent_prefill", "recurrent_step"]
