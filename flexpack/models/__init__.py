"""Reference models that run on packed rows."""
