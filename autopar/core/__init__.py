"""Core values every layer shares: errors, placements, mesh axes, constraints and the ``Plan``.

Nothing here imports another autopar layer: it is the vocabulary the others speak
(``docs/architecture.md``, "Layers").
"""
