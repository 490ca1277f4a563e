"""Helpers for running and checking plans on local gloo ranks: spawning ranks, numerical parity with
single-process training, and counting the collectives a step runs.

Used by tests, benchmarks, ``autopar demo`` and ``autopar calibrate``; imports the public API
(``docs/architecture.md``, "Layers").
"""
