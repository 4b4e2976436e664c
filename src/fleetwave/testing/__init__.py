"""Test support shipped with fleetwave: invariant checks, virtual time, fault injection."""
