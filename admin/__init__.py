"""The admin API (runs, model versions, promotion and rollback, audit log) and the app that mounts it."""
