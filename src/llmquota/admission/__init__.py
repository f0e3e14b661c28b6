"""Admission: the Limiter and what it needs to decide fast and through outages.

Batching of concurrent decisions, the policy cache, the outage journal and
the failure modes that decide while the store is away.
"""
