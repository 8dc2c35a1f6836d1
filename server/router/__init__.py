"""A pool of engine replicas that behaves like one engine: session affinity, health, failover.

affinity.py: pure routing choices; placement.py: the routing policy over them; replica.py: what the
pool knows of each server; health.py: probes, ejection, admission; rolling.py: weight updates;
config.py: PoolConfig; pool.py: the pool, composing them behind the Engine interface.
"""
