"""The demo's rows: support tickets under one long shared instruction, used by the demo job
(`bulkinfer demo`) and by the engine-only demo (`bulkinfer demo --offline`)."""

from __future__ import annotations

import json
from typing import Any

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


# The real-model demo (SmolLM2-135M-Instruct by default): structured extraction of a few fields from
# short order messages under one shared instruction, with a JSON schema. A 135M model does this
# well for names and numbers (and less well for products): the outputs are real, not noise.
EXTRACTION_INSTRUCTIONS = (
    "You read short customer order messages for a shop and extract the order as JSON. "
    "name: the customer's full name, exactly as written. "
    "city: the city the order is for. "
    "quantity: how many items were ordered, as a number. "
    "product: the product ordered, without the quantity. "
    "Copy the words from the message; do not invent anything."
)

EXTRACTION_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 40},
        "quantity": {"type": "integer", "minimum": 0, "maximum": 1000},
        "product": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "city", "quantity", "product"],
    "additionalProperties": False,
}

# (message, the name, city and quantity it holds): the demo prints how many rows got them right.
ORDERS = [
    ("Alice Martin from Berlin ordered 3 blue mugs.", "Alice Martin", "Berlin", 3),
    ("Please send 12 notebooks to Omar Haddad in Cairo.", "Omar Haddad", "Cairo", 12),
    ("Kenji Sato (Osaka) wants 5 desk lamps.", "Kenji Sato", "Osaka", 5),
    ("Order for Maria Lopez, Madrid: 2 office chairs.", "Maria Lopez", "Madrid", 2),
    ("John Smith in Chicago bought 7 coffee grinders.", "John Smith", "Chicago", 7),
    ("Deliver 20 water bottles to Priya Patel, Mumbai.", "Priya Patel", "Mumbai", 20),
    ("Lena Fischer from Vienna ordered 1 standing desk.", "Lena Fischer", "Vienna", 1),
    ("Carlos Silva, Lisbon, needs 4 monitors.", "Carlos Silva", "Lisbon", 4),
    ("Emma Brown of Toronto ordered 6 yoga mats.", "Emma Brown", "Toronto", 6),
    ("Send 9 backpacks to Liam Wilson in Dublin.", "Liam Wilson", "Dublin", 9),
    ("Sofia Rossi (Rome) would like 8 tea kettles.", "Sofia Rossi", "Rome", 8),
    ("Noah Kim from Seoul ordered 15 phone cases.", "Noah Kim", "Seoul", 15),
    ("Ava Johnson in Sydney wants 2 bicycles.", "Ava Johnson", "Sydney", 2),
    ("Please ship 11 umbrellas to Lucas Dubois, Paris.", "Lucas Dubois", "Paris", 11),
    ("Mia Novak from Prague bought 3 wool scarves.", "Mia Novak", "Prague", 3),
    ("Ethan Clark, Denver: 10 hiking boots.", "Ethan Clark", "Denver", 10),
]


def order_rows(count: int) -> list[dict[str, Any]]:
    """Rows with an id, the message (as text and as a one-turn chat) and the expected fields; the
    text and the expected fields are passed through to the output."""
    rows = []
    for i in range(count):
        text, name, city, quantity = ORDERS[i % len(ORDERS)]
        rows.append({"id": f"order-{i:04d}", "order": text, "messages": [{"role": "user", "content": text}],
                     "expected": json.dumps({"name": name, "city": city, "quantity": quantity})})
    return rows


def order_jsonl(count: int) -> bytes:
    return b"".join(json.dumps(row).encode() + b"\n" for row in order_rows(count))


def extraction_spec(model: str, shard_size: int, max_tokens: int = 64) -> dict[str, Any]:
    """The demo job: the rows' messages under the shared instructions, constrained by the schema."""
    return {"model": model, "id_column": "id", "messages_column": "messages",
            "instructions": EXTRACTION_INSTRUCTIONS, "shard_size": shard_size,
            "passthrough_columns": ["order", "expected"],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "order", "schema": EXTRACTION_SCHEMA}},
            "sampling": {"temperature": 0, "max_tokens": max_tokens}}


def extraction_score(rows: list[dict[str, Any]]) -> tuple[int, int]:
    """(rows whose name, city and quantity all match the message, rows with valid JSON output)."""
    right = valid = 0
    for row in rows:
        try:
            got = json.loads(row.get("text") or "")
        except ValueError:
            continue
        valid += 1
        expected = json.loads(row["expected"])
        right += all(got.get(key) == value for key, value in expected.items())
    return right, valid
