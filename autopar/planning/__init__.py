"""From a captured step and a cluster to a ``Plan``: DTensor strategies, pricing, the ILP, the mesh
search, plan assembly, and re-solving or re-pricing saved problems.

Imports ``autopar.core``, ``autopar.ir`` and ``autopar.cost_models``; never the runtime, the passes
or inspection (``docs/architecture.md``, "Layers").
"""
