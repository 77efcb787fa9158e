"""Kimi special-token layouts: the 256 ids right after the BPE ranks.

Kimi tokenizers reserve exactly 256 special ids starting at `num_bpe_ranks` (163584 for K2/K3, 3840 for the
embedded `tiny` tokenizer). Named tokens sit at fixed offsets in that block; every other id in the block is
`<|reserved_token_{id}|>`, like `tokenization_kimi.py` fills it.
"""

NUM_SPECIAL_IDS = 256

# K3 names by offset from the first special id (spec KIMI_K3.md section 8.1: [BOS] = 163584 -> offset 0).
K3_SPECIAL_OFFSETS: dict[str, int] = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|end_of_msg|>": 2,
    "<|open|>": 3,
    "<|close|>": 4,
    "<|sep|>": 5,
    "[start_header_id]": 6,
    "[end_header_id]": 7,
    "[EOT]": 9,
    "<|media_begin|>": 18,
    "<|media_content|>": 19,
    "<|media_end|>": 20,
    "<|media_pad|>": 21,
    "<osagent_mode>": 65,
    "[UNK]": 254,
    "[PAD]": 255,
}

# Kimi K2 / Kimi-Linear names (spec section 8.3); ids 163586..163589 mean different things than in K3.
K2_SPECIAL_OFFSETS: dict[str, int] = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|start_header_id|>": 6,
    "<|end_header_id|>": 7,
    "[EOT]": 9,
    "<|im_system|>": 10,
    "<|tool_calls_section_begin|>": 11,
    "<|tool_calls_section_end|>": 12,
    "<|tool_call_begin|>": 13,
    "<|tool_call_argument_begin|>": 14,
    "<|tool_call_end|>": 15,
    "<|im_middle|>": 17,
    "<|media_begin|>": 18,
    "<|media_content|>": 19,
    "<|media_end|>": 20,
    "<|media_pad|>": 21,
    "<think>": 22,
    "</think>": 23,
    "[UNK]": 254,
    "[PAD]": 255,
}

# bos / eos / pad names per layout; eos is the end-of-turn token the engine stops on.
K3_ROLE_TOKENS = {"bos": "[BOS]", "eos": "<|end_of_msg|>", "pad": "[PAD]"}
K2_ROLE_TOKENS = {"bos": "[BOS]", "eos": "<|im_end|>", "pad": "[PAD]"}


def reserved_token_name(token_id: int) -> str:
    """Name of an unnamed id in the special block, as the real Kimi tokenizer spells it."""
    return f"<|reserved_token_{token_id}|>"


def special_block(num_bpe_ranks: int, names_by_id: dict[int, str]) -> dict[str, int]:
    """All 256 special tokens: the given names at their ids, the rest reserved.

    Args:
      num_bpe_ranks: number of BPE ranks; the block is [num_bpe_ranks, num_bpe_ranks + 256).
      names_by_id: absolute id -> name; ids outside the block are ignored (K2's HF defaults such as
        `<|im_end|>` at >= 163840 are out of embedding range, spec section 8.1 caveat).
    Returns:
      name -> id for every id of the block.
    Raises:
      ValueError: if one name is given to two ids.
    """
    block = range(num_bpe_ranks, num_bpe_ranks + NUM_SPECIAL_IDS)
    special: dict[str, int] = {}
    for token_id in block:
        name = names_by_id.get(token_id, reserved_token_name(token_id))
        if name in special:
            raise ValueError(f"special token {name!r} is given to ids {special[name]} and {token_id}")
        special[name] = token_id
    return special


def layout_names_by_id(num_bpe_ranks: int, offsets: dict[str, int]) -> dict[int, str]:
    """A named layout (K3_SPECIAL_OFFSETS or K2_SPECIAL_OFFSETS) placed after `num_bpe_ranks` ranks."""
    return {num_bpe_ranks + offset: name for name, offset in offsets.items()}
