"""Whether a download can be tried at all, answered in a few seconds: an offline cluster node otherwise
spends half a minute in the hub client's retries before failing.
"""
import os
import socket
from urllib.parse import urlparse

TRUE = ("1", "true", "yes", "on")
HUB_OFFLINE_ENVS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
CONNECT_TIMEOUT_S = 3.0


def marked_offline(envs=HUB_OFFLINE_ENVS) -> str:
    """The first of `envs` set to a true value ('HF_HUB_OFFLINE'), or ''."""
    return next((k for k in envs if os.environ.get(k, "").strip().lower() in TRUE), "")


def unreachable(url: str, timeout: float = CONNECT_TIMEOUT_S) -> str:
    """'' when a TCP connection to `url`'s host opens within `timeout` seconds, else why not (one phrase)."""
    parsed = urlparse(url)
    if not parsed.hostname:
        return f"{url} names no host"
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout):
            return ""
    except OSError as e:
        return f"{parsed.hostname} cannot be reached ({e.strerror or type(e).__name__})"


def hub_unavailable() -> str:
    """'' when the Hugging Face hub can be tried, else why not: HF_HUB_OFFLINE=1, or no connection."""
    env = marked_offline()
    if env:
        return f"{env}=1"
    return unreachable(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
