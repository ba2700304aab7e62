"""triage's HTTP edge. Importing this package starts nothing and imports no web framework."""
