"""Start-up progress: the tqdm bar follows (done, total) callbacks to the end; weight loading reports every
stacked parameter."""

import io

import kimi_jax
from serve.progress import ProgressBar


def test_bar_follows_callbacks_and_closes_at_the_end():
    out = io.StringIO()
    bar = ProgressBar("compiling", unit="executables", stream=out)
    for done in range(9):
        bar(done, 8)
    text = out.getvalue()
    assert "[kimi-jax] compiling" in text and "8/8" in text and "executables" in text
    assert bar._bar.n == 8
    bar(8, 8)  # a repeated final call after closing is harmless
    assert out.getvalue().count("8/8") >= 1


def test_loading_the_shipped_tiny_model_reports_every_parameter():
    calls = []
    lm = kimi_jax.load("tiny", "float32", progress=lambda done, total: calls.append((done, total)))
    total = calls[-1][1]
    assert total > 10 and calls == [(i, total) for i in range(1, total + 1)]
    assert lm.config.num_layers > 0
