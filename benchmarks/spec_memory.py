"""Speculative recurrent-state memory: snapshot verification vs tree WY, per config and tree size.

    python -m benchmarks.spec_memory [--config qwen3_5_35b_a3b ...] [--nodes 8 64 ...]
                                     [--batch 1 16 64] [--json PATH]

Per draft node and GDN layer (f32 state, bf16 activations):
- snapshot (vLLM/SGLang): the node's recurrent state ``Hv*K*V*4`` plus its conv state
  ``(W-1)*conv_dim*2``;
- tree WY (this project): ``U`` ``Hv*V*4``, the key ``Hk*K*2``, the path log-decay ``Hv*4`` and
  the parent id (4), plus the node's conv input ``conv_dim*2`` (the conv commit needs it).
The "state" columns compare the recurrent part alone (ratio ~K), "total" adds the conv part.
"""

from __future__ import annotations

import argparse

from benchmarks.common import GDNDims, config_names, fmt_bytes, gdn_dims, write_json

F32, BF16 = 4, 2


def per_node_bytes(d: GDNDims) -> dict[str, int]:
    """Speculative bytes per draft node and GDN layer, by method and part."""
    return {
        "snapshot_state": d.hv * d.k * d.v * F32,
        "snapshot_conv": (d.conv_width - 1) * d.conv_dim * BF16,
        "wy_state": d.hv * d.v * F32 + d.hk * d.k * BF16 + d.hv * F32 + 4,
        "wy_conv": d.conv_dim * BF16,
    }


def rows(configs: list[str], nodes: list[int], batches: list[int]) -> list[dict]:
    out = []
    for name in configs:
        d = gdn_dims(name)
        per = per_node_bytes(d)
        for n in nodes:
            for b in batches:
                scale = n * b * d.num_gdn_layers
                snap = (per["snapshot_state"] + per["snapshot_conv"]) * scale
                wy = (per["wy_state"] + per["wy_conv"]) * scale
                out.append(
                    dict(
                        config=d.name,
                        gdn_layers=d.num_gdn_layers,
                        nodes=n,
                        batch=b,
                        snapshot_state_bytes=per["snapshot_state"] * scale,
                        wy_state_bytes=per["wy_state"] * scale,
                        state_ratio=per["snapshot_state"] / per["wy_state"],
                        snapshot_total_bytes=snap,
                        wy_total_bytes=wy,
                        total_ratio=snap / wy,
                        snapshot_per_seq_bytes=snap // b,
                        wy_per_seq_bytes=wy // b,
                    )
                )
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    known = config_names()
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.spec_memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--config",
        nargs="+",
        default=[c for c in known if c.startswith("qwen3_5")],
        help=f"config names in benchmarks/configs ({', '.join(known)}) or JSON paths",
    )
    ap.add_argument(
        "--nodes", nargs="+", type=int, default=[8, 32, 64, 128], help="draft tree sizes N"
    )
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 16, 64], help="batch sizes")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    for name, vals in (("--nodes", args.nodes), ("--batch", args.batch)):
        if min(vals) < 1:
            ap.error(f"{name}: values must be positive")
    table = rows(args.config, args.nodes, args.batch)
    hdr = f"{'config':<20}{'N':>5}{'B':>5} | {'snapshot/seq':>13}{'tree WY/seq':>13} | {'snapshot batch':>15}{'tree WY batch':>15} | {'state x':>8}{'total x':>8}"
    print("Speculative GDN memory, all GDN layers (state = recurrent part; total adds conv)")
    print(hdr)
    print("-" * len(hdr))
    for r in table:
        print(
            f"{r['config']:<20}{r['nodes']:>5}{r['batch']:>5} | "
            f"{fmt_bytes(r['snapshot_per_seq_bytes']):>13}{fmt_bytes(r['wy_per_seq_bytes']):>13} | "
            f"{fmt_bytes(r['snapshot_total_bytes']):>15}{fmt_bytes(r['wy_total_bytes']):>15} | "
            f"{r['state_ratio']:>8.1f}{r['total_ratio']:>8.1f}"
        )
    if args.json:
        write_json(args.json, table)
        print(f"wrote {args.json}")
    return table


if __name__ == "__main__":
    main()
