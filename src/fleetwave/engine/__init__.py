"""The engine: one dispatcher per conductor, workers that report by message, leases, recovery."""
