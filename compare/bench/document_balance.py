"""The work balance of the ring's layouts with packed documents, measured on the CPU from the block-skip table
(`python -m compare.bench.document_balance`): for each device count and document source, per layout, the tiles
each device's kernels visit over all its ring steps (`weights.documents.ring_work`, 128 x 128 tiles), and the
imbalance max / mean over the devices, mean and worst over the windows; a ring step waits for its slowest device, so
the imbalance is the step's slowdown against an even split.

Document sources: "corpus", the stdlib files as `twinflash train --pack` packs them (`weights.data.
packed_text_batches`: windows of the same corpus, the files cut at the window's edges), and "short", many short
documents (uniform 32 to 512 tokens). Prints a Markdown table and writes its rows as JSON to --out (default
out/document-balance-<date>.json).
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import numpy as np

from compare.bench.common import OUT_DIR, write_json
from weights.data import BYTE_VOCAB, packed_text_batches
from weights.documents import causal_pairs, ring_work, segment_ids_from_lengths
from weights.layout import LAYOUTS

SHORT_LENGTHS = (32, 512)  # the "short" source's document lengths, uniform in [low, high]


def short_documents(windows: int, seq_len: int, seed: int) -> np.ndarray:
    """int32 [windows, seq_len]: segment ids of documents of uniform random length in SHORT_LENGTHS."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(windows):
        lengths = rng.integers(SHORT_LENGTHS[0], SHORT_LENGTHS[1] + 1, seq_len // SHORT_LENGTHS[0] + 1)
        rows.append(segment_ids_from_lengths(list(lengths))[:seq_len])
    return np.stack(rows)


def balance_rows(segment_ids: np.ndarray, devices: list[int], block: int) -> list[dict]:
    """One row per (device count, layout): the imbalance of visited tiles (mean and worst over the windows), the
    tiles visited per device against an even split of the whole sequence's causal tiles, and the exact pairs."""
    rows = []
    causal_tiles = (segment_ids.shape[1] // block) ** 2 / 2
    pairs_share = float(np.mean(causal_pairs(segment_ids)) / (segment_ids.shape[1] ** 2 / 2))
    for world in devices:
        for layout in LAYOUTS:
            per_window = [ring_work(ids[None], world, layout, block=block) for ids in segment_ids]
            imbalance = np.array([w["visited"].max() / w["visited"].mean() for w in per_window])
            visited = np.mean([w["visited"].sum() for w in per_window])
            rows.append({"devices": world, "layout": layout, "imbalance_mean": float(imbalance.mean()),
                         "imbalance_worst": float(imbalance.max()), "visited_vs_causal": float(visited / causal_tiles),
                         "pairs_vs_causal": pairs_share})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--devices", default="2,4,8", help="comma-separated ring sizes")
    parser.add_argument("--windows", type=int, default=32, help="packed sequences per source")
    parser.add_argument("--block", type=int, default=128, help="the kernels' tile edge")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    devices = [int(d) for d in args.devices.split(",")]
    sources = {"corpus": packed_text_batches(1, args.windows, args.seq_len, BYTE_VOCAB, args.seed)[1][0],
               "short": short_documents(args.windows, args.seq_len, args.seed)}
    results = []
    print("| documents | devices | layout | imbalance mean | worst | tiles vs causal | pairs vs causal |")
    print("|---|---|---|---|---|---|---|")
    for name, ids in sources.items():
        for row in balance_rows(ids, devices, args.block):
            results.append({"documents": name, "seq_len": args.seq_len, **row})
            print(f"| {name} | {row['devices']} | {row['layout']} | {row['imbalance_mean']:.3f} | "
                  f"{row['imbalance_worst']:.3f} | {row['visited_vs_causal']:.3f} | {row['pairs_vs_causal']:.3f} |")
    write_json(args.out or OUT_DIR / f"document-balance-{datetime.date.today().isoformat()}.json",
               {"seq_len": args.seq_len, "windows": args.windows, "block": args.block, "rows": results})


if __name__ == "__main__":
    main()
