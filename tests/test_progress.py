"""The start-up progress bar: in-place redraws on a terminal, a line per quarter in logs; weight loading
reports every stacked parameter."""

import io

import kimi_jax
from kimi_jax.progress import ProgressBar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_output_has_a_line_per_quarter():
    out = io.StringIO()
    bar = ProgressBar("compiling", unit="executables", stream=out, width=8)
    for done in range(9):
        bar(done, 8)
    lines = out.getvalue().splitlines()
    assert [line.split("] ")[-1].split(" executables")[0] for line in lines] == ["0/8", "2/8", "4/8", "6/8", "8/8"]
    assert lines[0].startswith("[kimi-jax] compiling [........]") and "[########] 8/8" in lines[-1]


def test_terminal_output_redraws_in_place_and_ends_the_line():
    out = Terminal()
    bar = ProgressBar("loading", stream=out, width=4)
    for done in range(3):
        bar(done, 2)
    text = out.getvalue()
    assert text.count("\r") == 3 and text.endswith("s\n") and text.count("\n") == 1 and "[####] 2/2" in text


def test_loading_the_shipped_tiny_model_reports_every_parameter():
    calls = []
    lm = kimi_jax.load("tiny", "float32", progress=lambda done, total: calls.append((done, total)))
    total = calls[-1][1]
    assert total > 10 and calls == [(i, total) for i in range(1, total + 1)]
    assert lm.config.num_layers > 0
