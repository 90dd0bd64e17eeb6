"""HTTP API, the Python client SDK and the CLI. Never imports `engine/` or torch."""
