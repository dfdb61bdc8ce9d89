"""scripts/bench_report.py renders the benchmarks page, its picture and the README's headline from the benches'
JSON (no bench runs here: a report of two rows, one failed)."""

import importlib.util
from pathlib import Path
import pytest

pytestmark = pytest.mark.fast  # pure functions: no process starts (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("bench_report", ROOT / "scripts" / "bench_report.py")
report_script = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(report_script)

REPORT = {"mode": "quick", "date": "2026-01-01 00:00 UTC", "total_s": 90.0,
          "machine": {"cpu": "Test CPU", "cores": 2, "torch": "2.13.0", "python": "3.11", "os": "Linux"},
          "rows": [{"label": "ddp", "command": "parallelisms bench ddp --json", "wall_s": 45.0,
                    "result": {"ratio": 0.9, "ratio_rounds": [0.85, 0.95], "floor_ratio": 0.8, "meet_ratio": 0.88,
                               "ours_s": 0.18, "peer_s": 0.2, "peer": "torch DDP"}},
                   {"label": "zero3", "command": "parallelisms bench zero3 --json", "wall_s": 3.0,
                    "error": "error: something broke"}]}


def test_page_and_headline(tmp_path):
    page = report_script.page(REPORT, "python3 scripts/bench_report.py --quick")
    assert "| `ddp` | torch DDP | 0.900 | 0.850-0.950 | 0.800 / 0.880 |" in page
    assert "| `zero3` | failed: error: something broke |" in page
    assert "Test CPU, 2 cores" in page and "torch 2.13.0" in page and "quick mode" in page
    readme = tmp_path / "README.md"
    readme.write_text(f"top\n{report_script.BEGIN}\nold\n{report_script.END}\nbottom\n")
    report_script.rewrite_readme(REPORT, readme)
    text = readme.read_text()
    assert "old" not in text and text.startswith("top\n") and text.endswith("bottom\n")
    assert "| `ddp` | torch DDP | 0.900 (0.850-0.950) | 0.800 / 0.880 |" in text


def test_picture(tmp_path):
    report_script.draw(REPORT, tmp_path / "b.png")
    assert (tmp_path / "b.png").stat().st_size > 1000
