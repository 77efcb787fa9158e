"""The chat fine-tune end to end on the CPU at a toy budget: ``train_chat`` for 2 steps from the shipped
``tiny-code`` writes a folder laid out like the shipped ``tiny`` one, and ``serve.bench.chat_eval`` serves it
through the real server and parsers and adds its figures to the report. (Quality needs the GPU recipe.)"""

import json
import os

import pytest

from kimi_jax.api import shipped_checkpoint
from serve.bench import chat_eval

FLAGS = ["--steps", "2", "--batch", "2", "--seq-len", "128", "--code-rows", "1", "--code-tokens", "20000",
         "--eval-rows", "2", "--eval-code-tokens", "256", "--warmup", "1", "--log-every", "1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from kimi_jax.training import train_chat

    out = str(tmp_path_factory.mktemp("chat") / "tiny")
    result = train_chat.train(train_chat.parse_args(["--out", out, *FLAGS]))
    return out, result


def test_two_steps_write_a_servable_folder_like_the_shipped_one(trained):
    out, result = trained
    vision_files = {"vision.safetensors", "vision_training.json"}  # what train_vision adds to the shipped one
    assert sorted(os.listdir(out)) == sorted(set(os.listdir(shipped_checkpoint("tiny"))) - vision_files)
    assert result["recipe"] == "chat" and result["steps"] == 2 and result["init"] == "tiny-code"
    assert result["data"]["train"]["assistant_tokens"] > 0 and result["heldout_chat_targets"] > 0
    assert result["after"]["expert_load"]["pairs"] > 0  # router load measured on held-out data
    assert "--steps 2" in result["reproduce"]
    assert "chat" in open(os.path.join(out, "TRAINING.md")).read().lower()


def test_chat_eval_serves_the_folder_and_updates_its_report(trained):
    out, _ = trained
    found = chat_eval.run(out, limit=1, concurrency=4, extra=["--max-model-len=2048"])
    f = found["figures"]
    assert f["tool_calls_parsed"]["of"] == 2 and f["ask_exact"]["of"] == 1 and f["chat_empty"]["of"] >= 4
    assert len(found["empty"]) == f["chat_empty"]["count"]  # each empty answer is listed for a look at why
    from kimi_jax.training.report import update_report

    with open(os.path.join(out, "TRAINING.md"), "a") as fh:  # what train_vision appends
        fh.write("\n## Vision\n\nA tower, held-out accuracy 1.\n")
    update_report(out, {"chat_eval": found})
    with open(os.path.join(out, "training.json")) as fh:
        assert json.load(fh)["chat_eval"]["figures"] == f
    md = open(os.path.join(out, "TRAINING.md")).read()
    assert "parsed into `tool_calls`" in md
    assert md.endswith("\n## Vision\n\nA tower, held-out accuracy 1.\n") and md.count("## Vision") == 1


def test_summary_match():
    line = "Join two or more pathname components."
    assert chat_eval.summary_match(f"`os.path.join`:  {line}", line) == "exact"
    assert chat_eval.summary_match("os.path.join: Join two or more path components.", line) == "near"
    assert chat_eval.summary_match("It returns a list.", line) is None
