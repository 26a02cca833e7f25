"""Integrations with third-party libraries: imported lazily, never monkey-patched."""
