"""Tools a test gateway runs itself (TANDEM_TOOLS=tests.server.server_tool_fixtures:get_weather)."""

from __future__ import annotations

REPORTS = {
    "Rome": "sunny, 24 C",
    "Oslo": "snow, -3 C",
    "Paris": "rain, 12 C",
    "London": "fog, 9 C",
    "Tokyo": "cloudy, 18 C",
}


def get_weather(city: str) -> str:
    """Get the current weather for a city"""
    return f"{city}: {REPORTS.get(city, 'unknown')}"
