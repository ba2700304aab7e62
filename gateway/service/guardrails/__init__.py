"""The policy's guardrails as a layer around the generate path: checks on the request before it
is routed, and on its answer (whole, or as a stream's text arrives)."""
