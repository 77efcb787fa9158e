"""``serve.bench.decode --peer``: the transformers + FLA peer runs in a child process on the bench's shape and its
tok/s per batch come back; a peer that fails or hangs is recorded, not fatal."""

import json
import os
import subprocess
import types

from serve.bench import decode


def bench_args(tmp_path, **kw):
    return types.SimpleNamespace(**dict(dict(preset="kimi-linear-48b", layers=4, batches=[1, 16], prompt_len=512,
                                             out=str(tmp_path), peer_timeout_s=5.0), **kw))


def test_the_peer_runs_on_the_bench_shape_and_its_rows_come_back(tmp_path, monkeypatch):
    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        out = cmd[cmd.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "bench_peer.json"), "w") as f:
            json.dump(dict(rows=[dict(batch=1, tokens_per_s=11.5), dict(batch=16, tokens_per_s=152.6)],
                           kernels="flash-linear-attention 0.6.0", transformers="5.17.0"), f)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(decode.subprocess, "run", fake_run)
    peer = decode.run_peer(bench_args(tmp_path))
    assert peer == dict(rows={1: 11.5, 16: 152.6}, kernels="flash-linear-attention 0.6.0", transformers="5.17.0")
    cmd = seen["cmd"]
    assert cmd[1:3] == ["-m", "serve.bench.peer"]
    assert cmd[cmd.index("--preset") + 1] == "kimi-linear-48b" and cmd[cmd.index("--layers") + 1] == "4"
    assert cmd[cmd.index("--batches") + 1: cmd.index("--batches") + 3] == ["1", "16"]
    assert cmd[cmd.index("--prompt-len") + 1] == "512"


def test_a_failed_or_hung_peer_is_recorded(tmp_path, monkeypatch):
    monkeypatch.setattr(decode.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "", "ModuleNotFoundError: No module named 'torch'"))
    assert decode.run_peer(bench_args(tmp_path)) == dict(error="exit 1: ModuleNotFoundError: No module named 'torch'")

    def hang(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.setattr(decode.subprocess, "run", hang)
    assert decode.run_peer(bench_args(tmp_path)) == dict(error="no result within 5 s")
