"""The Megatron trainer backend: megatron-core's GPTModel loaded from and exported to HF checkpoints.

Importing this package imports nothing heavy: ``config`` is plain data (settings and training
requests carry it); the modules that need megatron-core (``model``, ``runtime``, ``backend``...) are
imported where they are used. docs/megatron.md describes the whole backend.
"""
