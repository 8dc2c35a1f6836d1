"""A pool of engine replicas that behaves like one engine: session affinity, health, failover.

Import from the modules (``server.router.pool``): ``server.engines`` builds pools, and the pool uses
``server.engines``' pieces, so this package re-exports nothing to keep imports acyclic.
"""
