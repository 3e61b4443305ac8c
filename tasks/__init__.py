"""Prefect tasks: thin wrappers over ``compiler`` that add caching, retries, tags and logging.

``tasks.stages`` holds one task per compile stage; ``tasks.registry`` records packages in MLflow.
"""
