"""Caches of answers: the exact response cache and the semantic cache."""
