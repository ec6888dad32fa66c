"""The table of a `scripts/files_compare.sh` log, in markdown: per file, the c=1 decode step (ITL p50) of both
servers, output tok/s at each concurrency with the ratio nanoserve / llama-server, and resident memory
after the first round.
Figures are medians over the rounds; a ratio is the median of the rounds' ratios (each round's two
servers ran minutes apart at most), its range in brackets where there were several rounds.
Usage: python scripts/files_table.py LOG [FILE_BASENAME=LABEL ...]"""
import collections
import json
import statistics
import sys


def load(path: str):
    """{(file, server): {"rss": MiB, level: {round: report}}} and the files in their order."""
    runs: dict = collections.defaultdict(lambda: collections.defaultdict(dict))
    order: list[str] = []
    for line in open(path):
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        server, name = r["label"].split(" ", 1)
        if name not in order:
            order.append(name)
        if "rss_mib" in r:  # after the first round: llama-server's prompt cache in RAM grows with each
            runs[(name, server)].setdefault("rss", r["rss_mib"])
        else:
            runs[(name, server)][r["concurrency"]][r.get("round", 1)] = r
    return runs, order


def ratio_cell(nano: dict, llama: dict) -> str:
    """Median of the per-round ratios of output tok/s, with their range."""
    rounds = sorted(set(nano) & set(llama))
    ratios = [nano[k]["output_tok_per_s"] / llama[k]["output_tok_per_s"] for k in rounds]
    cell = f"{statistics.median(ratios):.2f}x"
    return cell + (f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else "")


def main(argv: list[str]) -> None:
    runs, order = load(argv[0])
    labels = dict(a.split("=", 1) for a in argv[1:])
    print("| file | ITL p50 c=1, nanoserve / llama-server | c=1 tok/s | ratio | c=8 tok/s | ratio | c=32 tok/s "
          "| ratio | RSS MiB nanoserve / llama-server |")
    print("|---|---|---|---|---|---|---|---|---|")
    med = lambda level, key: statistics.median(r[key] for r in level.values())
    for name in order:
        n, l = runs[(name, "nanoserve")], runs.get((name, "llama-server"), {})
        if not all(c in n and c in l for c in (1, 8, 32)):
            continue
        cells = [f"{med(n[1], 'itl_p50') * 1e3:.1f} / {med(l[1], 'itl_p50') * 1e3:.1f} ms"]
        for c in (1, 8, 32):
            cells += [f"{med(n[c], 'output_tok_per_s'):.1f} / {med(l[c], 'output_tok_per_s'):.1f}", ratio_cell(n[c], l[c])]
        cells.append(f"{n.get('rss', '?')} / {l.get('rss', '?')}")
        print(f"| {labels.get(name, name)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
