"""The OpenAI- and Anthropic-shaped `/v1` API: files, batches and message batches over our jobs."""
