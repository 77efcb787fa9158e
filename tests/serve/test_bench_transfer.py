"""`serve/bench/transfer.py` on a tiny budget: it times every copy and reports the request's full size."""

from __future__ import annotations

import pytest

from serve.bench.transfer import main, measure


def test_transfer_bench_reports_the_request_bytes():
    got = measure("tiny", tokens=64, block_size=16, repeats=1)
    assert got["pages"] == 4
    assert got["bytes"] == 4 * got["page_bytes"] + got["slot_bytes"]
    assert got["wire_bytes"] >= got["bytes"]
    assert all(got[k] > 0 for k in ("save_s", "load_s", "encode_s", "decode_s"))


def test_transfer_bench_refuses_a_partial_page():
    with pytest.raises(SystemExit):
        main(["--preset", "tiny", "--tokens", "20", "--block-size", "16"])
