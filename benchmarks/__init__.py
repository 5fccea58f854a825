"""Benchmarks for flash_metal: the post's figure, LLM shapes and peak memory.

Run from the repository root, e.g. ``python -m benchmarks.post_figure``; see
benchmarks/README.md.
"""
