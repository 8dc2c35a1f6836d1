"""One tenant cannot read another's prompt through the engine's prefix cache (the drill's leak).

Tenant A sends a secret under a common end-user id; tenant B sends the same ``user`` with guesses and
reads ``usage.prompt_tokens_details.cached_tokens``. Before the fix the engine keyed its cache by
that id alone, so B saw 9 tokens for a wrong PIN, 19 for the right PIN and 29 of 30 for the exact text.
"""

from __future__ import annotations

from openai import OpenAI

from tests.server.conftest import Gateway

SECRET = "My PIN is 4821 and my password is hunter2"
GUESSES = ("My PIN is 9999 and my password is hunter2", "My PIN is 4821 and my password is zebra77", SECRET)


def cached_tokens(client: OpenAI, model: str, text: str, user: str) -> int:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], user=user, max_tokens=2, temperature=0
    )
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens_details.cached_tokens or 0


def test_a_tenant_probing_another_tenants_session_sees_no_cached_tokens(gateway: Gateway) -> None:
    victim, attacker = gateway.client(gateway.keys["acme"]), gateway.client(gateway.keys["globex"])
    unrelated = cached_tokens(attacker, gateway.model, "What is the tallest mountain?", user="fresh-session")
    for i, guess in enumerate(GUESSES):  # one victim per guess: the attacker's own probes stay out of it
        cached_tokens(victim, gateway.model, SECRET, user=f"victim{i}")
        assert cached_tokens(attacker, gateway.model, guess, user=f"victim{i}") <= unrelated, guess


def test_the_same_tenant_still_reuses_its_sessions_prefix(gateway: Gateway) -> None:
    client = gateway.client(gateway.keys["acme"])
    cached_tokens(client, gateway.model, SECRET, user="returning")
    assert cached_tokens(client, gateway.model, SECRET, user="returning") > 10
