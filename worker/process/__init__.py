"""The Celery worker process: the app, its tasks, the worker's context, periodic work (reaper loop,
schedule ticker), webhooks, metrics and the status server."""
