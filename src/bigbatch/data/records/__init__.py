"""Training records: their types, loading, checks, the by-index store, validation and the
up-front image checks."""
