"""The tests' Celery app with the adapter's Prometheus counters on (test_metrics.py): the
worker runs with PROMETHEUS_MULTIPROC_DIR set, so every pool child counts into it."""

import rebound_celery.metrics

from celery_app import app, dead_letter, flaky, slow  # noqa: F401 - the worker's tasks

rebound_celery.metrics.enable()
