"""Completion webhooks: the URL check, the payload, and its HMAC signature.

When a job with a `webhook_url` ends (succeeded, failed, cancelled), a worker POSTs the payload
below to the URL (worker/process/webhook_delivery.py). The body is signed with HMAC-SHA256 under the
deployment's `BULKINFER_WEBHOOK_SECRET`:

    X-Bulkinfer-Signature: sha256=<hex of HMAC-SHA256(secret, raw body bytes)>
    X-Bulkinfer-Timestamp: <unix seconds when this attempt was sent; also "timestamp" in the body>
    X-Bulkinfer-Delivery:  <one id per job and final state, equal across retries: dedupe on it>
    X-Bulkinfer-Event:     job.finished

Delivery is at-least-once: a receiver may see the same delivery id twice (a timeout after it had
already answered). `verify_signature` is what a receiver runs; it is dependency-free on purpose so
it can be copied as is.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from urllib.parse import urlparse, urlunparse

SIGNATURE_HEADER = "X-Bulkinfer-Signature"
TIMESTAMP_HEADER = "X-Bulkinfer-Timestamp"
DELIVERY_HEADER = "X-Bulkinfer-Delivery"
EVENT_HEADER = "X-Bulkinfer-Event"
EVENT = "job.finished"
MAX_URL_CHARS = 2048


def check_webhook_url(url: str) -> str:
    """The URL if it is an absolute http(s) URL with a host; ValueError saying why otherwise."""
    if len(url) > MAX_URL_CHARS:
        raise ValueError(f"longer than {MAX_URL_CHARS} characters")
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https"):
        raise ValueError(f"must be an http:// or https:// URL, got {url[:200]!r}")
    if not parsed.hostname:
        raise ValueError(f"no host in {url[:200]!r}")
    return url


def destination_problem(url: str, *, allow_http: bool, allow_private: bool) -> str | None:
    """Why a deployment must not POST to `url` (None: it may), as far as the URL alone tells: the
    scheme, and a host that is an address or a name of this machine. Names are resolved (and
    their addresses checked) at delivery: see `address_problem`."""
    parsed = urlparse(url)
    if parsed.scheme != "https" and not allow_http:
        return ("webhook_url must be an https:// URL (http:// is allowed only when the deployment "
                "sets webhook_allow_http)")
    host = (parsed.hostname or "").rstrip(".").lower()
    if allow_private:
        return None
    if host == "localhost" or host.endswith(".localhost"):
        return f"webhook_url's host {host!r} is this machine ({PRIVATE_HINT})"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return None
    return address_problem(host)


PRIVATE_HINT = "allowed only when the deployment sets webhook_allow_private"


NAT64 = ipaddress.ip_network("64:ff9b::/96")  # DNS64's IPv6 form of an IPv4 address: its last 32 bits


def address_problem(address: str) -> str | None:
    """Why a webhook must not go to this IP address; None only for a globally reachable one
    (`ipaddress`'s `is_global`, and not multicast). Shared address space (100.64.0.0/10, where some
    clouds' metadata services live), loopback, private and link-local (169.254.169.254) addresses are
    refused, and so are the tunnel forms that reach an IPv4 address through a relay (6to4 2002::/16,
    Teredo 2001::/32); an IPv4-mapped or NAT64 address is judged by the IPv4 address it carries."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.sixtofour is not None or ip.teredo is not None:
            kind = "6to4" if ip.sixtofour is not None else "Teredo"
            return f"webhook_url resolves to {ip}, a {kind} tunnel address ({PRIVATE_HINT})"
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif ip in NAT64:
            ip = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.is_global and not ip.is_multicast:
        return None
    kinds = [("loopback", ip.is_loopback), ("unspecified", ip.is_unspecified),
             ("link-local", ip.is_link_local), ("private", ip.is_private), ("multicast", ip.is_multicast),
             ("reserved", ip.is_reserved)]
    kind = next((name for name, matches in kinds if matches), "non-global (not publicly routable)")
    return f"webhook_url resolves to {ip}, a {kind} address ({PRIVATE_HINT})"


def redacted(url: str) -> str:
    """The URL without its query, fragment or credentials: what logs and errors may show (query
    strings often carry tokens)."""
    parsed = urlparse(url)
    netloc = parsed.hostname or ""
    if parsed.port:
        netloc += f":{parsed.port}"
    return urlunparse((parsed.scheme, netloc, parsed.path, "", "", ""))


def sign(secret: str, body: bytes) -> str:
    """The signature header's value for `body`: `sha256=<hex HMAC-SHA256>`."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify_signature(secret: str, body: bytes, header: str | None) -> bool:
    """True when `header` (X-Bulkinfer-Signature) signs exactly these raw body bytes under `secret`.

    Compare against the raw request body, before any JSON parsing. Constant-time comparison.
    To refuse replays, also check that the body's `timestamp` is recent.
    """
    if not header or not header.startswith("sha256="):
        return False
    expected = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, header.removeprefix("sha256="))


def delivery_id(job_id: str, state: str) -> str:
    """One id per job and final state: the same across retries of one delivery."""
    return f"{job_id}.{state}"


def payload(job_status: dict[str, object], timestamp: int) -> bytes:
    """The body: the event, when it was sent, and the job's final status as GET /jobs/{id} gives it."""
    job_id, state = str(job_status["job_id"]), str(job_status["state"])
    body = {"event": EVENT, "delivery_id": delivery_id(job_id, state), "timestamp": timestamp,
            "job": job_status}
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def headers(secret: str | None, body: bytes, job_id: str, state: str, timestamp: int) -> dict[str, str]:
    """The request headers; without a secret the body goes unsigned (no signature header)."""
    result = {"Content-Type": "application/json", "User-Agent": "bulkinfer-webhook",
              TIMESTAMP_HEADER: str(timestamp), DELIVERY_HEADER: delivery_id(job_id, state),
              EVENT_HEADER: EVENT}
    if secret:
        result[SIGNATURE_HEADER] = sign(secret, body)
    return result
