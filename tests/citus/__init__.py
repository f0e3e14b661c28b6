"""Citus: the build cache, a coordinator with two workers, and the tests only Citus can run."""
