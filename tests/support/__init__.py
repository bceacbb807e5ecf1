"""Shared test helpers: real servers (Redis, Prometheus, the tandem stack) on free loopback ports."""
