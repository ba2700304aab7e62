"""Routing policies: the YAML schema (pydantic), its loader, and the pure routing core."""
