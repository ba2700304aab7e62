"""The service: a request's plan, its dispatch, decisions, embeddings, keys and quotas. No HTTP."""
