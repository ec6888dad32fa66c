"""The benchmark scripts' own logic: scripts/files_table.py's medians and paired ratios over rounds, and
scripts/kernels_ab.py and scripts/steps_ab.py run end to end on a small product and a few decode steps
(both builds from this checkout)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import files_table  # noqa: E402
from backends import requires_kernels  # noqa: E402


def report(label, round_, level, tok_s, itl=0.01):
    return json.dumps({"label": label, "round": round_, "concurrency": level, "output_tok_per_s": tok_s,
                       "itl_p50": itl})


def test_files_table_takes_medians_and_pairs_ratios_by_round(tmp_path, capsys):
    lines = []
    # nanoserve 2x, 3x and 1x llama-server in three rounds at c=32: the median of the paired ratios is 2x
    # (a median of each server's tok/s apart would read 300 / 100 = 3x)
    for r, (nano, llama) in enumerate([(200, 100), (300, 100), (400, 400)], start=1):
        for level in (1, 8):
            lines += [report("nanoserve f", r, level, 50, itl=0.005 * r), report("llama-server f", r, level, 25)]
        lines += [report("nanoserve f", r, 32, nano), report("llama-server f", r, 32, llama)]
    # resident memory after the first round (llama-server's prompt cache grows in later ones)
    lines += ['{"round": 1, "label": "nanoserve f", "rss_mib": 900}', '{"round": 1, "label": "llama-server f", "rss_mib": 700}',
              '{"round": 2, "label": "nanoserve f", "rss_mib": 901}', '{"round": 2, "label": "llama-server f", "rss_mib": 1000}']
    # a file only one server ran is left out of the table
    lines.append(report("nanoserve g", 1, 1, 10))
    log = tmp_path / "log"
    log.write_text("\n".join(lines) + "\nnot json\n")
    files_table.main([str(log), "f=File F"])
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 3  # header, rule, one file
    cells = [c.strip() for c in out[2].strip("|").split("|")]
    assert cells[0] == "File F"
    assert cells[1] == "10.0 / 10.0 ms"  # ITL p50 medians: 5, 10, 15 ms and 10 ms
    assert cells[2] == "1.00x (0.67-2.00)"  # llama-server's step / nanoserve's, paired by round
    assert cells[4] == "2.00x (2.00-2.00)"
    assert cells[8] == "2.00x (1.00-3.00)"
    assert cells[7] == "300.0 / 100.0"
    assert cells[9] == "900 / 700"


def test_files_table_reads_logs_without_rounds(tmp_path, capsys):
    lines = [report(f"{s} f", 1, c, t) for c in (1, 8, 32) for s, t in (("nanoserve", 30), ("llama-server", 20))]
    log = tmp_path / "log"
    log.write_text("\n".join(json.dumps({k: v for k, v in json.loads(l).items() if k != "round"}) for l in lines))
    files_table.main([str(log)])
    row = capsys.readouterr().out.strip().splitlines()[2]
    assert "| f |" in row and "1.50x |" in row and "(" not in row.split("|")[5]


def test_files_table_shows_the_levels_the_log_has(tmp_path, capsys):
    """A batch-1 run (files_compare.sh with LEVELS=1): the ITL columns and c=1 only."""
    lines = [report(f"{s} f", r, 1, t, itl=i) for r in (1, 2) for s, t, i in (("nanoserve", 40, 0.020), ("llama-server", 36, 0.024))]
    log = tmp_path / "log"
    log.write_text("\n".join(lines))
    files_table.main([str(log)])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].count("|") == out[1].count("|") == out[2].count("|") == 7
    assert "c=8" not in out[0] and "c=32" not in out[0]
    cells = [c.strip() for c in out[2].strip("|").split("|")]
    assert cells[1:5] == ["20.0 / 24.0 ms", "1.20x (1.20-1.20)", "40.0 / 36.0", "1.11x (1.11-1.11)"]


@requires_kernels
def test_kernels_ab_compares_two_kernel_builds():
    """Against a directory of sources (the checkout's own, so no git history is needed): two backends
    loaded side by side, every product timed on each, a ratio per type and row count."""
    kernels = os.path.join(ROOT, "src", "nanoserve", "kernels")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "kernels_ab.py"), "--base-dir", kernels,
                          "--types", "Q4_K,Q8_0", "--n", "64", "--k", "256", "--rows", "1,32", "--rounds", "4",
                          "--copies-mib", "1"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    rows = [l for l in out.stdout.splitlines() if " rows " in l]
    assert len(rows) == 4
    for line in rows:
        ratio = float(line.split("base / working tree ")[1].split("x")[0])
        assert ratio > 0


@requires_kernels
def test_steps_ab_times_decode_steps_on_two_kernel_builds(smollm_path):
    """The default model's decode steps on two backends swapped round by round in one engine."""
    kernels = os.path.join(ROOT, "src", "nanoserve", "kernels")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "steps_ab.py"), smollm_path, "--base-dir",
                          kernels, "--rows", "3", "--tokens", "4", "--rounds", "2", "--kv-cache-memory", "0.05"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert "3 rows a step" in out.stdout and "of 2 rounds" in last
    assert float(last.split("base / working tree ")[1].split("x")[0]) > 0
