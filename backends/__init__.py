"""Backends: the engines triage sends requests to, behind one small protocol."""
