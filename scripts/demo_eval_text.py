"""Write models/smoe-demo-6m/eval.txt: passages of the six validation books of ../shared/corpus, which the
demo model never saw in training, for `smoe demo`'s eval (perplexity and KL of each depth).

    .venv/bin/python scripts/demo_eval_text.py [--corpus ../shared/corpus] [-o models/smoe-demo-6m/eval.txt]

From each book (in Project Gutenberg number order), the whole paragraphs of PASSAGE characters that begin
at the first paragraph break after a quarter of the book: far enough in to skip front matter, and the
same bytes on every run. Prints each passage's book and offsets, and the file's sha256.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import hashlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PASSAGE = 33_000  # characters per book: six books make about 200 KB
JOIN = "\n\n\n"  # how the corpus joins its books


def books(corpus: Path) -> list[tuple[dict, str]]:
    """(manifest row, text) of every validation book, in the order valid.txt holds them."""
    text = gzip.open(corpus / "valid.txt.gz", "rt", encoding="utf-8").read()
    with open(corpus / "manifest.tsv", newline="") as f:
        rows = {int(r["pg_id"]): r for r in csv.DictReader(f, delimiter="\t") if r["split"] == "valid"}
    found, pos = [], 0
    while pos < len(text):
        row = next(r for r in rows.values() if text_hash(text[pos : pos + int(r["chars"])]) == r["sha256_of_text"])
        end = pos + int(row["chars"])
        found.append((row, text[pos:end]))
        pos = end + len(JOIN)
    return found


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def passage(text: str) -> tuple[int, int]:
    """[start, end) of whole paragraphs, about PASSAGE characters from a quarter of the way in."""
    start = text.index("\n\n", len(text) // 4) + 2
    end = text.index("\n\n", start + PASSAGE)
    return start, end


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=ROOT.parent / "shared" / "corpus")
    ap.add_argument("-o", "--output", type=Path, default=ROOT / "models" / "smoe-demo-6m" / "eval.txt")
    args = ap.parse_args()
    parts = []
    for row, text in sorted(books(args.corpus), key=lambda b: int(b[0]["pg_id"])):
        start, end = passage(text)
        parts.append(text[start:end])
        print(f"PG #{row['pg_id']:>5}  {row['title']} ({row['author']}): characters {start:,}-{end:,} of {len(text):,}")
    data = ("\n\n\n".join(parts) + "\n").encode()
    args.output.write_bytes(data)
    print(f"{args.output}: {len(data):,} bytes, sha256 {hashlib.sha256(data).hexdigest()}")


if __name__ == "__main__":
    main()
