"""The domain: records, vocabulary, limits and checks, policies, token counting.

Pure code with no I/O: nothing here talks to PostgreSQL, the network or the
environment, so all of it can be unit-tested and hammered in isolation.
"""
