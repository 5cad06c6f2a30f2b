"""The variant of a variants run (`bash benchmarks/h200.sh variants`) worth a forward run.

    python benchmarks/pick_variant.py OUT/variants.json --margin 0.003   # its file, or nothing

A variants run measures the base file, copies of it with KNOBS overrides, and (by convention)
copies named `base`, `base2`, ... with none, measured first and last so that the machine's
drift over the run shows. The pick is the fastest copy that passed its gate (bitwise or
tolerance) and is faster than every base measurement by more than `margin` (a fraction); the
script prints its file, or nothing when no copy is. The pick and why go to stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GATES = ("bitwise", "tolerance")


def pick(res: dict, margin: float) -> tuple[dict | None, str]:
    """(the row of the variant to take further, or None; why) from a forward_bench result with
    variants ("variants": {name: overrides}, "winners": rows with name, file, tok_s, gate)."""
    names = set(res.get("variants") or {})
    rows = [w for w in res.get("winners") or [] if w.get("tok_s")]
    if not names or not rows:
        return None, "no variants measured"
    stem = Path(res["files"][0]).stem if res.get("files") else ""

    def variant(w: dict) -> str | None:  # the variant name of a row, None for the base file itself
        n = w["name"]
        return n[len(stem) + 1:] if n.startswith(stem + "-") and n[len(stem) + 1:] in names else None

    def is_base(w: dict) -> bool:  # the base file, or a copy named base* with no overrides
        v = variant(w)
        return w["name"] == stem if v is None else v.startswith("base") and not res["variants"][v]

    base = [w for w in rows if is_base(w)]
    if not base:
        return None, "no base measurement to compare with"
    bar = max(w["tok_s"] for w in base)
    tried = [w for w in rows if variant(w) is not None and not is_base(w) and w.get("gate") in GATES]
    if not tried:
        return None, "no variant passed its gate"
    best = max(tried, key=lambda w: w["tok_s"])
    gain = best["tok_s"] / bar - 1
    why = f"{best['name']} {best['tok_s']} tok/s against the base's best {bar} ({gain:+.2%}, margin {margin:.2%})"
    return (best if gain > margin else None), why


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", help="a variants run's JSON (forward_bench --variants --out)")
    p.add_argument("--margin", type=float, default=0.003, help="the least gain over every base measurement")
    a = p.parse_args()
    row, why = pick(json.loads(Path(a.results).read_text()), a.margin)
    print(f"pick_variant: {'take ' if row else 'none: '}{why}", file=sys.stderr)
    if row:
        print(row["file"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
