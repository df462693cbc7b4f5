"""``benchmarks.tpu_roofline``'s schedule reader on small shapes: the HBM bytes it reads off the
block specs match the bytes the ops must move, and the kernel work it reads off the jaxpr
counts the verify's dots and loops."""

from __future__ import annotations

from benchmarks import tpu_roofline as roof
from benchmarks.common import GDNDims

DIMS = GDNDims("small", 1, 0, 0, hk=1, hv=2, k=128, v=128, conv_width=4)


def test_decode_moves_its_floor():
    s, byts = roof.decode_case(DIMS, 2)
    assert s.programs == 2 * DIMS.hv
    assert byts <= s.bytes <= 1.05 * byts  # f32 q, k, v besides the states
    row = roof._row(roof.CHIPS["v5e"], "decode", "small", "B 2", s, byts, 0)
    assert row["over_roofline"] < 1.1


def test_verify_schedule():
    s, par = roof.verify_case(DIMS, 2, 16, 128)
    byts, flops = roof.verify_floor(DIMS, 2, 16)
    assert s.programs == 1  # two rows x two heads of 16 nodes stacked into 64 rows
    assert byts <= s.bytes <= 1.2 * byts
    assert s.work.dots > 10 and s.work.mxu[128] > flops and s.work.vpu > 0
    steps = roof.newton_trips(par)
    assert 0 <= steps <= 3
    p = roof.predicted_us(s, roof.CHIPS["v6e"])
    assert p["predicted_us"] >= p["overlapped_us"] > 0
