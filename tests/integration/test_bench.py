"""`improved bench` as an operator runs it, kept short: the figures say which applier made them
and that the clock stopped on a read-back of the last outcome, the ceiling and the writes per
proposal are measured in the same run, and nothing is left under the temp dir, also after
Ctrl-C."""

from __future__ import annotations

import json
import os
import signal as signals
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli import ENV, IMPROVED

ROOT = Path(__file__).resolve().parents[2]


def bench(tmp_path, *args: str, **kw):
    temp = tmp_path / "temp"
    temp.mkdir(exist_ok=True)
    env = {**ENV, "TMPDIR": str(temp)}
    return temp, [*IMPROVED, "bench", *args], dict(cwd=tmp_path, env=env, **kw)


@pytest.mark.parametrize("applier", ["ranking", "instant"])
def test_a_short_bench_reports_durable_figures_and_leaves_no_temp_dir(tmp_path, applier):
    out = tmp_path / "bench.json"
    temp, argv, kw = bench(tmp_path, "-n", "40", "-c", "20", "--applier", applier,
                           "--mix", "l0=0.3,l3=0.4,l2=0.2,reject=0.1",
                           "--json", str(out))
    result = subprocess.run(argv, capture_output=True, text=True, timeout=110, **kw)
    assert result.returncode == 0, result.stdout + result.stderr
    r = json.loads(out.read_text())
    assert r["completed"] == 40
    assert r["durable_read_back"] is True
    assert "read back from IMPROVE_AUDIT" in r["clock_stop"]
    assert r["applier"]["name"] == applier
    assert f"applier {applier}" in result.stdout
    # the loop's writes, counted from the streams: every proposal is a trailer or more, and
    # the ceiling was measured on as many streams as the loop wrote
    streams = r["writes"]["streams"]
    assert streams["IMPROVE_AUDIT"]["per_proposal"] >= 1
    assert r["writes"]["fsyncd_per_proposal"] > 3
    assert r["broker"]["ceiling"]["streams"] == sum(
        1 for v in streams.values() if v["by"] == "loop")
    assert r["broker"]["ceiling"]["messages_per_s"] > 0
    assert 0 < r["ratio_transitions_to_ceiling"]
    # the whole loop: a learn-back signal per applied proposal, published by another process
    assert r["learn_back"] is True
    assert "learn-back" in r["clock_stop"]
    assert streams["IMPROVE_IN"]["per_proposal"] > 1  # the proposals and their signals
    assert set(r["cpu_ms_per_proposal"]) == {"daemon", "broker", "applier and clock",
                                             "publisher"}
    assert all(ms > 0 for ms in r["cpu_ms_per_proposal"].values())
    assert r["broker"]["atomic_ceiling"]["messages_per_s"] > 0
    assert "atomic batches" in r["broker"]["atomic_ceiling"]["pattern"]
    # verify and rebuild ran as an operator runs them, and found the log whole
    assert r["verify"]["verify"]["exit"] == 0 and r["verify"]["rebuild"]["exit"] == 0
    assert r["verify"]["trailers"] >= r["audited_transitions"]
    applier_streams = {name for name, v in streams.items() if v["by"] == "applier"}
    if applier == "ranking":  # the reference stores persisted every apply
        assert {"KV_skillapplies_bench", "KV_rank_bench"} <= applier_streams
    else:
        assert not applier_streams
    assert list(temp.iterdir()) == []


@pytest.mark.slow  # half a minute: with the fault suites, not in the default run
def test_an_interrupted_bench_stops_everything_and_leaves_no_temp_dir(tmp_path):
    temp, argv, kw = bench(tmp_path, "-n", "2000", "-c", "50")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kw)
    try:
        deadline = time.monotonic() + 60
        while not any((d / "daemon").is_dir() for d in temp.iterdir()):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        time.sleep(2)  # the daemon up, proposals flowing
        assert proc.poll() is None
        proc.send_signal(signals.SIGINT)  # Ctrl-C
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert list(temp.iterdir()) == []
    assert not [line for line in os.popen(f"ps -eo args | grep -F '{temp}' | grep -v grep")]


@pytest.mark.slow  # half a minute: with the fault suites, not in the default run
def test_paced_runs_report_latency_by_class_at_three_shares_of_the_peak(tmp_path):
    out = tmp_path / "bench.json"
    temp, argv, kw = bench(tmp_path, "-n", "40", "-c", "20", "--paced", "--paced-n", "60",
                           "--no-learn-back",
                           "--mix", "l0=0.3,l3=0.4,l2=0.2,reject=0.1", "--json", str(out))
    result = subprocess.run(argv, capture_output=True, text=True, timeout=170, **kw)
    assert result.returncode == 0, result.stdout + result.stderr
    r = json.loads(out.read_text())
    assert r["learn_back"] is False and "learn-back" not in r["clock_stop"]
    assert [p["share_of_peak"] for p in r["paced"]] == [0.25, 0.5, 0.9]
    for p in r["paced"]:
        assert p["completed"] == p["proposals"]
        assert p["latency_by_kind"]["l3"]["publish→applied"]["n"] > 0
        assert p["latency_by_kind"]["reject"]["publish→applied"]["n"] == 0
    assert "paced 50% of peak" in result.stdout
    assert list(temp.iterdir()) == []


@pytest.mark.slow  # a server, a daemon and an applier of its own
def test_the_outside_yardstick_reads_the_loop_back_from_the_wire_alone(tmp_path):
    """benchmarks/loop_from_outside.py: every proposal's `applied` trailer read back from the
    audit stream (a commit's trailers too), the broker's ceiling, the streams' writes and the
    daemon's messages counted, and nothing left behind."""
    out, temp = tmp_path / "outside.json", tmp_path / "temp"
    temp.mkdir()
    script = ROOT / "benchmarks" / "loop_from_outside.py"
    result = subprocess.run([sys.executable, str(script), "-n", "60", "--json", str(out)],
                            capture_output=True, text=True, timeout=120,
                            env={**ENV, "TMPDIR": str(temp)})
    assert result.returncode == 0, result.stdout + result.stderr
    r = json.loads(out.read_text())
    assert r["n"] == 60 and r["proposals_per_s"] > 0 and r["ceiling"]["messages_per_s"] > 0
    assert r["writes_per_proposal"]["IMPROVE_AUDIT"] == 2.0  # a commit, then the outcome
    assert r["writes_per_proposal"]["IMPROVE_IN"] == 1.0
    assert r["messages_per_proposal"]["improved"]["in_msgs"] > 0
    assert "proposals/s" in result.stdout
    assert list(temp.iterdir()) == []
