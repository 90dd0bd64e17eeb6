"""The demo's rows: support tickets under one long shared instruction, used by the demo job
(`bulkinfer demo`) and by the engine-only demo (`bulkinfer demo --offline`)."""

from __future__ import annotations

import json

INSTRUCTION = (
    "You are a support-ticket triage assistant. Read the customer's message and answer with one "
    "category from: billing, outage, login, feature-request, other. Then give a one-line reason. "
    "Be brief and do not repeat the message. "
) * 4  # a long shared instruction, as batch users have: its KV blocks are computed once

TICKETS = [
    "I was charged twice for my subscription this month.",
    "The dashboard has been down since 9am, nothing loads.",
    "I can't log in after resetting my password.",
    "Could you add a dark mode to the mobile app?",
    "My invoice shows the wrong company address.",
    "Password reset emails never arrive.",
    "The API returns 503 for every request in eu-west.",
    "Please support exporting reports as CSV.",
]

TEMPLATE = "Ticket: {ticket}\nAnswer:"


def sample_rows(count: int) -> list[dict[str, str]]:
    return [{"id": f"ticket-{i:04d}", "ticket": f"{TICKETS[i % len(TICKETS)]} (ticket #{i})"}
            for i in range(count)]


def sample_jsonl(count: int) -> bytes:
    return b"".join(json.dumps(row).encode() + b"\n" for row in sample_rows(count))
