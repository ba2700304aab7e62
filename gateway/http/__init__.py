"""The HTTP edge: the app, a route per surface, the OpenAPI document, the server's process."""
