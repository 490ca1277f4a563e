"""The captured training step: ``torch.export`` capture to core aten, what autograd saves for
backward, facts about repeated layers, and ``autopar.problem/1`` files.

Imports only ``autopar.core`` (``docs/architecture.md``, "Layers").
"""
