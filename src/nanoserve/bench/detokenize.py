"""`nanoserve bench detokenize`: microseconds per token of the incremental detokenizer against
re-decoding the whole output every step (the naive method), at 1 and 64 interleaved streams of 512
tokens, with and without four stop strings; cost per token near 64 and near 512 tokens of output."""
from __future__ import annotations

import argparse
import time

from nanoserve.frontend.detokenizer import IncrementalDetokenizer
from nanoserve.frontend.tokenizer import load_tokenizer
from nanoserve.model.loader import default_model_path
from nanoserve.sampling_params import SamplingParams

TEXT = ("The parrot said: the answer is 42. 鹦鹉🦜说：答案是42。 Streaming text must never show half a "
        "character 😀, nor a piece of a stop string. ")
STOPS = ["\nUser:", "###", "<|endoftext|>", "STOP HERE"]  # never present: the search runs every token


class NaiveDetokenizer:
    """Decodes every token so far at each step and returns the new suffix; stop strings are searched
    in the whole text."""

    def __init__(self, tokenizer, params: SamplingParams):
        self.tokenizer, self.stop, self.ids, self.text = tokenizer, params.stop, [], ""

    def update(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            self.text = text
        for s in self.stop:
            if s in self.text:
                break

    def get_delta(self, finished: bool = False) -> str:
        return self.text


def run(make, tokenizer, ids: list[int], streams: int, windows: list[tuple[int, int]]) -> list[float]:
    """Steps `streams` detokenizers one token each, round robin; µs per token inside each window."""
    dets = [make() for _ in range(streams)]
    spent = [0.0] * len(windows)
    for pos, token in enumerate(ids):
        start = time.perf_counter()
        for d in dets:
            d.update([token])
            d.get_delta()
        took = time.perf_counter() - start
        for w, (a, b) in enumerate(windows):
            if a <= pos < b:
                spent[w] += took
    return [s / ((b - a) * streams) * 1e6 for s, (a, b) in zip(spent, windows)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="nanoserve bench detokenize", description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--streams", default="1,64")
    args = ap.parse_args(argv)
    tokenizer = load_tokenizer(args.model or default_model_path())
    ids = []
    while len(ids) < args.tokens:
        ids += tokenizer.encode(TEXT, add_special_tokens=False)
    ids = ids[:args.tokens]
    windows = [(32, 64), (args.tokens - 32, args.tokens)]
    print(f"| streams | stop strings | method | µs/token at 64 | µs/token at {args.tokens} | naive / incremental at {args.tokens} |")
    print("|---|---|---|---|---|---|")
    for streams in [int(s) for s in args.streams.split(",")]:
        for stops in ([], STOPS):
            params = SamplingParams(stop=stops)
            inc = run(lambda: IncrementalDetokenizer(tokenizer, params), tokenizer, ids, streams, windows)
            naive = run(lambda: NaiveDetokenizer(tokenizer, params), tokenizer, ids, streams, windows)
            label = "4" if stops else "none"
            print(f"| {streams} | {label} | incremental | {inc[0]:.1f} | {inc[1]:.1f} | |")
            print(f"| {streams} | {label} | naive re-decode | {naive[0]:.1f} | {naive[1]:.1f} | "
                  f"{naive[1] / inc[1]:.1f}x |", flush=True)
