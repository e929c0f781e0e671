"""Rebound adapter for Celery."""
