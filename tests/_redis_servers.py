"""Placeholder: fixtures that start real redis-server processes are added by the Redis tier work."""
