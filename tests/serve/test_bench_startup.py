"""The start-up bench's plumbing: its own flags and the server's are split at ``--``, and a server that cannot
start is reported in the JSON with the last line of its log and a failing exit status, not waited on and not
launched again (the real runs are GPU benchmarks: BENCHMARKS.md, start-up)."""

from __future__ import annotations

import json

from serve.bench import startup


def test_flags_split_at_the_double_dash():
    args = startup.parse_args(["--launches", "3", "--port", "9001", "--", "tiny", "--max-num-seqs", "4"])
    assert (args.launches, args.port, args.serve_args) == (3, 9001, ["tiny", "--max-num-seqs", "4"])


def test_a_server_that_fails_to_start_is_reported(tmp_path):
    status = startup.main(["--launches", "3", "--port", "8971", "--timeout-s", "120", "--out", str(tmp_path),
                           "--cache-dir", str(tmp_path / "jit"), "--", "tiny", "--no-such-flag"])
    doc = json.loads((tmp_path / "bench_startup.json").read_text())
    assert status == 1 and len(doc["launches"]) == 1
    assert "exited with status 2" in doc["launches"][0]["error"]
    assert "unrecognized arguments: --no-such-flag" in doc["launches"][0]["error"]
    assert "--no-such-flag" in (tmp_path / "startup_server_0.log").read_text()
