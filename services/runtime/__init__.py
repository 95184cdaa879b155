"""Shared plumbing of the services: settings, Redis registry, health, process helpers."""
