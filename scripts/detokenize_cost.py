"""What a streamed token's text costs at a growing length: smoe.hf.tokenizer.Detokenizer (tokenizers'
incremental decoder) against decoding the whole sequence at each token, on a book of the shared corpus.
Usage: python scripts/detokenize_cost.py [MODEL_DIR] [CORPUS_GZ]   (defaults: ../shared's qwen3-moe-28m, valid.txt.gz)"""

import gzip
import sys
import time

from smoe.hf.tokenizer import Detokenizer, load_tokenizer


def main(model: str = "../shared/models/qwen3-moe-28m", corpus: str = "../shared/corpus/valid.txt.gz") -> None:
    tok = load_tokenizer(model)
    ids = tok(gzip.open(corpus, "rt").read()[:200_000])["input_ids"][:16_000]
    for n in (1_000, 4_000, 16_000):
        text, start = Detokenizer(tok), time.perf_counter()
        for token in ids[: n - 100]:
            text.push(token)
        last = time.perf_counter()
        for token in ids[n - 100: n]:
            text.push(token)
        end = time.perf_counter()
        for i in range(n - 100, n):
            tok.decode(ids[: i + 1], skip_special_tokens=True)
        whole = (time.perf_counter() - end) / 100
        print(f"{n:>6} tokens: a token's piece {(end - last) / 100 * 1e6:.1f} us (the last 100), "
              f"{(end - start) / n * 1e6:.1f} us on average; the whole decode at that length {whole * 1e3:.2f} ms")


if __name__ == "__main__":
    main(*sys.argv[1:])
