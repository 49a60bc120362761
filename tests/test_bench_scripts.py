"""The benchmark entry points run end to end on the CPU (tiny sizes): `bench/gpu_check.py --dry-run`
and `mlight bench`. They are measurement tools, so these tests check that they run and report, not speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from app.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_dry_run_end_to_end(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--out", str(tmp_path),
                          "--workdir", str(tmp_path / "work"), "--caps", "16", "--requests", "6"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] and all(r["equal"] for r in report["parity"])
    assert {r["family"] for r in report["parity"]} == {"mixtral", "dbrx", "qwen2_moe", "qwen3_moe", "olmoe"}
    (row,) = report["big"]
    assert {r["schedule"] for r in row["runs"]} == {"cgopipe", "s3", "s4"}
    assert all(r.get("tokens_per_s", 0) > 0 for r in row["runs"]), row["runs"]
    assert row["hf_offload"]["tokens_per_s"] > 0 and row["prediction"]["tokens_per_s"] > 0
    assert "(b) cap" in out.stdout  # the table is printed


def test_mlight_bench_prints_measured_and_predicted(capsys, demo_model):
    code = main(["bench", "--requests", "4", "--gen-len", "3", "--batch", "2", "--micro-batch", "1", "--json",
                 "--hardware", "t4"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["schedule"] for r in report["runs"]] == ["cgopipe", "s3", "s4"]
    for r in report["runs"]:
        assert r["tokens"] == 12 and r["tokens_per_s"] > 0
        assert set(r["layer_seconds"]) == set(r["predicted"]["layer_seconds"]) == {"gpu", "cpu_attn", "h2d", "d2h"}
        assert r["predicted"]["decode_tokens_per_s"] > 0
