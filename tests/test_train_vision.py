"""The tiny vision-language fine-tune: drawn data, rows rendered like the server's prompts, the trainable copy
of an MXFP4 checkpoint, and a two-step run of the script that writes a checkpoint the serving loader reads."""

import json
import os
import random

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kimi_jax
from kimi_jax.chat.media import MEDIA_PAD
from kimi_jax.model import KimiModel
from kimi_jax.presets import tiny
from kimi_jax.tokenizer import load_tokenizer
from kimi_jax.training import export, train_vision
from kimi_jax.training.shapes import COLOURS, SHAPES, TASKS, make_example, shape_scene
from kimi_jax.training.vision_data import make_batch, prompt_ids, row_ids, text_pool
from kimi_jax.training.vision_eval import TEXT_PROMPTS, text_check
from kimi_jax.vision import VisionConfig
from kimi_jax.vision.preprocess import prepare_pil

TINY = os.path.join(os.path.dirname(kimi_jax.__file__), "assets", "tiny")
CFG = VisionConfig(text_hidden_size=256, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                   pos_emb_height=8, pos_emb_width=8, max_patches=64)


def test_examples_are_seeded_and_answerable():
    a = [make_example(random.Random(5)) for _ in range(3)]
    b = [make_example(random.Random(5)) for _ in range(3)]
    assert [(e.question, e.answer) for e in a] == [(e.question, e.answer) for e in b]
    rng = random.Random(1)
    for task in TASKS:
        for _ in range(20):
            e = make_example(rng, task)
            allowed = {"colour": set(COLOURS), "shape": set(SHAPES), "count": {"1", "2", "3"},
                       "digit": set("0123456789")}[task]
            assert e.answer in allowed and e.task == task


def test_scene_colours_are_drawn_where_stated():
    rng = random.Random(3)
    for _ in range(10):
        image, facts = shape_scene(rng, (160, 160))
        pixels = np.asarray(image).reshape(-1, 3).astype(int)
        for colour in facts.values():  # some pixels lie within the jitter of the stated colour
            near = np.abs(pixels - np.asarray(COLOURS[colour])).max(axis=1) <= 25
            assert near.sum() > 100, colour


def test_rows_are_the_served_prompt_plus_the_answer():
    tok = load_tokenizer("tiny")
    e = make_example(random.Random(2), "colour")
    image = prepare_pil(e.image, CFG, b"")
    for thinking in (True, False):
        ids, start = row_ids(tok, e, image, thinking)
        assert ids[:start] == prompt_ids(tok, e.question, image, thinking)
        assert ids.count(tok.special_tokens[MEDIA_PAD]) == image.num_tokens
        assert e.answer in tok.decode(ids[start:]) and tok.decode(ids[-1:]) == "<|end_of_msg|>"
    batch = make_batch(random.Random(4), tok, CFG, 4096, 3, 192)
    assert batch.tokens.shape == (3, 192) and batch.images.pixels.shape == (3, 64, CFG.patch_dim)
    assert batch.text_tokens.shape[0] == 0
    for b in range(3):
        image_rows = batch.tokens[b] >= 4096
        assert image_rows.sum() == batch.images.valid[b].sum() // 4  # one id per merged token
        assert list(batch.tokens[b][image_rows] - 4096) == list(range(image_rows.sum()))
        assert batch.mask[b].sum() > 0 and not (batch.mask[b] * image_rows).any()


def test_rehearsal_rows_are_text_conversations_with_their_assistant_mask():
    from kimi_jax.training.chat_batches import ConversationEncoder
    from kimi_jax.training.stdlib_docs import DocEntry
    from kimi_jax.training.transcripts import build_conversations

    tok = load_tokenizer("tiny")
    entries = [DocEntry("os.path.join", "os.path", "function", "(a, *p)", "Join two or more pathname components.",
                        "Join two or more pathname components."),
               DocEntry("json.dumps", "json", "function", "(obj)", "Serialize obj to a JSON formatted str.",
                        "Serialize obj to a JSON formatted str.")]
    conversations = build_conversations(entries, seed=0, calculator=1, greeting=1)
    encoded = [ConversationEncoder(tok)(c) for c in conversations]
    pool = text_pool(tok, conversations, 500)
    assert 0 < len(pool) == sum(len(ids) <= 501 for ids, _ in encoded) < len(encoded)  # the long ones left out
    batch = make_batch(random.Random(4), tok, CFG, 4096, 3, 192, text_rows=2, text_length=500, text=pool)
    assert batch.tokens.shape == (3, 192) and batch.text_tokens.shape == (2, 500)
    for b in range(2):  # a pooled conversation, no image ids, the loss on its assistant tokens only
        ids, learned = next((i, m) for i, m in pool if np.array_equal(batch.text_tokens[b, :len(i) - 1], i[:-1]))
        assert not (batch.text_tokens[b] >= 4096).any()
        assert np.array_equal(batch.text_mask[b, :len(ids) - 1], learned[1:])
        assert batch.text_mask[b, len(ids) - 1:].sum() == 0 and batch.text_mask[b].sum() > 0
        assert np.array_equal(batch.text_targets[b, :len(ids) - 1], ids[1:])


