"""The Responses API (/v1/responses): stored, resumable responses owned by leases (docs/responses.md)."""
