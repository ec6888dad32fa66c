"""The table of a `scripts/files_compare.sh` log, in markdown: per file, the c=1 decode step (ITL p50) of both
servers and its ratio llama-server / nanoserve (above 1: nanoserve's step is shorter; the issue's batch-1
measure), output tok/s at each concurrency the log has with the ratio nanoserve / llama-server, and
resident memory after the first round.
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


def ratio_cell(nano: dict, llama: dict, key: str = "output_tok_per_s", inverse: bool = False) -> str:
    """Median of the per-round ratios nanoserve / llama-server of `key` (llama-server / nanoserve where
    `inverse`, for times), with their range."""
    rounds = sorted(set(nano) & set(llama))
    ratios = [(llama[k][key] / nano[k][key]) if inverse else (nano[k][key] / llama[k][key]) for k in rounds]
    cell = f"{statistics.median(ratios):.2f}x"
    return cell + (f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else "")


def main(argv: list[str]) -> None:
    runs, order = load(argv[0])
    labels = dict(a.split("=", 1) for a in argv[1:])
    # the concurrency levels the log has (files_compare.sh's LEVELS), the same for every file shown
    levels = sorted({c for runs_of in runs.values() for c in runs_of if isinstance(c, int)})
    columns = ["file"] + (["ITL p50 c=1, nanoserve / llama-server", "ratio"] if 1 in levels else [])
    columns += [name for c in levels for name in (f"c={c} tok/s", "ratio")] + ["RSS MiB nanoserve / llama-server"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    med = lambda level, key: statistics.median(r[key] for r in level.values())
    for name in order:
        n, l = runs[(name, "nanoserve")], runs.get((name, "llama-server"), {})
        if not all(c in n and c in l for c in levels):
            continue
        cells = []
        if 1 in levels:
            cells += [f"{med(n[1], 'itl_p50') * 1e3:.1f} / {med(l[1], 'itl_p50') * 1e3:.1f} ms",
                      ratio_cell(n[1], l[1], "itl_p50", inverse=True)]
        for c in levels:
            cells += [f"{med(n[c], 'output_tok_per_s'):.1f} / {med(l[c], 'output_tok_per_s'):.1f}", ratio_cell(n[c], l[c])]
        cells.append(f"{n.get('rss', '?')} / {l.get('rss', '?')}")
        print(f"| {labels.get(name, name)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
