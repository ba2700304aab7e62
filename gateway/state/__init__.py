"""What is kept: the state store (memory or Redis) and the batch stores (SQLite, PostgreSQL)."""
