"""Exploring: the explorer over one step graph and lane (hold, release, force, why, diff), its terminal shell, its
web server and page. Stands on `lower` and the engine's public API."""
