"""Load a Kimi tokenizer from a checkpoint folder (`tiktoken.model` + `tokenizer_config.json`) or a preset."""

import base64
import json
from pathlib import Path

from kimi_jax.tokenizer.special_tokens import (K2_ROLE_TOKENS, K2_SPECIAL_OFFSETS, K3_ROLE_TOKENS,
                                               K3_SPECIAL_OFFSETS, layout_names_by_id, special_block)
from kimi_jax.tokenizer.tokenizer import Tokenizer

ASSETS = Path(__file__).resolve().parent.parent / "assets"
TINY_TOKENIZER_DIR = ASSETS / "tiny"
SHIPPED = ("tiny", "tiny-code")  # presets whose checkpoint (and tokenizer) ship in the package


def read_tiktoken_model(path: str | Path) -> dict[bytes, int]:
    """Parse a tiktoken rank file: one `base64(token bytes) rank` pair per line."""
    ranks: dict[bytes, int] = {}
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            fields = line.split()
            if not fields:
                continue
            if len(fields) != 2 or not fields[1].isdigit():
                raise ValueError(f"{path}:{line_number}: expected 'base64 rank', got {line.strip()!r}")
            token = base64.b64decode(fields[0], validate=True)
            if token in ranks:
                raise ValueError(f"{path}:{line_number}: token {token!r} listed twice")
            ranks[token] = int(fields[1])
    return ranks


def _token_name(entry) -> str | None:
    """A tokenizer_config token field: a plain string, an AddedToken dict, or null."""
    return entry.get("content") if isinstance(entry, dict) else entry


def _generation_eos_ids(folder: Path) -> list[int]:
    path = folder / "generation_config.json"
    if not path.exists():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def load_tokenizer_folder(folder: str | Path, *, layout: str | None = None) -> Tokenizer:
    """Load `tiktoken.model` and its special tokens from a folder.

    With layout None, special names and bos/eos/pad come from `tokenizer_config.json` (`added_tokens_decoder`,
    `bos_token`, `eos_token`, `pad_token`), falling back to the K3 layout (spec 8.1) for whatever it lacks.
    With layout "k3" or "k2", that layout's names and bos/eos/pad are used instead. Extra stop tokens: our key
    `extra_eos_tokens` (a list of names) and `generation_config.json` `eos_token_id`, if present.
    """
    folder = Path(folder)
    ranks = read_tiktoken_model(folder / "tiktoken.model")
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    offsets, roles = {"k2": (K2_SPECIAL_OFFSETS, K2_ROLE_TOKENS)}.get(layout, (K3_SPECIAL_OFFSETS, K3_ROLE_TOKENS))
    if layout is None and "added_tokens_decoder" in config:
        names_by_id = {int(i): _token_name(t) for i, t in config["added_tokens_decoder"].items()}
    else:
        names_by_id = layout_names_by_id(len(ranks), offsets)
    if layout is None:
        roles = {k: _token_name(config[f"{k}_token"]) if f"{k}_token" in config else v for k, v in roles.items()}
    special = special_block(len(ranks), names_by_id)
    names_of_ids = {i: n for n, i in special.items()}
    eos_tokens = [roles["eos"], *config.get("extra_eos_tokens", []),
                  *(names_of_ids[i] for i in _generation_eos_ids(folder) if i in names_of_ids)]
    return Tokenizer(ranks, special, bos_token=roles["bos"], eos_tokens=eos_tokens, pad_token=roles["pad"],
                     name=folder.name)


def load_tokenizer(path_or_preset: str) -> Tokenizer:
    """`"tiny"` / `"tiny-code"`: the embedded K3-layout tokenizer of that shipped checkpoint (the same one);
    `"tiny-k2"`: the same BPE ranks with Kimi-Linear's K2 special names (for K2-format chat); anything else: a
    checkpoint folder (see `load_tokenizer_folder`).
    """
    if path_or_preset in SHIPPED:
        return load_tokenizer_folder(ASSETS / path_or_preset)
    if path_or_preset == "tiny-k2":
        return load_tokenizer_folder(TINY_TOKENIZER_DIR, layout="k2")
    folder = Path(path_or_preset)
    if not (folder / "tiktoken.model").exists():
        raise ValueError(f"{path_or_preset!r} is neither a tokenizer preset ('tiny', 'tiny-code', 'tiny-k2') "
                         "nor a folder with tiktoken.model")
    return load_tokenizer_folder(folder)
