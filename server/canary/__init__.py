"""Canary rollouts of adapters: the decision on live ratings, and the gateway's judge that applies it."""
