"""`python -m kimi_jax.training.train_drafter` end to end at toy size: it trains, evaluates greedy acceptance on
held-out prompts, writes a drafter folder the engine's loader reads back, and refuses bad arguments."""

import json

import numpy as np
import pytest

import kimi_jax
from kimi_jax.training import train_drafter
from kimi_jax.weights.drafter_io import load_drafter

pytestmark = pytest.mark.slow  # ~2-3 minutes on a 2-core CPU, most of it compiling the target and drafter steps


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("drafter")
    args = train_drafter.parse_args(["--out", str(out), "--steps", "2", "--batch", "2", "--seq-len", "64",
                                     "--anchors", "2", "--eval-prompts", "2", "--eval-new", "16"])
    return out, train_drafter.train(args)


def test_writes_a_loadable_drafter_with_its_report(trained):
    out, result = trained
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "training.json", "TRAINING.md"}
    assert result["steps"] == 2 and json.loads((out / "training.json").read_text())["steps"] == 2
    heldout = result["heldout"]
    block = result["config"]["block_size"]
    per_pos = heldout["acceptance_per_position"]
    assert len(per_pos) == block - 1 and heldout["blocks"] == 2  # 2 prompts, one block after each 32-token prompt
    assert all(0.0 <= a <= 1.0 for a in per_pos)
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # a draft counts only after all before it matched
    assert heldout["mean_acceptance_length"] == pytest.approx(1.0 + sum(per_pos))
    assert f"{heldout['mean_acceptance_length']:.2f}" in (out / "TRAINING.md").read_text()
    drafter = load_drafter(str(out), kimi_jax.load("tiny", "float32").model)
    assert drafter.config.block_size == block
    assert np.isfinite(np.asarray(drafter.fc[...])).all()


@pytest.mark.parametrize("argv", [["--out", "x"], ["--out", "x", "--steps", "1", "--block-size", "17"],
                                  ["--out", "x", "--steps", "1", "--eval-new", "8"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        train_drafter.parse_args(argv)
