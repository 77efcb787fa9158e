"""Images through the engine on the small random hybrid model of test_engine_runner.py plus a small random
vision tower: greedy outputs equal a cache-free reference (every image encoded alone, the whole sequence
recomputed for each token) whatever the chunking, batching or prefix-cache hit; two different images behind
identical placeholder ids never share pages or checkpoints; each image is encoded once, images of a step in one
launch; media rows return to free; nothing compiles after warm-up."""

from __future__ import annotations

import dataclasses
import functools
import io

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from kimi_jax.step import StepInputs
from kimi_jax.vision import VisionConfig, VisionModel, prepare_image
from kimi_jax.vision.tower import encode_images, pack_images
from serve.engine import EngineConfig
from serve.engine.engine import LLMEngine
from serve.engine.media import ImageSpan, cache_key_ids, find_spans
from serve.engine.runner import ModelRunner
from tests.serve.test_engine_runner import BLOCK, RUNNER_CONFIG, SMALL, greedy, run, shared_lm

PAD = 3861  # <|media_pad|> of the tiny tokenizer's special block
VISION = VisionConfig(text_hidden_size=SMALL.hidden_size, hidden_size=32, num_layers=1, num_heads=2,
                      intermediate_size=64, pos_emb_height=4, pos_emb_width=4, max_patches=64)


@functools.cache
def vision() -> VisionModel:
    model = VisionModel(VISION, dtype=jnp.float32, rngs=nnx.Rngs(7))
    model.proj2[...] = model.proj2[...] * 8.0  # image rows as large as token embeddings, so images matter
    return model


@functools.cache
def runner() -> ModelRunner:
    """One mixed bucket (T=64, N=8), the decode bucket and its greedy variant, copy, poison, one encoder."""
    config = EngineConfig(**{**RUNNER_CONFIG.__dict__, "token_buckets": (64,), "media_pool_rows": 24})
    return ModelRunner(shared_lm(), config, vision=vision())


def engine(**scheduling) -> LLMEngine:
    return LLMEngine(runner(), config=EngineConfig(block_size=BLOCK, **scheduling))


