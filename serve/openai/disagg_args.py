"""`kimi-jax serve` flags of the KV connector: `--role prefill|decode|proxy`, `--kv-transfer-config`,
`--cpu-offload-gb`, and the proxy's `--prefill` / `--decode` replicas; checked before anything is built."""

from __future__ import annotations

import argparse
import dataclasses
import json

ROLES = ("prefill", "decode", "proxy")


@dataclasses.dataclass(frozen=True)
class KVTransferConfig:
    """`--kv-transfer-config` JSON.

    peers      decode: base URLs of the prefill replicas it may pull from (a request naming another source is
               refused, so a client cannot make it load entries from elsewhere)
    timeout_s  prefill: seconds an export waits to be pulled before it is dropped; decode: the pull's timeout
    """

    peers: tuple[str, ...] = ()
    timeout_s: float = 30.0

    @classmethod
    def from_json(cls, text: str | None) -> "KVTransferConfig":
        if not text:
            return cls()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"--kv-transfer-config is not JSON: {err}") from None
        if not isinstance(data, dict):
            raise ValueError("--kv-transfer-config must be a JSON object")
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"--kv-transfer-config: unknown field(s) {sorted(unknown)} (known: peers, timeout_s)")
        peers = data.get("peers", [])
        if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
            raise ValueError("--kv-transfer-config peers must be a list of URLs")
        timeout = data.get("timeout_s", 30.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"--kv-transfer-config timeout_s must be a number > 0, got {timeout!r}")
        return cls(tuple(base_url(p, "--kv-transfer-config peers") for p in peers), float(timeout))


def base_url(url: str, flag: str) -> str:
    """``http(s)://host:port`` without a trailing slash; ValueError naming ``flag`` otherwise."""
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1].strip("/")) == 0:
        raise ValueError(f"{flag}: {url!r} is not an http(s):// URL")
    return url.rstrip("/")


def add_disagg_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("prefill/decode disaggregation and CPU offload (serve.engine.kv_connector)")
    group.add_argument("--role", choices=ROLES, default=None,
                       help="prefill: compute prompts and stage their MLA pages + KDA state for a decode replica; "
                            "decode: pull them and generate; proxy: one OpenAI endpoint in front of both "
                            "(default: a standalone server)")
    group.add_argument("--kv-transfer-config", default=None,
                       help='JSON for the prefill / decode roles: {"peers": ["http://prefill:8100"], "timeout_s": '
                            '30} (peers: the prefill replicas a decode replica may pull from)')
    group.add_argument("--cpu-offload-gb", type=float, default=0.0,
                       help="GiB of host memory for a second prefix-cache tier: pages and KDA checkpoints evicted "
                            "from the device are kept there (LRU) and restored on a hit (default 0: off)")
    group.add_argument("--prefill", action="append", default=[], metavar="URL",
                       help="proxy: a prefill replica (repeatable; requests go round-robin)")
    group.add_argument("--decode", action="append", default=[], metavar="URL",
                       help="proxy: a decode replica (repeatable; requests go round-robin)")
    return parser


def check_disagg_args(args: argparse.Namespace) -> KVTransferConfig:
    """The parsed `--kv-transfer-config`; ValueError naming the flag for a combination that cannot work."""
    if args.cpu_offload_gb < 0:
        raise ValueError(f"--cpu-offload-gb must be >= 0, got {args.cpu_offload_gb}")
    if (args.prefill or args.decode) and args.role != "proxy":
        raise ValueError("--prefill / --decode name the replicas of --role proxy")
    if args.kv_transfer_config and args.role not in ("prefill", "decode"):
        raise ValueError("--kv-transfer-config configures --role prefill or --role decode")
    config = KVTransferConfig.from_json(args.kv_transfer_config)
    if args.role == "proxy":
        if not args.prefill or not args.decode:
            raise ValueError("--role proxy needs at least one --prefill URL and one --decode URL")
        args.prefill = [base_url(u, "--prefill") for u in args.prefill]
        args.decode = [base_url(u, "--decode") for u in args.decode]
    if args.role == "decode" and not config.peers:
        raise ValueError('--role decode needs --kv-transfer-config \'{"peers": ["http://<prefill host>:<port>"]}\'')
    return config
