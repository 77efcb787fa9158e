"""Kimi tiktoken tokenizer, its special-token layouts, and streaming detokenisation."""

from kimi_jax.tokenizer.detokenizer import IncrementalDetokenizer
from kimi_jax.tokenizer.loader import TINY_TOKENIZER_DIR, load_tokenizer, load_tokenizer_folder, read_tiktoken_model
from kimi_jax.tokenizer.special_tokens import K2_SPECIAL_OFFSETS, K3_SPECIAL_OFFSETS, NUM_SPECIAL_IDS
from kimi_jax.tokenizer.tokenizer import KIMI_PAT_STR, Tokenizer

__all__ = ["IncrementalDetokenizer", "K2_SPECIAL_OFFSETS", "K3_SPECIAL_OFFSETS", "KIMI_PAT_STR", "NUM_SPECIAL_IDS",
           "TINY_TOKENIZER_DIR", "Tokenizer", "load_tokenizer", "load_tokenizer_folder", "read_tiktoken_model"]