def png(color, size=(56, 56), square=None) -> bytes:
    image = Image.new("RGB", size, color)
    if square is not None:
        image.paste(square, (size[0] // 4, size[1] // 4, size[0] // 2, size[1] // 2))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


IMAGES = {"red": prepare_image(png((200, 30, 30)), VISION), "blue": prepare_image(png((30, 30, 200)), VISION),
          "big": prepare_image(png((20, 160, 20), (112, 112), (250, 250, 0)), VISION)}  # 4, 4 and 16 tokens
_rng = np.random.default_rng(99)
HEAD = _rng.integers(2, 3800, 13).tolist()
TAIL = _rng.integers(2, 3800, 5).tolist()


def prompt(*names: str) -> tuple[list[int], list[ImageSpan]]:
    ids = list(HEAD)
    for k, name in enumerate(names):
        ids += [PAD] * IMAGES[name].num_tokens + ([7 + k] if k + 1 < len(names) else [])
    ids += TAIL
    return ids, find_spans(ids, PAD, [IMAGES[n] for n in names])


def reference(names: tuple[str, ...], steps: int = 8) -> list[int]:
    """Greedy tokens from full recomputation: each image encoded alone, its rows fed through the media pool."""
    ids, spans = prompt(*names)
    lm = shared_lm()
    rows, feed = [], list(ids)
    for span in spans:
        batch = pack_images([span.image], 1, span.image.num_patches, VISION)
        out = np.asarray(encode_images(vision(), batch))[0]
        feed[span.start:span.end] = [SMALL.vocab_size + len(rows) + j for j in range(span.num_tokens)]
        rows += list(out)
    media = jnp.asarray(np.pad(np.stack(rows), ((0, 64 - len(rows)), (0, 0))))
    tokens = []
    for _ in range(steps):
        seq = feed + tokens
        n = len(seq)
        cache = dataclasses.replace(lm.new_cache(1, 64), media=jnp.array(media))  # the step donates it
        step = StepInputs(token_ids=jnp.asarray(seq, jnp.int32), cu_seqlens=jnp.asarray([0, n], jnp.int32),
                          context_lens=jnp.zeros(1, jnp.int32),
                          block_tables=jnp.arange(1, 17, dtype=jnp.int32)[None], state_slots=jnp.ones(1, jnp.int32),
                          logits_indices=jnp.asarray([n - 1], jnp.int32),
                          checkpoint_positions=jnp.full((1, 0), -1, jnp.int32),
                          checkpoint_slots=jnp.zeros((1, 0), jnp.int32))
        logits, _ = lm.step(cache, step)
        tokens.append(int(np.argmax(np.asarray(logits)[0])))
    return tokens


@pytest.fixture(scope="module")
def refs() -> dict[tuple, list[int]]:
    cases = [("red",), ("blue",), ("big",), ("red", "blue")]
    out = {c: reference(c) for c in cases}
    runner()
    return out


def add(eng: LLMEngine, rid: str, names: tuple[str, ...]) -> None:
    ids, spans = prompt(*names)
    eng.add_request(rid, ids, greedy(), media=spans)


def assert_free(eng: LLMEngine) -> None:
    cache = eng.scheduler.cache
    assert eng.is_idle() and cache.media.num_free == cache.media.num_rows - 1
    cache.clear_prefix_cache()
    assert cache.pages.pool.num_free == cache.pages.pool.num_usable


def test_images_matter_and_differ(refs):
    assert refs[("red",)] != refs[("blue",)]  # otherwise the isolation test below could not fail


def test_greedy_equals_reference_batched_and_chunked(refs):
    # 32 vision tokens for a 24-row pool: some requests wait for rows; then chunks of 8 that split every image
    for budget in (64, 8):
        eng = engine(max_num_batched_tokens=budget, max_num_seqs=8, enable_prefix_caching=False)
        for case in refs:
            add(eng, "+".join(case), case)
        done = run(eng)
        assert {tuple(k.split("+")): v.outputs[0].token_ids for k, v in done.items()} == refs
        assert_free(eng)


def test_two_images_of_a_step_are_encoded_in_one_launch(refs):
    eng = engine(max_num_batched_tokens=64)
    before = runner().encoder.launches
    add(eng, "r", ("red",))
    add(eng, "rb", ("red", "blue"))
    done = run(eng)
    assert runner().encoder.launches == before + 1  # three images, one launch of the 4-lane bucket
    assert done["rb"].outputs[0].token_ids == refs[("red", "blue")]
    assert_free(eng)


def test_prefix_cache_never_shares_across_different_images(refs):
    eng = engine(max_num_batched_tokens=64)
    add(eng, "red", ("red",))
    first = run(eng)["red"]
    assert first.outputs[0].token_ids == refs[("red",)]
    add(eng, "blue", ("blue",))  # same ids as "red" (the placeholders), another image
    blue = run(eng)["blue"]
    assert blue.outputs[0].token_ids == refs[("blue",)]
    assert blue.metrics.num_cached_tokens <= len(HEAD)  # nothing at or past the image came from "red"
    launches = runner().encoder.launches
    add(eng, "red again", ("red",))
    again = run(eng)["red again"]
    assert again.outputs[0].token_ids == refs[("red",)]
    assert again.metrics.num_cached_tokens > len(HEAD) + IMAGES["red"].num_tokens  # hit past the image
    assert runner().encoder.launches == launches  # the hit covers the image: not encoded again
    assert_free(eng)


def test_cache_keys_follow_image_content():
    ids, spans = prompt("red")
    _, other = prompt("blue")
    assert cache_key_ids(ids, spans) != cache_key_ids(ids, other)
    assert cache_key_ids(ids, spans) == cache_key_ids(list(ids), prompt("red")[1])
    assert cache_key_ids(ids, spans)[:len(HEAD)] == HEAD


def test_bad_media_requests_are_value_errors():
    eng = engine()
    ids, spans = prompt("big", "big")  # 32 vision tokens, the pool holds 24
    with pytest.raises(ValueError, match="at most 24"):
        eng.add_request("x", ids, greedy(), media=spans)
    with pytest.raises(ValueError, match="placeholder"):
        find_spans(prompt("red")[0], PAD, [IMAGES["big"]])
    text_only = LLMEngine(runner_without_vision(), config=EngineConfig(block_size=BLOCK))
    with pytest.raises(ValueError, match="no vision encoder"):
        text_only.add_request("y", *prompt("red")[:1], greedy(), media=prompt("red")[1])


def runner_without_vision():
    from tests.serve.test_engine_runner import shared_runner

    return shared_runner()
