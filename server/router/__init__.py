"""A pool of engine replicas that behaves like one engine: session affinity, health, failover.

affinity.py: pure routing choices; replica.py: what the pool knows of each server; pool.py: the pool.
"""
