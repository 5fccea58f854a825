"""The model's core: what every family prices with (GPU table, time model,
counts, I/O model, baselines, anchors). Imports nothing from families/ or the
command."""