def test_rehearsal_rows_join_the_loss():
    """The loss is the mean over every learned target of both row kinds (one batch shape, so one compile)."""
    from kimi_jax.training.vision_trainer import VisionTrainer
    from kimi_jax.vision.tower import VisionModel

    cfg = tiny().replace(experts_mxfp4=False, num_layers=2, layer_types=("kda", "mla"), mlp_types=("dense", "moe"))
    lm = KimiModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    vcfg = VisionConfig(text_hidden_size=cfg.hidden_size, hidden_size=32, num_layers=1, num_heads=2,
                        intermediate_size=64, pos_emb_height=8, pos_emb_width=8, max_patches=64)
    trainer = VisionTrainer(lm, VisionModel(vcfg, rngs=nnx.Rngs(1)))
    rng = np.random.default_rng(0)
    text = [(rng.integers(1, 4000, 40), (np.arange(40) >= 20).astype(np.uint8))]
    mixed = make_batch(random.Random(5), load_tokenizer("tiny"), vcfg, cfg.vocab_size, 2, 64, text_rows=1,
                       text_length=48, text=text)
    loss = lambda b: float(trainer.grad_fn(trainer.params, b)[0])
    scenes = mixed.__class__(**{**mixed.__dict__, "text_mask": np.zeros_like(mixed.text_mask)})
    text_only = mixed.__class__(**{**mixed.__dict__, "mask": np.zeros_like(mixed.mask)})
    assert loss(text_only) > 1.0  # a random model's text rows are scored (log 4096 = 8.3), not skipped
    n_scene, n_text = mixed.mask.sum(), mixed.text_mask.sum()
    want = (loss(scenes) * n_scene + loss(text_only) * n_text) / (n_scene + n_text)
    assert loss(mixed) == pytest.approx(want, rel=1e-5)


def test_dequantized_model_is_the_mxfp4_round_trip():
    model = KimiModel(tiny().replace(experts_mxfp4=False, num_layers=2, layer_types=("kda", "mla"),
                                     mlp_types=("dense", "moe")), dtype=jnp.float32, rngs=nnx.Rngs(0))
    back = export.dequantized_model(export.mxfp4_model(model, dtype=jnp.float32))
    want = export.fake_quantized_experts(model)
    assert not back.config.experts_mxfp4
    assert np.array_equal(np.asarray(back.moe.w2[...]), np.asarray(want.moe.w2[...]))
    assert np.array_equal(np.asarray(back.embed[...]), np.asarray(model.embed[...]))


def test_two_steps_write_a_servable_checkpoint(tmp_path):
    out = str(tmp_path / "vl")
    result = train_vision.main(["--base", TINY, "--out", out, "--steps", "2", "--batch", "2", "--warmup", "1",
                                "--vision-hidden", "32", "--vision-layers", "1", "--vision-heads", "2",
                                "--eval-per-task", "1", "--log-every", "1"])
    assert set(result["accuracy"]) == set(TASKS) and result["steps"] == 2
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["vision_config"]["hidden_size"] == 32
    report = open(os.path.join(out, "TRAINING.md")).read()
    assert "## Vision" in report and "| What does os.path.join do? |" in report
    assert len(result["text_check"]["pairs"]) == len(TEXT_PROMPTS) and 0 <= result["text_check"]["same_reply"] <= 1
    lm = kimi_jax.load(out, "float32")
    assert lm.vision is not None and lm.vision.config.text_hidden_size == lm.config.hidden_size
    assert load_tokenizer(out).special_tokens[MEDIA_PAD] == load_tokenizer("tiny").special_tokens[MEDIA_PAD]


def test_text_check_counts_unchanged_and_empty_replies():
    check = text_check(["a", "b", ""], ["a", "c", "d"], prompts=("p", "q", "r"))
    assert check["same_reply"] == pytest.approx(1 / 3)
    assert check["nonempty_base"] == pytest.approx(2 / 3) and check["nonempty_new"] == 1.0
    assert check["pairs"][1] == dict(prompt="q", base="b", new="c")


def test_time_budget_fits_the_step_count():
    assert train_vision.steps_within(100.0, 0.5, 21, 600) == 221
    assert train_vision.steps_within(1000.0, 0.5, 21, 600) == 600  # capped at --steps
    assert train_vision.steps_within(-5.0, 0.5, 21, 600) == 21  # already over: stop now
