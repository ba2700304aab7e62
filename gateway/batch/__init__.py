"""The Batch API's runner and its lines: an adapter over the service, as the HTTP edge is."""
