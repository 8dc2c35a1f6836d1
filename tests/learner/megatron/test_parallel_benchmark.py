"""benchmarks.parallel_train as the GPU run will start it, on the CPU: the tiny shape, gloo, two ranks."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_benchmark_reports_each_layout_against_one_device() -> None:
    command = [sys.executable, "-m", "benchmarks.parallel_train", "--shape", "tiny", "--batch", "4", "--seq", "48"]
    command += ["--dtype", "float32", "--steps", "1", "--threads", "1", "--layouts", "one,pp2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["device"] == "cpu" and report["layouts"].keys() == {"one", "pp2"}
    one, pp2 = report["layouts"]["one"], report["layouts"]["pp2"]
    assert one["devices"] == 1 and pp2["devices"] == 2
    assert one["tokens_per_s"] > 0 and pp2["tokens_per_s"] > 0 and one["grad_norm"] > 0
    assert pp2["matches_one"] and pp2["log_prob_max_abs_diff"] < 1e-5
