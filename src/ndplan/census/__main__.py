"""``python -m ndplan.census MODEL...``: run the census and print (or save) the records.

MODEL is an ndplan preset name (src/ndplan/model/presets/<name>.json) or a path to a Hugging Face
config.json. Needs the optional extra: pip install 'ndplan[census]'.
"""

from __future__ import annotations

import argparse
import sys

from ndplan.census.measure import ATTENTIONS, EXPERTS, load_hf_config, run_census
from ndplan.census.record import CensusRecord, save_census_file
from ndplan.errors import NdplanError


def _kib(x: float) -> str:
    return f"{x / 1024:9.1f}"


def _table(records: list[CensusRecord]) -> str:
    head = (
        f"{'model':<18} {'kind':<10} {'layers':>6} {'saved':>9} {'tp-part':>9} {'repl':>9} {'bwd+':>9} "
        f"{'full':>9} {'full bwd+':>9} {'select':>9} {'sel bwd+':>9}   (KiB per token)"
    )
    lines = [head]
    for r in records:
        lines.append(
            f"{r.model[:18]:<18} {r.layer_kind:<10} {r.num_layers:>6} {_kib(r.saved_bytes_per_token)} "
            f"{_kib(r.saved_tp_scaled_bytes_per_token)} {_kib(r.saved_replicated_bytes_per_token)} "
            f"{_kib(r.backward_peak_extra_bytes_per_token)} {_kib(r.full_recompute.saved_bytes_per_token)} "
            f"{_kib(r.full_recompute.backward_peak_extra_bytes_per_token)} "
            f"{_kib(r.selective.saved_bytes_per_token)} {_kib(r.selective.backward_peak_extra_bytes_per_token)}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ndplan.census", description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="preset names or config.json paths")
    ap.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    ap.add_argument("--mbs", type=int, default=1, help="micro-batch size (default 1)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--attention", default="sdpa", choices=ATTENTIONS)
    ap.add_argument("--experts", default="grouped_mm", choices=EXPERTS)
    ap.add_argument("--out", help="write the records to this census JSON file")
    args = ap.parse_args(argv)
    try:
        records: list[CensusRecord] = []
        for m in args.models:
            name, cfg = load_hf_config(m)
            records += run_census(cfg, seq_length=args.seq, micro_batch_size=args.mbs, dtype=args.dtype,
                                  attention=args.attention, experts=args.experts, name=name)
        print(_table(records))
        if args.out:
            save_census_file(args.out, records)
            print(f"wrote {len(records)} records to {args.out}")
    except NdplanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
