"""Running a ``Plan``: ``ParallelModule`` (one mesh) and ``PipelineParallelModule`` (stages under
``torch.distributed.pipelining``), both built from ``autopar.passes.build_program``.

Imports ``autopar.core``, ``autopar.ir`` and ``autopar.passes``; never planning
(``docs/architecture.md``, "Layers").
"""
