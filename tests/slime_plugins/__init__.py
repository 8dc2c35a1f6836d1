"""Reference plugins written as slime users write them (slime's imports, names and contracts), for
tests/e2e/test_slime_plugins.py: each runs unchanged through a real round on the tiny model."""
