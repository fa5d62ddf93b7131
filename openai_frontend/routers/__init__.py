"""Thin HTTP routers: parse, call the service, wrap SSE, let the app map typed errors to JSON."""
