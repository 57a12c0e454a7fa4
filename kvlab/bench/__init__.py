"""Benchmarks: commands that print figures (load tests of a server, KV cache quality, ...)."""
