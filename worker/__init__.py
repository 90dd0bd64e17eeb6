"""Celery workers that host one long-lived engine each."""
