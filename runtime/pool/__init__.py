"""The multi-model memory pool: several models' weights and KV caches on one device's memory, parts of
inactive models retained until the memory is needed (runtime/pool/pool.py; docs/multi-model.md)."""
