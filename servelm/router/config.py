"""The router's configuration: one frozen dataclass, the single source of `servelm router`'s flags.

Invariants: every field has ``metadata["help"]`` (unit and why the default); ``__post_init__``
raises ValueError naming the flag; worker URLs are normalised (no trailing slash) and unique.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

from servelm.config import opt

POLICIES = ("round_robin", "shortest_queue", "cache_aware", "random")
"""How a worker is picked (servelm.router.policies): SGLang router's names."""


def normalise_url(url: str, flag: str = "--worker") -> str:
    """``http://host:port`` without a trailing slash; ValueError naming ``flag`` otherwise."""
    text = url.strip().rstrip("/")
    if "://" not in text:
        text = "http://" + text
    parsed = urlparse(text)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"{flag}: {url!r} is not an http(s) URL")
    try:
        parsed.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        raise ValueError(f"{flag}: {url!r} has a bad port") from None
    return text


@dataclass(frozen=True)
class PrefillSpec:
    """A prefill server and its bootstrap port (None: read from its /get_server_info)."""

    url: str
    bootstrap_port: int | None = None


@dataclass(frozen=True)
class RouterConfig:
    """Everything `servelm router` (and `servelm serve --run_mode pd_master`) runs with."""

    workers: tuple[str, ...] = opt((), "Data-parallel workers (servelm or SGLang/vLLM servers): "
                                   "each request goes to one of them.", flags=("--worker",))
    prefill: tuple[PrefillSpec, ...] = opt((), "PD mode: a prefill server URL, optionally followed "
                                           "by its bootstrap port (else read from its "
                                           "/get_server_info).", flags=("--prefill",))
    decode: tuple[str, ...] = opt((), "PD mode: a decode server URL.", flags=("--decode",))
    is_pd_master: bool = opt(False, "Accept servers registering themselves with POST /register "
                             "(LightLLM's pd_master); set by `serve --run_mode pd_master`.")
    host: str = opt("127.0.0.1", "Address the router listens on.")
    port: int = opt(30000, "Port the router listens on (SGLang's default server port).")
    policy: str = opt("cache_aware", "How a worker is picked: round_robin, shortest_queue "
                      "(fewest requests in flight through this router), cache_aware (same prompt "
                      "prefix to the same worker unless the load is unbalanced) or random. "
                      "cache_aware is sglang-router's default.", choices=POLICIES)
    prefill_policy: str | None = opt(None, "PD mode: policy for prefill servers (default: --policy).",
                                     choices=POLICIES)
    decode_policy: str | None = opt(None, "PD mode: policy for decode servers (default: --policy).",
                                    choices=POLICIES)
    cache_threshold: float = opt(0.5, "cache_aware: the fraction of the prompt a worker's tree "
                                 "must match to get the request; below it the worker with the "
                                 "smallest tree gets it (room to cache). sglang-router's default.")
    balance_abs_threshold: int = opt(32, "cache_aware: the load is unbalanced (shortest queue "
                                     "decides) when max-min in-flight requests exceeds this ...")
    balance_rel_threshold: float = opt(1.0001, "... and max exceeds min times this. "
                                       "sglang-router's defaults.")
    max_tree_size: int = opt(2 ** 24, "cache_aware: characters of prompt text remembered per "
                             "worker; the least recently used branches go first (16 Mi chars, "
                             "about 64 MiB of router memory per worker at most).")
    health_check_interval_s: float = opt(5.0, "Seconds between GET /health probes of each worker.")
    health_check_timeout_s: float = opt(5.0, "Seconds a /health probe may take before it counts "
                                        "as a failure.")
    health_failure_threshold: int = opt(3, "Failed probes in a row that take a worker out of "
                                        "rotation (a refused connection while routing takes it out "
                                        "at once).")
    health_success_threshold: int = opt(2, "Passed probes in a row that put it back.")
    max_retries: int = opt(2, "Other workers tried when a worker refuses a request before "
                           "accepting it (connection refused, 503/429): never after a byte of the "
                           "response arrived, so a response is never duplicated.")
    request_timeout_s: float = opt(1800.0, "Seconds a worker may take between two bytes of a "
                                   "response before the request fails (long prompts on a CPU).")
    connect_timeout_s: float = opt(5.0, "Seconds to open a connection to a worker.")
    log_level: str = opt("info", "Router log level.",
                         choices=("debug", "info", "warning", "error", "critical"))

    def __post_init__(self) -> None:
        object.__setattr__(self, "workers", tuple(normalise_url(u) for u in self.workers))
        object.__setattr__(self, "decode", tuple(normalise_url(u, "--decode") for u in self.decode))
        object.__setattr__(self, "prefill", tuple(
            PrefillSpec(normalise_url(p.url, "--prefill"), p.bootstrap_port) for p in self.prefill))
        for flag, urls in (("--worker", self.workers), ("--decode", self.decode),
                           ("--prefill", [p.url for p in self.prefill])):
            if len(set(urls)) != len(urls):
                raise ValueError(f"{flag}: a URL is given twice")
        if self.workers and (self.prefill or self.decode):
            raise ValueError("--worker cannot be mixed with --prefill/--decode: a router runs "
                             "data-parallel workers or prefill/decode pairs")
        if bool(self.prefill) != bool(self.decode) and not self.is_pd_master:
            raise ValueError("PD mode needs at least one --prefill and one --decode server")
        if not (self.workers or self.prefill or self.is_pd_master):
            raise ValueError("give --worker URL..., or --prefill URL [PORT] ... --decode URL ..., "
                             "or run as pd_master (workers register with POST /register)")
        for spec in self.prefill:
            if spec.bootstrap_port is not None and not 0 < spec.bootstrap_port < 65536:
                raise ValueError(f"--prefill {spec.url}: bootstrap port {spec.bootstrap_port} is "
                                 "not in 1..65535")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"--cache-threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError("--balance-abs-threshold must be >= 0")
        if self.balance_rel_threshold < 1.0:
            raise ValueError("--balance-rel-threshold must be >= 1")
        if self.max_tree_size <= 0:
            raise ValueError("--max-tree-size must be > 0")
        for flag, value in (("--health-check-interval-s", self.health_check_interval_s),
                            ("--health-check-timeout-s", self.health_check_timeout_s),
                            ("--request-timeout-s", self.request_timeout_s),
                            ("--connect-timeout-s", self.connect_timeout_s)):
            if value <= 0:
                raise ValueError(f"{flag} must be > 0, got {value}")
        if self.health_failure_threshold < 1 or self.health_success_threshold < 1:
            raise ValueError("--health-failure-threshold and --health-success-threshold must be >= 1")
        if self.max_retries < 0:
            raise ValueError(f"--max-retries must be >= 0, got {self.max_retries}")

    @property
    def is_pd(self) -> bool:
        """Prefill/decode pairs (static or registered) rather than data-parallel workers."""
        return bool(self.prefill)

    def policy_for(self, role: str) -> str:
        """The policy of one pool: ``worker``, ``prefill`` or ``decode``."""
        if role == "prefill":
            return self.prefill_policy or self.policy
        if role == "decode":
            return self.decode_policy or self.policy
        return self.policy
