"""Synthetic data and tiny BERTs for the tests and every entry point's ``--smoke-test``: they exercise the
real code paths in seconds and never stand in for a result."""
